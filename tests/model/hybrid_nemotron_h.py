"""Nemotron-H's tiny checkpoint for tests/model/test_hybrid.py: Mamba-2, attention and
expert layers as Nemotron 3's (mamba, attention, moe, mamba, attention, moe: llama.cpp's
``nemotron_h_moe`` files cannot hold a plain MLP beside experts); Mamba-2 with 4 heads of 32
in 2 groups, d_state 8; 8 relu² experts of 32 in 2 groups (1 kept), 2 per token, scaled 2.5,
a shared expert of 64. (The plain MLP layers are covered by tests/model/test_nemotron_h.py's
checkpoint without experts, ``DENSE_LAYERS``.)

Its Mamba states are 12 KiB a request (2 layers of 160 x 3 convolution inputs and 4 x 32 x 8
of S, float32), a 16-token block's KV (2 attention layers of 2 x 16 wide K and V) 8 KiB:
64-token blocks keep their end states. ``write_nemotronh_gguf``: the checkpoint as
llama.cpp's converter writes it, ``nemotron_h`` without experts, ``nemotron_h_moe`` with.

tests/model/test_nemotron_h.py covers what the shared family tests cannot."""

from __future__ import annotations

import torch
import transformers

from tests.model.hybrid_families import TINY, HybridFamily

_LAYERS = ["mamba", "attention", "moe", "mamba", "attention", "moe"]


def _nemotronh(**overrides):
    tiny = {k: v for k, v in TINY.items() if k not in ("num_hidden_layers", "intermediate_size")}
    return transformers.NemotronHConfig(**{
        **tiny, "intermediate_size": 96, "layers_block_type": _LAYERS, "head_dim": 16, "mamba_num_heads": 4,
        "mamba_head_dim": 32, "n_groups": 2, "ssm_state_size": 8, "conv_kernel": 4, "chunk_size": 16,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 64, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
        **overrides})


# A checkpoint without experts (Nemotron-H, Nemotron Nano 2): llama.cpp's nemotron_h files.
DENSE_LAYERS = ["mamba", "attention", "mlp", "mamba", "attention", "mlp"]

# llama.cpp's NemotronHModel folds NVIDIA's MTP layers into one block past the last layer:
# these names as it renames them (the rest of mtp.layers.{0,1}.* under that block's own).
_MTP_RENAMES = {"mtp.layers.0.enorm.weight": "blk.{bid}.nextn.enorm.weight",
                "mtp.layers.0.hnorm.weight": "blk.{bid}.nextn.hnorm.weight",
                "mtp.layers.0.eh_proj.weight": "blk.{bid}.nextn.eh_proj.weight",
                "mtp.layers.1.norm.weight": "blk.{bid}.post_attention_norm.weight",
                "mtp.layers.1.final_layernorm.weight": "blk.{bid}.nextn.shared_head_norm.weight"}

def write_nemotronh_gguf(model, path: str, hf_dir: str) -> str:
    """A tiny Nemotron-H checkpoint as llama.cpp's NemotronHModel writes it: its names
    (``backbone.*``), Q/K rows permuted (its LlamaModel), the Mamba tensors as its
    Mamba2Model stores them, head_count_kv and feed_forward_length per layer (0 where the
    layer has none: both 0 marks a Mamba layer). Without experts a ``nemotron_h`` file; with
    them ``nemotron_h_moe``: feed_forward_length the experts' width on the expert layers,
    each layer's experts stacked ([experts, out, in]: ``ffn_up_exps``, ``ffn_down_exps``),
    the correction bias as ``exp_probs_b.bias``, the expert keys (no gating function: the
    configs have none), ``moe_latent_size`` with a latent width, and NVIDIA's MTP layers
    (``mtp.layers.0/1``) folded into one block past the last (``nextn_predict_layers``)."""
    from tests.model.granite_gguf_writer import add_tensor, finish, gguf_writer, mamba_tensor, permute, read_state

    c = model.config
    types = [{"linear_attention": "mamba", "full_attention": "attention"}.get(t, t) for t in c.layers_block_type]
    moe = "moe" in types
    assert not (moe and "mlp" in types), "llama.cpp's nemotron_h_moe files have no plain MLP layers"
    state = read_state(hf_dir)
    mtp = moe and any(name.startswith("mtp.") for name in state)
    n = len(types) + mtp   # the MTP block: attention and experts
    kv = [c.num_key_value_heads if t == "attention" else 0 for t in types] + [c.num_key_value_heads] * mtp
    ff_width = c.moe_intermediate_size if moe else c.intermediate_size
    ff = [ff_width if t in ("mlp", "moe") else 0 for t in types] + [ff_width] * mtp
    w, table = gguf_writer(path, "nemotron_h_moe" if moe else "nemotron_h", n)
    w.add_context_length(2 ** 20)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(n)
    w.add_feed_forward_length(ff)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(kv)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    if moe:   # the converter's base class writes the config's layer_norm_epsilon under this key
        w.add_layer_norm_eps(c.layer_norm_epsilon)
    else:
        w.add_layer_norm_rms_eps(c.layer_norm_epsilon)
    w.add_vocab_size(c.vocab_size)
    w.add_ssm_conv_kernel(c.conv_kernel)
    w.add_ssm_state_size(c.ssm_state_size)
    w.add_ssm_group_count(c.n_groups)
    w.add_ssm_inner_size(c.mamba_num_heads * c.mamba_head_dim)
    w.add_ssm_time_step_rank(c.mamba_num_heads)
    w.add_rope_scaling_finetuned(False)
    if moe:
        w.add_expert_count(c.n_routed_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.moe_shared_expert_intermediate_size)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_expert_weights_norm(c.norm_topk_prob)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
        if getattr(c, "moe_latent_size", None) is not None:
            w.add_moe_latent_size(c.moe_latent_size)
        if mtp:
            w.add_nextn_predict_layers(1)
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.startswith("mtp."):
            if not mtp:
                continue
            if name in _MTP_RENAMES:
                w.add_tensor(_MTP_RENAMES[name].format(bid=n - 1), t.detach().float().numpy())
                continue
            name = f"backbone.layers.{n - 1}." + name.split(".", 3)[3]
        if name.startswith("model."):
            name = "backbone." + name[len("model."):]
        if name.endswith(".mixer.q_proj.weight"):
            t = permute(t, c.num_attention_heads)
        elif name.endswith(".mixer.k_proj.weight"):
            t = permute(t, c.num_key_value_heads)
        elif name.endswith(".mixer.gate.e_score_correction_bias"):
            name = name[: -len("e_score_correction_bias")] + "e_score_correction.bias"
        elif ".mixer.experts." in name:   # backbone.layers.{i}.mixer.experts.{e}.{proj}.weight
            parts = name.split(".")
            experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = t
            continue
        add_tensor(w, table, *mamba_tensor(name, t, c.n_groups))
    for (layer, proj), stack in sorted(experts.items()):
        add_tensor(w, table, f"model.layers.{layer}.mlp.experts.{proj}.weight",
                   torch.stack([stack[e] for e in range(len(stack))]))
    return finish(w, path)


FAMILIES = {"nemotronh": HybridFamily(_nemotronh, block=64, gguf_writer=write_nemotronh_gguf)}
