"""Random-weight GGUF tensors and files of real model shapes, for tests and benchmarks.

Random weights are fine for speed and memory (the kernels read the same bytes whatever
they hold); correctness is checked on the real model and against the reference
dequantization. Types the ``gguf`` library can quantize (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1) are quantized from random floats with its reference quantizers; the
K-quants and IQ4 types, which it only dequantizes, get random blocks whose float16
scale fields hold small finite values (any such bytes are a valid block).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

_Q = GGMLQuantizationType
# Byte offsets of the float16 fields (scales, minimums) inside one block.
FP16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    _Q.Q4_0: (0,), _Q.Q4_1: (0, 2), _Q.Q5_0: (0,), _Q.Q5_1: (0, 2), _Q.Q8_0: (0,),
    _Q.Q2_K: (80, 82), _Q.Q3_K: (108,), _Q.Q4_K: (0, 2), _Q.Q5_K: (0, 2), _Q.Q6_K: (208,),
    _Q.IQ4_NL: (0,), _Q.IQ4_XS: (0,),
}
QUANTIZABLE = (_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.MXFP4)
# Byte offsets of E8M0 scales (a power of two each) inside one block.
E8M0_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {_Q.MXFP4: (0,)}


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> Q4_K blocks (uint8 [rows, cols / 256 * 144]): each group of
    32 weights as d * sc * q - dmin * m (q in 0..15) with its minimum and range, sc and m
    6-bit multiples of the block's d and dmin (a plain min/max fit, not llama.cpp's search;
    the gguf library only dequantizes K-quants)."""
    rows, cols = w.shape
    if cols % 256:
        raise ValueError(f"{cols} columns are not whole Q4_K blocks of 256")
    nb = rows * cols // 256
    x = w.reshape(nb, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0.0)
    scale, mins = (x.max(-1) - lo) / 15.0, -lo
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (mins.max(-1) / 63.0).astype(np.float16)

    def safe(v: np.ndarray) -> np.ndarray:
        return np.where(v > 0, v, 1.0).astype(np.float32)

    sc = np.clip(np.round(scale / safe(d)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mins / safe(dmin)[:, None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.round((x + (dmin.astype(np.float32)[:, None] * m)[..., None]) / safe(step)[..., None]), 0, 15)
    q = q.astype(np.uint8)
    packed = np.empty((nb, 12), np.uint8)   # ggml's get_scale_min_k4 layout
    packed[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(nb, 128)   # 32 bytes: groups 2j (low), 2j + 1 (high)
    blocks = np.concatenate([d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2), packed, qs], axis=1)
    return blocks.reshape(rows, cols // 256 * 144)


def random_blocks(ggml_type: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator,
                  std: float = 0.02, reference_quantizer: bool = True) -> np.ndarray:
    """uint8 [rows, bytes per row]: a random [rows, cols] weight stored as ``ggml_type``;
    quantized from random floats by the gguf library where it can (and
    ``reference_quantizer``), else random blocks (fast: for files of billions of weights;
    random K-quant blocks are neither zero-mean nor near ``std``)."""
    if ggml_type in (_Q.F32, _Q.F16) or (ggml_type in QUANTIZABLE and reference_quantizer):
        w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)
        if ggml_type == _Q.F32:
            return w.view(np.uint8)
        if ggml_type == _Q.F16:
            return w.astype(np.float16).view(np.uint8)
        return quants.quantize(w, ggml_type)
    if ggml_type in E8M0_FIELDS:   # scales near std / 4 (codes up to 12 x a halved scale)
        block, nbytes = GGML_QUANT_SIZES[ggml_type]
        raw = rng.integers(0, 256, (rows * cols // block, nbytes), dtype=np.uint8)
        raw[:, list(E8M0_FIELDS[ggml_type])] = np.uint8(round(127 + np.log2(std / 4)) + 1)
        return raw.reshape(rows, cols // block * nbytes)
    if ggml_type not in FP16_FIELDS:
        raise ValueError(f"no random blocks for {ggml_type.name}")
    block, nbytes = GGML_QUANT_SIZES[ggml_type]
    if cols % block:
        raise ValueError(f"{cols} columns are not whole {ggml_type.name} blocks of {block}")
    n_blocks = rows * cols // block
    raw = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    # Scales of about std / 8 (a 4-6 bit q times a 6-bit sub-scale lands near std).
    scales = (rng.uniform(0.5, 1.5, (n_blocks, len(FP16_FIELDS[ggml_type]))) * std / 32).astype(np.float16)
    for i, off in enumerate(FP16_FIELDS[ggml_type]):
        raw[:, off : off + 2] = scales[:, i : i + 1].view(np.uint8)
    return raw.reshape(rows, cols // block * nbytes)


# ---- whole files -------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    arch: str                 # GGUF general.architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool
    rope_theta: float
    qkv_bias: bool = False
    head_dim: int | None = None   # None: hidden / heads
    qk_norm: bool = False         # Qwen3's q/k RMSNorms per head
    experts: int = 0              # a mixture of experts in every layer: how many,
    experts_used: int = 0         # how many per token,
    expert_ffn: int = 0           # and each one's intermediate size
    # GPT-OSS: biases on o_proj, the router and the experts, sink logits, a window on
    # every other layer, YaRN (factor, original context), the MLP's norm named
    # post_attention_norm.
    gpt_oss: bool = False
    sliding_window: int = 0
    yarn: tuple[float, int] | None = None
    # Qwen3.5: Gated DeltaNet layers (key heads, value heads, key size, value size, conv
    # width) with every full_attention_interval-th layer gated attention on a quarter of
    # each head's rotary dimensions.
    linear: tuple[int, int, int, int, int] | None = None
    full_attention_interval: int = 4
    # Llama 4: experts on every moe_interval-th layer (dense MLPs between), a shared expert
    # of the experts' width beside them.
    moe_interval: int = 1
    shared_expert: bool = False
    # Gemma 4: every window_period-th layer (and the last) global, its heads global_head_dim
    # wide, global_kv_heads of them, its values its keys (no attn_v); experts beside each
    # dense MLP (ffn) with their own norms, a router scale and per-expert scales.
    gemma4: bool = False
    global_head_dim: int = 0
    global_kv_heads: int = 0
    window_period: int = 6

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % self.window_period == 0 or layer == self.layers - 1

    def is_linear(self, layer: int) -> bool:
        return self.linear is not None and (layer + 1) % self.full_attention_interval != 0

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and (layer + 1) % self.moe_interval == 0

    def layer_heads(self, layer: int) -> tuple[int, int]:
        """(KV heads, head size) of a layer."""
        if self.gemma4 and self.is_global(layer):
            return self.global_kv_heads, self.global_head_dim
        return self.kv_heads, self.head_size

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads


# Real models' shapes (their own vocabularies replaced by the bundled tokenizer's 49,152).
SHAPES: dict[str, ModelShape] = {
    "smollm2-135m": ModelShape("llama", 576, 30, 9, 3, 1536, True, 100000.0),
    "qwen2.5-0.5b": ModelShape("qwen2", 896, 24, 14, 2, 4864, True, 1000000.0, qkv_bias=True),
    "llama-3.2-1b": ModelShape("llama", 2048, 16, 32, 8, 8192, True, 500000.0),
    "llama-3.2-3b": ModelShape("llama", 3072, 28, 24, 8, 8192, True, 500000.0),
    "llama-3.1-8b": ModelShape("llama", 4096, 32, 32, 8, 14336, False, 500000.0),
    "qwen3-0.6b": ModelShape("qwen3", 1024, 28, 16, 8, 3072, True, 1000000.0, head_dim=128, qk_norm=True),
    "qwen3-1.7b": ModelShape("qwen3", 2048, 28, 16, 8, 6144, True, 1000000.0, head_dim=128, qk_norm=True),
    "qwen3-4b": ModelShape("qwen3", 2560, 36, 32, 8, 9728, True, 1000000.0, head_dim=128, qk_norm=True),
    "qwen3-8b": ModelShape("qwen3", 4096, 36, 32, 8, 12288, False, 1000000.0, head_dim=128, qk_norm=True),
    # Qwen3-30B-A3B's structure (128-wide heads, 4 KV heads, top-8 of many small experts)
    # at a size this machine holds twice over: 1.6B parameters, 0.34B active per token.
    "qwen3-moe-1.6b-a0.3b": ModelShape("qwen3moe", 1024, 16, 16, 4, 3072, True, 1000000.0, head_dim=128,
                                       qk_norm=True, experts=64, experts_used=8, expert_ffn=512),
    # Qwen3.5-2B: 18 Gated DeltaNet layers (16 key and 16 value heads of 128) and 6 gated
    # attention layers (8 heads of 256, 2 KV heads).
    "qwen3.5-2b": ModelShape("qwen35", 2048, 24, 8, 2, 6144, True, 10000000.0, head_dim=256, qk_norm=True,
                             linear=(16, 16, 128, 128, 4)),
    # gpt-oss-20b (21B parameters, 3.6B active: top-4 of 32 experts per layer).
    "gpt-oss-20b": ModelShape("gpt-oss", 2880, 24, 64, 8, 2880, False, 150000.0, qkv_bias=True, head_dim=64,
                              experts=32, experts_used=4, expert_ffn=2880, gpt_oss=True, sliding_window=128,
                              yarn=(32.0, 4096)),
    # Llama 4 Scout's structure (a MoE layer everywhere: top-1 of 16 experts plus a shared
    # expert; chunked attention with every fourth layer global) at a size this machine
    # holds: 2.1B parameters, 0.4B active per token.
    # Gemma 4 26B-A4B's structure (256-wide heads, 512 on the global layers with 2 KV heads
    # and values from keys, top-8 of 64 small experts beside a dense MLP on every layer) at
    # a size this machine holds: 3.8B parameters, 0.9B active per token.
    "gemma4-moe-4b": ModelShape("gemma4", 2048, 16, 8, 4, 2048, True, 1000000.0, head_dim=256, qk_norm=True,
                                experts=64, experts_used=8, expert_ffn=512, sliding_window=1024, gemma4=True,
                                global_head_dim=512, global_kv_heads=2),
    "llama4-scout-2b": ModelShape("llama4", 2048, 16, 32, 8, 4096, False, 500000.0, head_dim=64,
                                  experts=16, experts_used=1, expert_ffn=1024, shared_expert=True),
}
# File types: F16, or llama.cpp's mixes written directly as random blocks.
FILE_TYPES = ("F16", "Q8_0", "Q4_K_M", "Q4_0", "MXFP4")
# llama.cpp's fallback where a row is not whole 256-weight blocks.
_FALLBACK = {_Q.Q4_K: _Q.Q5_0, _Q.Q5_K: _Q.Q5_1, _Q.Q6_K: _Q.Q8_0, _Q.Q2_K: _Q.IQ4_NL, _Q.Q3_K: _Q.IQ4_NL}


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get Q6_K in a Q4_K_M file."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(file_type: str, name: str, layer: int, layers: int, cols: int, tied: bool) -> GGMLQuantizationType:
    """The type a ``file_type`` file stores tensor ``name`` (llama.cpp's Q4_K_M recipe)."""
    if name.endswith("ffn_gate_inp.weight"):
        return _Q.F32   # MoE routers stay float32 in llama.cpp's files
    if file_type == "MXFP4":   # llama.cpp's GPT-OSS files: experts in MXFP4, the rest float16
        return _Q.MXFP4 if name.endswith("_exps.weight") else _Q.F16
    if file_type == "F16":
        return _Q.F16
    if file_type in ("Q8_0", "Q4_0"):
        t = _Q[file_type]
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            t = _Q.Q6_K if cols % 256 == 0 else _Q.Q8_0
        return t
    t = _Q.Q4_K
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        t = _Q.Q6_K
    elif name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")) and \
            _use_more_bits(layer, layers):
        t = _Q.Q6_K
    if cols % 256:
        t = _FALLBACK.get(t, t)
    return t


def _tensors(shape: ModelShape, vocab: int) -> list[tuple[str, tuple[int, int] | tuple[int], int]]:
    """(name, numpy shape, layer) of every tensor, in llama.cpp's order."""
    h, hd = shape.hidden, shape.head_size
    out: list = [("token_embd.weight", (vocab, h), -1)]
    if shape.gemma4:   # the global layers' proportional RoPE (rope_freqs_of)
        out.append(("rope_freqs.weight", (shape.global_head_dim // 2,), -1))
    for i in range(shape.layers):
        b = f"blk.{i}."
        if shape.gemma4:
            out += _gemma4_layer(shape, b, i)
            continue
        if shape.is_linear(i):   # Qwen3.5's Gated DeltaNet
            nk, nv, dk, dv, kernel = shape.linear
            conv = 2 * nk * dk + nv * dv
            out += [(b + "attn_norm.weight", (h,), i), (b + "attn_qkv.weight", (conv, h), i),
                    (b + "attn_gate.weight", (nv * dv, h), i), (b + "ssm_beta.weight", (nv, h), i),
                    (b + "ssm_alpha.weight", (nv, h), i), (b + "ssm_conv1d.weight", (conv, kernel), i),
                    (b + "ssm_dt.bias", (nv,), i), (b + "ssm_a", (nv,), i), (b + "ssm_norm.weight", (dv,), i),
                    (b + "ssm_out.weight", (h, nv * dv), i), (b + "post_attention_norm.weight", (h,), i),
                    (b + "ffn_gate.weight", (shape.ffn, h), i), (b + "ffn_up.weight", (shape.ffn, h), i),
                    (b + "ffn_down.weight", (h, shape.ffn), i)]
            continue
        q_rows = shape.heads * hd * (2 if shape.linear else 1)   # Qwen3.5: a gate row per query row
        out += [(b + "attn_norm.weight", (h,), i), (b + "attn_q.weight", (q_rows, h), i),
                (b + "attn_k.weight", (shape.kv_heads * hd, h), i), (b + "attn_v.weight", (shape.kv_heads * hd, h), i)]
        if shape.qkv_bias:
            out += [(b + "attn_q.bias", (shape.heads * hd,), i), (b + "attn_k.bias", (shape.kv_heads * hd,), i),
                    (b + "attn_v.bias", (shape.kv_heads * hd,), i)]
        if shape.qk_norm:
            out += [(b + "attn_q_norm.weight", (hd,), i), (b + "attn_k_norm.weight", (hd,), i)]
        norm = "post_attention_norm" if shape.gpt_oss or shape.linear else "ffn_norm"
        out += [(b + "attn_output.weight", (h, shape.heads * hd), i), (b + f"{norm}.weight", (h,), i)]
        if shape.gpt_oss:
            out += [(b + "attn_output.bias", (h,), i), (b + "attn_sinks.weight", (shape.heads,), i)]
        if shape.is_moe(i):
            e, f = shape.experts, shape.expert_ffn
            out += [(b + "ffn_gate_inp.weight", (e, h), i), (b + "ffn_gate_exps.weight", (e, f, h), i),
                    (b + "ffn_up_exps.weight", (e, f, h), i), (b + "ffn_down_exps.weight", (e, h, f), i)]
            if shape.gpt_oss:
                out += [(b + "ffn_gate_inp.bias", (e,), i), (b + "ffn_gate_exps.bias", (e, f), i),
                        (b + "ffn_up_exps.bias", (e, f), i), (b + "ffn_down_exps.bias", (e, h), i)]
            if shape.shared_expert:
                out += [(b + "ffn_gate_shexp.weight", (f, h), i), (b + "ffn_up_shexp.weight", (f, h), i),
                        (b + "ffn_down_shexp.weight", (h, f), i)]
        else:
            out += [(b + "ffn_gate.weight", (shape.ffn, h), i), (b + "ffn_up.weight", (shape.ffn, h), i),
                    (b + "ffn_down.weight", (h, shape.ffn), i)]
    out.append(("output_norm.weight", (h,), -1))
    if not shape.tied:
        out.append(("output.weight", (vocab, h), -1))
    return out


def _gemma4_layer(shape: ModelShape, b: str, i: int) -> list[tuple[str, tuple[int, ...], int]]:
    """One Gemma 4 layer's tensors, as llama.cpp's converter names them."""
    h = shape.hidden
    kv, hd = shape.layer_heads(i)
    out = [(b + "attn_norm.weight", (h,), i), (b + "attn_q.weight", (shape.heads * hd, h), i),
           (b + "attn_k.weight", (kv * hd, h), i)]
    if not shape.is_global(i):   # the global layers' values are their keys
        out.append((b + "attn_v.weight", (kv * hd, h), i))
    out += [(b + "attn_q_norm.weight", (hd,), i), (b + "attn_k_norm.weight", (hd,), i),
            (b + "attn_output.weight", (h, shape.heads * hd), i), (b + "post_attention_norm.weight", (h,), i),
            (b + "layer_output_scale.weight", (1,), i), (b + "ffn_norm.weight", (h,), i),
            (b + "ffn_gate.weight", (shape.ffn, h), i), (b + "ffn_up.weight", (shape.ffn, h), i),
            (b + "ffn_down.weight", (h, shape.ffn), i), (b + "post_ffw_norm.weight", (h,), i)]
    if shape.experts:
        e, f = shape.experts, shape.expert_ffn
        out += [(b + "ffn_gate_inp.weight", (e, h), i), (b + "ffn_gate_inp.scale", (h,), i),
                (b + "pre_ffw_norm_2.weight", (h,), i), (b + "post_ffw_norm_1.weight", (h,), i),
                (b + "post_ffw_norm_2.weight", (h,), i), (b + "ffn_gate_up_exps.weight", (e, 2 * f, h), i),
                (b + "ffn_down_exps.weight", (e, h, f), i), (b + "ffn_down_exps.scale", (e,), i)]
    return out


def write_model(path: str, shape_name: str | ModelShape, file_type: str = "Q4_K_M", tokenizer_from: str | None = None,
                seed: int = 0, show_progress: bool = True,
                overrides: dict[str, GGMLQuantizationType] | None = None, quantized: bool = False,
                context_length: int = 8192) -> str:
    """Write a random-weight GGUF file of a named shape (or any ``ModelShape``), tensor by
    tensor (peak memory: one tensor), with the bundled model's tokenizer and chat
    template. ``overrides``: tensor name -> type, for tests (a type this module has no
    random blocks for is written as zeros). ``quantized``: weights quantized from random
    normal floats where the gguf library or ``quantize_q4_k`` can (slower; a model whose
    numbers behave like a real one's, for tests that compare outputs), else random blocks.
    ``context_length``: the context the file says it was trained for (an engine's default
    --max-model-len and the longest it serves without PAGODA_ALLOW_LONG_MAX_MODEL_LEN=1;
    plain RoPE, no scaling)."""
    import gguf
    from tqdm import tqdm

    from pagoda.hub.gguf_file import GGUFFile
    from pagoda.hub.paths import default_model_path

    if isinstance(shape_name, str) and shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}; known: {', '.join(SHAPES)}")
    if file_type not in FILE_TYPES:
        raise ValueError(f"file type must be one of {', '.join(FILE_TYPES)}; got {file_type!r}")
    shape = SHAPES[shape_name] if isinstance(shape_name, str) else shape_name
    overrides = overrides or {}
    src = GGUFFile(tokenizer_from or default_model_path())
    tok = {k: v for k, v in src.metadata.items() if k.startswith("tokenizer.")}
    vocab = len(tok["tokenizer.ggml.tokens"])
    a = shape.arch
    w = gguf.GGUFWriter(path, a)
    w.add_name(f"random {shape_name if isinstance(shape_name, str) else 'custom'} {file_type}")
    w.add_uint32(f"{a}.block_count", shape.layers)
    w.add_uint32(f"{a}.context_length", context_length)
    w.add_uint32(f"{a}.embedding_length", shape.hidden)
    w.add_uint32(f"{a}.feed_forward_length", shape.ffn)
    w.add_uint32(f"{a}.attention.head_count", shape.heads)
    if shape.gemma4:   # per layer (the global layers' fewer), the global layers' width as the head size
        w.add_array(f"{a}.attention.head_count_kv", [shape.layer_heads(i)[0] for i in range(shape.layers)])
    else:
        w.add_uint32(f"{a}.attention.head_count_kv", shape.kv_heads)
    w.add_float32(f"{a}.rope.freq_base", shape.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32(f"{a}.vocab_size", vocab)
    wide = shape.global_head_dim if shape.gemma4 else shape.head_size
    w.add_uint32(f"{a}.rope.dimension_count", shape.head_size // 4 if shape.linear else wide)
    w.add_uint32(f"{a}.attention.key_length", wide)
    w.add_uint32(f"{a}.attention.value_length", wide)
    if shape.gemma4:
        for key in ("attention.key_length_swa", "attention.value_length_swa", "rope.dimension_count_swa"):
            w.add_uint32(f"{a}.{key}", shape.head_size)
        w.add_float32(f"{a}.rope.freq_base_swa", 10000.0)
        w.add_array(f"{a}.attention.sliding_window_pattern", [not shape.is_global(i) for i in range(shape.layers)])
        w.add_uint32(f"{a}.attention.shared_kv_layers", 0)
        w.add_uint32(f"{a}.embedding_length_per_layer_input", 0)
        w.add_float32(f"{a}.final_logit_softcapping", 30.0)
    if shape.sliding_window:
        w.add_uint32(f"{a}.attention.sliding_window", shape.sliding_window)
    if shape.yarn is not None:
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", shape.yarn[0])
        w.add_uint32(f"{a}.rope.scaling.original_context_length", shape.yarn[1])
    if shape.linear:
        nk, nv, dk, dv, kernel = shape.linear
        w.add_uint32(f"{a}.ssm.conv_kernel", kernel)
        w.add_uint32(f"{a}.ssm.state_size", dk)
        w.add_uint32(f"{a}.ssm.group_count", nk)
        w.add_uint32(f"{a}.ssm.time_step_rank", nv)
        w.add_uint32(f"{a}.ssm.inner_size", nv * dv)
        w.add_uint32(f"{a}.full_attention_interval", shape.full_attention_interval)
        w.add_array(f"{a}.rope.dimension_sections", [11, 11, 10, 0])
    if shape.experts:
        w.add_uint32(f"{a}.expert_count", shape.experts)
        w.add_uint32(f"{a}.expert_used_count", shape.experts_used)
        w.add_uint32(f"{a}.expert_feed_forward_length", shape.expert_ffn)
        if a == "llama4":
            w.add_uint32(f"{a}.interleave_moe_layer_step", shape.moe_interval)
    w.add_uint32("general.file_type", {"F16": 1, "Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15, "MXFP4": 38}[file_type])
    w.add_uint32("general.quantization_version", 2)
    for k, v in tok.items():
        if isinstance(v, list):
            w.add_array(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        else:
            w.add_uint32(k, v)
    rng = np.random.default_rng(seed)
    plan = []
    for name, np_shape, layer in _tensors(shape, vocab):
        if len(np_shape) == 1 or name.endswith((".bias", "ssm_conv1d.weight")):   # norms, biases, convolutions
            plan.append((name, np_shape, _Q.F32))
            w.add_tensor_info(name, np_shape, np.dtype(np.float32), 4 * int(np.prod(np_shape)))
            continue
        t = overrides.get(name) or tensor_type(file_type, name, layer, shape.layers, np_shape[-1], shape.tied)
        plan.append((name, np_shape, t))
        block, nbytes = GGML_QUANT_SIZES[t]
        row_bytes = np_shape[-1] // block * nbytes
        byte_shape = (*np_shape[:-1], row_bytes)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, np_shape, t in tqdm(plan, desc=f"writing {os.path.basename(path)}", disable=not show_progress):
        if t == _Q.F32 and name.endswith("ssm_a"):
            data = -np.ones(np_shape, np.float32)   # A = -exp(A_log) < 0: a decaying memory
        elif name == "rope_freqs.weight":   # Gemma 4: a quarter of the frequencies turn, the rest 1/1e30
            turning = np_shape[0] // 4
            data = np.asarray([1.0] * turning + [1e30] * (np_shape[0] - turning), np.float32)
        elif t == _Q.F32 and name.endswith((".scale", "layer_output_scale.weight")):
            data = np.ones(np_shape, np.float32)
        elif t == _Q.F32 and name != "token_embd.weight":
            data = (np.ones(np_shape, np.float32) if name.endswith("norm.weight")
                    else rng.standard_normal(np_shape, dtype=np.float32) * np.float32(0.02))
        elif t in QUANTIZABLE or t in FP16_FIELDS or t in E8M0_FIELDS:
            rows = int(np.prod(np_shape[:-1]))
            if quantized and t == _Q.Q4_K:
                normal = rng.standard_normal((rows, np_shape[-1]), dtype=np.float32) * np.float32(0.02)
                data = quantize_q4_k(normal).reshape(*np_shape[:-1], -1)
            else:
                data = random_blocks(t, rows, np_shape[-1], rng, reference_quantizer=quantized)
                data = data.reshape(*np_shape[:-1], -1)
        else:
            block, nbytes = GGML_QUANT_SIZES[t]
            data = np.zeros((*np_shape[:-1], np_shape[-1] // block * nbytes), np.uint8)
        w.write_tensor_data(data)
    w.close()
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Write random-weight GGUF files of real model shapes.")
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", help="output .gguf path")
    ap.add_argument("--type", default="Q4_K_M", choices=FILE_TYPES,
                    help="F16 (e.g. for llama-quantize) or a mix written directly as random blocks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--context-length", type=int, default=8192,
                    help="the context the file says it was trained for (e.g. 131072 for long-context runs)")
    args = ap.parse_args(argv)
    write_model(args.out, args.shape, args.type, seed=args.seed, context_length=args.context_length)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
