"""Qwen3.5 (dense, MoE) and Qwen3-Next tiny checkpoints for tests/model/test_hybrid.py:
three Gated DeltaNet layers (2 key heads of 8, 4 value heads of 16: two value heads per
key head) to one gated attention layer with partial RoPE."""

from __future__ import annotations

import transformers

from tests.model.hybrid_families import TINY, HybridFamily

_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
               linear_conv_kernel_dim=4, head_dim=16,
               layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)


def _rope(partial: float = 0.25) -> dict:
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}


def _qwen35():
    return transformers.Qwen3_5TextConfig(**TINY, **_LINEAR, rope_parameters=_rope())


def _qwen35moe():
    tiny = {k: v for k, v in TINY.items() if k != "intermediate_size"}
    return transformers.Qwen3_5MoeTextConfig(**tiny, **_LINEAR, **_MOE, rope_parameters=_rope())


def _qwen3next():   # experts in every layer (llama.cpp's qwen3next files have no dense layer)
    return transformers.Qwen3NextConfig(**TINY, **_LINEAR, **_MOE, rope_parameters=_rope(0.5))


# Blocks whose KV outweighs a request's state (3 layers of 3.2 KiB; a 64-token block of
# the one attention layer holds 16 KiB).
FAMILIES = {
    "qwen35": HybridFamily(_qwen35, block=64, gguf_writer=lambda *a: write_qwen35_gguf(*a)),
    # One position of the 70-token prompt is 1.0e-3 (HF checkpoint) and 1.2e-3 (GGUF) off
    # transformers' chunked delta rule, every other within 4e-5 (measured).
    # In bf16, 27 of 32 positions keep transformers' top token (measured): their experts'
    # outputs rounded, picks near a tie move.
    "qwen35moe": HybridFamily(_qwen35moe, block=64, gguf_writer=lambda *a: write_qwen35_gguf(*a), logprob_tol=2e-3,
                              quantized_agree=0.8),
    # Experts in every layer: in bf16 25 of 32 positions keep transformers' top token, in
    # int8 22, from the GGUF file (float32, int8 activations) all 32 (measured).
    "qwen3next": HybridFamily(_qwen3next, block=64, gguf_writer=lambda *a: write_qwen35_gguf(*a),
                              quantized_agree=0.75),
    # A dense first layer (mlp_only_layers): HF only, llama.cpp's files have no name for it.
    "qwen3nextmixed": HybridFamily(lambda: transformers.Qwen3NextConfig(**TINY, **_LINEAR, **_MOE,
                                                                        rope_parameters=_rope(0.5),
                                                                        mlp_only_layers=[0]), block=64,
                                   quantized_agree=0.8),
}


def _tiled(t, dim: int, k_heads: int, per_k: int, size: int):
    """Value heads from grouped (by key head) to tiled order along ``dim``, as llama.cpp's
    Qwen3.5 converter reorders them."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], k_heads, per_k, size, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def write_qwen35_gguf(model, path: str, hf_dir: str, legacy_qkvz: bool = False, extra=None) -> str:
    """A tiny Qwen3.5 / Qwen3-Next checkpoint as llama.cpp's converter writes a ``qwen35`` /
    ``qwen35moe`` / ``qwen3next`` file (float32): A_log as -exp(A_log), dt_bias as the dt
    projection's bias, the convolution squeezed, zero-centred norms as 1 + w. Qwen3.5: value
    heads tiled. Qwen3-Next: value heads as HF's (grouped), in_proj_qkvz split per key head
    into [q; k; v] (attn_qkv) and z (attn_gate), in_proj_ba as it is (ssm_ba); with
    ``legacy_qkvz``, in_proj_qkvz kept whole (ssm_in), as its first converter wrote it.
    ``extra``: called with the writer to add keys (a tokenizer, M-RoPE's sections)."""
    import pathlib

    import numpy as np
    import torch
    from gguf import GGUFWriter
    from gguf.constants import MODEL_ARCH_NAMES
    from gguf.tensor_mapping import get_tensor_name_map
    from safetensors.torch import load_file

    from tests.model.hf_to_gguf import _stack_experts

    c = model.config
    moe = bool(getattr(c, "num_experts", 0))
    nxt = c.model_type == "qwen3_next"
    name = "qwen3next" if nxt else "qwen35moe" if moe else "qwen35"
    arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == name)
    table = get_tensor_name_map(arch, c.num_hidden_layers)
    w = GGUFWriter(path, name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_vocab_size(c.vocab_size)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    if nxt:   # (its converter writes the layer types, when the config has them, and the interval)
        w.add_array(f"{name}.attention.recurrent_layers", [t == "linear_attention" for t in c.layer_types])
    w.add_full_attention_interval(4)
    if moe:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if not moe or nxt:
        w.add_feed_forward_length(c.intermediate_size)
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv, r = c.linear_key_head_dim, c.linear_value_head_dim, nv // nk
    state = {}
    for f in sorted(pathlib.Path(hf_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))

    def add(hf_name: str, t) -> None:
        module, _, leaf = hf_name.rpartition(".")
        gguf_name = table.get_name(module)
        if gguf_name is None and table.get_name(hf_name) is not None:   # a bare parameter (A_log)
            gguf_name, leaf = table.get_name(hf_name), None
        assert gguf_name is not None, f"no GGUF name for {hf_name}"
        w.add_tensor(gguf_name if leaf is None else f"{gguf_name}.{leaf}", np.ascontiguousarray(t.numpy()))

    for hf_name, t in _stack_experts(state).items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = t.detach().float()
        if ".linear_attn." in hf_name and r > 1 and not nxt:
            if ".in_proj_qkv." in hf_name:
                t = torch.cat([t[:2 * nk * dk], _tiled(t[2 * nk * dk:], 0, nk, r, dv)])
            elif ".in_proj_z." in hf_name:
                t = _tiled(t, 0, nk, r, dv)
            elif ".in_proj_a." in hf_name or ".in_proj_b." in hf_name or hf_name.endswith((".A_log", ".dt_bias")):
                t = _tiled(t, 0, nk, r, 1)
            elif ".conv1d." in hf_name:
                t = torch.cat([t[:2 * nk * dk], _tiled(t[2 * nk * dk:], 0, nk, r, dv)])
            elif ".out_proj." in hf_name:
                t = _tiled(t, 1, nk, r, dv)
        if hf_name.endswith(".A_log"):
            t = -torch.exp(t)
        elif hf_name.endswith(".dt_bias"):
            hf_name = hf_name[: -len("dt_bias")] + "dt_proj.bias"
        elif ".conv1d." in hf_name:
            t = t.squeeze(1)
        elif hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
            t = t + 1.0
        if hf_name.endswith(".in_proj_qkvz.weight") and not legacy_qkvz:
            # [q, k, v, z] per key head -> [q of every head; k; v] and z
            q, k, v, z = t.view(nk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
            base = hf_name[: -len("in_proj_qkvz.weight")]
            cols = t.shape[1]
            add(base + "in_proj_qkv.weight", torch.cat([q.reshape(-1, cols), k.reshape(-1, cols),
                                                        v.reshape(-1, cols)]))
            add(base + "in_proj_z.weight", z.reshape(-1, cols))
            continue
        add(hf_name, t)
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
