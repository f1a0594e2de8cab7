"""Nemotron-H's tiny checkpoint for tests/model/test_hybrid.py: one layer of each kind and
two of the state and attention ones (mamba, attention, moe, mamba, attention, mlp); Mamba-2
with 4 heads of 32 in 2 groups, d_state 8; 8 relu² experts of 32 in 2 groups (1 kept),
2 per token, scaled 2.5, a shared expert of 64.

Its Mamba states are 12 KiB a request (2 layers of 160 x 3 convolution inputs and 4 x 32 x 8
of S, float32), a 16-token block's KV (2 attention layers of 2 x 16 wide K and V) 8 KiB:
64-token blocks keep their end states. ``write_nemotronh_gguf``: a checkpoint without experts
as llama.cpp's ``nemotron_h`` file.

tests/model/test_nemotron_h.py covers what the shared family tests cannot."""

from __future__ import annotations

import transformers

from tests.model.hybrid_families import TINY, HybridFamily

_LAYERS = ["mamba", "attention", "moe", "mamba", "attention", "mlp"]


def _nemotronh(**overrides):
    tiny = {k: v for k, v in TINY.items() if k not in ("num_hidden_layers", "intermediate_size")}
    return transformers.NemotronHConfig(**{
        **tiny, "intermediate_size": 96, "layers_block_type": _LAYERS, "head_dim": 16, "mamba_num_heads": 4,
        "mamba_head_dim": 32, "n_groups": 2, "ssm_state_size": 8, "conv_kernel": 4, "chunk_size": 16,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 64, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
        **overrides})


# llama.cpp's nemotron_h files have no experts (tests/model/test_nemotron_h.py reads one of
# this: an MLP in the MoE layer's place); its nemotron_h_moe ones are not read yet.
DENSE_LAYERS = ["mamba", "attention", "mlp", "mamba", "attention", "mlp"]

FAMILIES = {"nemotronh": HybridFamily(_nemotronh, block=64)}


def write_nemotronh_gguf(model, path: str, hf_dir: str) -> str:
    """A tiny Nemotron-H checkpoint without experts as llama.cpp's NemotronHModel writes a
    ``nemotron_h`` file: its names (``backbone.*``), Q/K rows permuted (its LlamaModel), the
    Mamba tensors as its Mamba2Model stores them, head_count_kv and feed_forward_length per
    layer (0 where the layer has none: both 0 marks a Mamba layer)."""
    from tests.model.granite_gguf_writer import add_tensor, finish, gguf_writer, mamba_tensor, permute, read_state

    c = model.config
    types = [{"linear_attention": "mamba", "full_attention": "attention"}.get(t, t) for t in c.layers_block_type]
    n = len(types)
    w, table = gguf_writer(path, "nemotron_h", n)
    w.add_context_length(2 ** 20)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(n)
    w.add_feed_forward_length([c.intermediate_size if t == "mlp" else 0 for t in types])
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if t == "attention" else 0 for t in types])
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.layer_norm_epsilon)
    w.add_vocab_size(c.vocab_size)
    w.add_ssm_conv_kernel(c.conv_kernel)
    w.add_ssm_state_size(c.ssm_state_size)
    w.add_ssm_group_count(c.n_groups)
    w.add_ssm_inner_size(c.mamba_num_heads * c.mamba_head_dim)
    w.add_ssm_time_step_rank(c.mamba_num_heads)
    w.add_rope_scaling_finetuned(False)
    for name, t in read_state(hf_dir).items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.startswith("model."):
            name = "backbone." + name[len("model."):]
        if name.endswith(".mixer.q_proj.weight"):
            t = permute(t, c.num_attention_heads)
        elif name.endswith(".mixer.k_proj.weight"):
            t = permute(t, c.num_key_value_heads)
        add_tensor(w, table, *mamba_tensor(name, t, c.n_groups))
    return finish(w, path)


