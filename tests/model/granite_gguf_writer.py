"""GGUF files of the tiny Mamba-2 hybrids' checkpoints as llama.cpp's converter writes them
(float32): Granite 4.0-H's ``granitehybrid`` here, and what its Mamba2Model does to every
Mamba-2 mixer's tensors (``mamba_tensor``), which the Nemotron-H and Falcon-H1 writers
(tests/model/hybrid_nemotron_h.py, hybrid_falcon_h1.py) share."""

from __future__ import annotations

import pathlib

import numpy as np
import torch


def read_state(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for f in sorted(pathlib.Path(hf_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def gguf_writer(path: str, arch_name: str, layers: int):
    """(the writer, llama.cpp's tensor name table for ``arch_name``)."""
    from gguf import GGUFWriter
    from gguf.constants import MODEL_ARCH_NAMES
    from gguf.tensor_mapping import get_tensor_name_map

    arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch_name)
    return GGUFWriter(path, arch_name), get_tensor_name_map(arch, layers)


def mamba_tensor(name: str, t: torch.Tensor, groups: int) -> tuple[str, torch.Tensor]:
    """llama.cpp's Mamba2Model.modify_tensors: dt_bias renamed the dt projection's bias, the
    convolution squeezed, A_log as -exp(A_log) and D as [heads, 1], the gated norm as
    [groups, inner / groups]; other tensors as they are."""
    if name.endswith(".dt_bias"):
        return name[: -len("dt_bias")] + "dt_proj.bias", t
    if name.endswith(".conv1d.weight"):
        return name, t.squeeze()
    if name.endswith(".A_log"):
        return name, -torch.exp(t).reshape(-1, 1)
    if name.endswith(".D"):
        return name, t.reshape(-1, 1)
    if name.endswith((".mamba.norm.weight", ".mixer.norm.weight")):
        return name, t.reshape(groups, -1)
    return name, t


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: each head's [first half | second half] rows interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_tensor(w, table, name: str, t: torch.Tensor) -> None:
    """``name`` (an HF name llama.cpp's table knows) under its GGUF name: ``blk.N.ssm_a``,
    ``blk.N.ssm_d`` bare (no ``.weight``), as the converter writes them."""
    module, _, leaf = name.rpartition(".")
    gguf_name = table.get_name(module)
    if gguf_name is None and table.get_name(name) is not None:   # a bare parameter (A_log, D)
        gguf_name, leaf = table.get_name(name), None
    assert gguf_name is not None, f"no GGUF name for {name}"
    w.add_tensor(gguf_name if leaf is None else f"{gguf_name}.{leaf}",
                 np.ascontiguousarray(t.detach().float().numpy()))


def finish(w, path: str) -> str:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_named(w, tensor, bid: int, t: torch.Tensor) -> None:
    """``t`` under llama.cpp's name for ``tensor`` (a ``gguf.MODEL_TENSOR``) of layer ``bid``,
    as the converter names what it splits itself (``format_tensor_name``)."""
    from gguf.constants import TENSOR_NAMES

    w.add_tensor(TENSOR_NAMES[tensor].format(bid=bid) + ".weight", np.ascontiguousarray(t.detach().float().numpy()))


def write_granite_hybrid_gguf(model, path: str, hf_dir: str) -> str:
    """A tiny Granite 4.0-H checkpoint as llama.cpp's GraniteHybridModel writes it: the
    shared MLP's input_linear split into gate and up, Q/K rows permuted, the Mamba tensors as
    ``mamba_tensor``, head_count_kv 0 for the Mamba layers, Granite's scales. With experts
    (its GraniteMoeModel's part): expert_count and expert_used_count, feed_forward_length
    the experts' width; each layer's block_sparse_moe.input_linear [experts, 2 x width,
    hidden] split into ffn_gate_exps and ffn_up_exps, output_linear as ffn_down_exps, the
    router as ffn_gate_inp, the shared MLP as ffn_{gate,up,down}_shexp. One departure:
    ``rope.scaling.finetuned`` (llama.cpp's RoPE switch) is the checkpoint's
    position_embedding_type, where the converter writes False for every Granite 4.0-H (all
    published ones are "nope"; this tiny one uses RoPE)."""
    c = model.config
    n = c.num_hidden_layers
    attention = [t in ("attention", "full_attention") for t in c.layer_types]
    head_dim = c.hidden_size // c.num_attention_heads
    w, table = gguf_writer(path, "granitehybrid", n)
    rope = c.position_embedding_type == "rope"
    w.add_context_length(c.max_position_embeddings if rope else 2 ** 20)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(n)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if a else 0 for a in attention])
    w.add_rope_freq_base(float(c.rope_theta if hasattr(c, "rope_theta") else c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(head_dim)
    w.add_attention_scale(c.attention_multiplier)
    w.add_embedding_scale(c.embedding_multiplier)
    w.add_residual_scale(c.residual_multiplier)
    w.add_logit_scale(c.logits_scaling)
    w.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
    w.add_ssm_conv_kernel(c.mamba_d_conv)
    w.add_ssm_state_size(c.mamba_d_state)
    w.add_ssm_group_count(c.mamba_n_groups)
    w.add_ssm_inner_size(c.mamba_expand * c.hidden_size)
    w.add_ssm_time_step_rank(c.mamba_n_heads)
    w.add_rope_scaling_finetuned(rope)
    experts = getattr(c, "num_local_experts", None)
    if experts is not None:   # the converter writes the count even where it is 0 (Micro)
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    from gguf.constants import MODEL_TENSOR as T

    for name, t in read_state(hf_dir).items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        bid = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if name.endswith(".block_sparse_moe.input_linear.weight"):   # [experts, 2 x width, hidden]
            gate, up = t.split(c.intermediate_size, dim=-2)
            add_named(w, T.FFN_GATE_EXP, bid, gate)
            add_named(w, T.FFN_UP_EXP, bid, up)
            continue
        if name.endswith(".shared_mlp.input_linear.weight"):
            gate, up = t.split(c.shared_intermediate_size, dim=-2)
            add_named(w, T.FFN_GATE_SHEXP if experts else T.FFN_GATE, bid, gate)
            add_named(w, T.FFN_UP_SHEXP if experts else T.FFN_UP, bid, up)
            continue
        if experts and name.endswith(".shared_mlp.output_linear.weight"):
            add_tensor(w, table, name, t)   # the table's ffn_down_shexp
            continue
        name = name.replace(".shared_mlp.output_linear.", ".mlp.down_proj.")
        if name.endswith(".self_attn.q_proj.weight"):
            t = permute(t, c.num_attention_heads)
        elif name.endswith(".self_attn.k_proj.weight"):
            t = permute(t, c.num_key_value_heads)
        add_tensor(w, table, *mamba_tensor(name, t, c.mamba_n_groups))
    return finish(w, path)
