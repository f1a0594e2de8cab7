"""Float-quantized weights (FP8 e4m3, NVFP4) in block layouts of pagoda's own, and
MXFP4 in ggml's.

A checkpoint stores an FP8 layer as e4m3 bytes plus float scales of some granularity
(one per tensor, per output channel, per 128 x 128 block, per group), and an NVFP4 one
as e2m1 nibbles with an e4m3 scale per 16 weights and one float32 global scale. The
kernels (pagoda/csrc/gguf_blocks.cpp) read rows of blocks, so each row's weights are
regrouped here into blocks of 128 (or 32 where in_features is not a multiple of 128),
each with its scales inline:

    FP8_128    [s: float32][128 x e4m3]                    w = e4m3 * s
    NVFP4_128  [g: float32][8 x e4m3 scale][64 nibble bytes]  w = e2m1 * (scale / g)

(FP8_32 and NVFP4_32 the same for 32 weights). A scale that covers several blocks (per
tensor, per channel, a 128 x 128 block) is repeated in each of them: 4 bytes per 128
weights, 3% over the checkpoint's size for FP8; NVFP4 keeps its e4m3 scales as they are
and repeats only g (0.25 bits per weight).

The dequantized values are the checkpoints' reference ones bit for bit: FP8 is one
float32 product ``w.float() * scale.float()`` (DeepSeek-V3's and transformers'
dequantization; scales in bfloat16, float16 or E8M0 convert to float32 exactly), NVFP4
compressed-tensors' ``e2m1 * (scale.float() / global_scale)`` with its float32 quotient,
before the decompressor's final cast to the model's dtype. compressed-tensors' MXFP4
(e2m1 nibbles, an E8M0 exponent per 32) is exactly ggml's MXFP4 block once its nibbles
are reordered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from pagoda.model.hf_quant.base import QuantConfigError
from pagoda.model.layers.blocks import BlockWeight, own_type, release_checkpoint_pages  # noqa: F401 (re-exported)

# Ids 220-239: pagoda's float formats (blocks.py).
FP8_32 = own_type(220, "FP8_32", 32, 4 + 32)
FP8_128 = own_type(221, "FP8_128", 128, 4 + 128)
NVFP4_32 = own_type(222, "NVFP4_32", 32, 4 + 2 + 16)
NVFP4_128 = own_type(223, "NVFP4_128", 128, 4 + 8 + 64)

FP8_DTYPES = (torch.float8_e4m3fn,)
# float8 dtypes a checkpoint may hold that pagoda does not read as weights.
OTHER_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                         if hasattr(torch, n))


@dataclass(frozen=True)
class ScaleBlocks:
    """How many weights one scale covers: ``rows`` output channels by ``cols`` inputs
    (per tensor: all of them; per channel: 1 x in_features; DeepSeek-V3: 128 x 128;
    per group: 1 x group_size)."""

    rows: int
    cols: int

    def shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        """The scale tensor's shape for a weight of that shape."""
        return -(-out_features // self.rows), -(-in_features // self.cols)


def _block_size(name: str, in_features: int, scale_cols: int) -> int:
    """128 where the row splits into blocks of 128 that each lie under one scale, else 32."""
    for block in (128, 32):
        if in_features % block == 0 and (scale_cols % block == 0 or scale_cols >= in_features):
            return block
    raise QuantConfigError(
        f"{name}: pagoda reads FP8 weights in blocks of 32 or 128 inputs under one scale; "
        f"in_features {in_features} with scales over {scale_cols} inputs do not split so "
        f"(in_features and the scale block's width must be multiples of 32)")


def float_scale(name: str, scale: torch.Tensor) -> torch.Tensor:
    """A checkpoint's scale tensor as float32 (exact: float32, bfloat16, float16 and E8M0
    scales convert without rounding; uint8 is read as E8M0 bits, transformers'
    ``scale_fmt: ue8m0``)."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    if scale.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu, torch.float8_e4m3fn):
        raise QuantConfigError(f"{name}: a scale of dtype {scale.dtype} is not supported "
                               "(float32, bfloat16, float16, E8M0 or e4m3)")
    return scale.float()


def fp8_weight(name: str, weight: torch.Tensor, scale: torch.Tensor, scale_name: str,
               blocks: ScaleBlocks) -> BlockWeight:
    """An FP8 weight [out, in] (e4m3) whose scale ``scale`` covers ``blocks`` weights
    each, as FP8_128 / FP8_32 blocks. ``name`` / ``scale_name`` name the tensors in errors."""
    if weight.dtype in OTHER_FP8_DTYPES:
        raise QuantConfigError(f"{name}: FP8 weights of dtype {weight.dtype} are not supported (e4m3fn only)")
    if weight.dtype not in FP8_DTYPES or weight.dim() != 2:
        raise QuantConfigError(f"{name}: expected a 2-D float8_e4m3fn weight, got {weight.dtype} "
                               f"of shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    expected = blocks.shape(out_features, in_features)
    s = float_scale(scale_name, scale)
    # Dimensions of 1 may be left out: a per-tensor scale of shape () or [1], per-channel [out].
    if [d for d in s.shape if d != 1] == [d for d in expected if d != 1]:
        s = s.reshape(expected)
    if tuple(s.shape) != expected:
        raise QuantConfigError(f"{scale_name}: shape {tuple(scale.shape)} does not fit the weight "
                               f"{tuple(weight.shape)} with one scale per {blocks.rows} x {blocks.cols} "
                               f"weights (expected {expected})")
    block = _block_size(name, in_features, blocks.cols)
    n_blocks = in_features // block
    # The scale of each (row, block of the row): block b starts at input b * block.
    per_row = s.repeat_interleave(blocks.rows, dim=0)[:out_features]
    per_block = per_row[:, torch.arange(n_blocks) * block // blocks.cols].contiguous()
    # Written in place: no weight-sized temporaries (their freed memory would stay in the heap).
    data = torch.empty(out_features, n_blocks, 4 + block, dtype=torch.uint8)
    data[:, :, :4] = per_block.view(torch.uint8).reshape(out_features, n_blocks, 4)
    data[:, :, 4:] = weight.view(torch.uint8).reshape(out_features, n_blocks, block)
    return BlockWeight(data.reshape(out_features, -1), FP8_128 if block == 128 else FP8_32, in_features)


NVFP4_GROUP = 16


def nvfp4_weight(name: str, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                 scale_name: str, global_name: str) -> BlockWeight:
    """An NVFP4 weight as compressed-tensors stores it: ``packed`` uint8 [out, in / 2]
    (weight 2i in the low nibble of byte i, 2i + 1 in the high one; a nibble is an e2m1
    code: sign bit 3, magnitude index into 0, 0.5, 1, 1.5, 2, 3, 4, 6), ``scale`` e4m3
    [out, in / 16] and ``global_scale`` (one float32), as NVFP4_128 / NVFP4_32 blocks."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise QuantConfigError(f"{name}: expected uint8 [out_features, in_features / 2], got {packed.dtype} "
                               f"of shape {tuple(packed.shape)}")
    out_features, in_features = packed.shape[0], 2 * packed.shape[1]
    expected = (out_features, in_features // NVFP4_GROUP)
    if in_features % NVFP4_GROUP or tuple(scale.shape) != expected:
        raise QuantConfigError(f"{scale_name}: shape {tuple(scale.shape)} does not fit {name} "
                               f"{tuple(packed.shape)} (expected {expected}: one scale per {NVFP4_GROUP} weights)")
    if scale.dtype != torch.float8_e4m3fn:
        exact = scale.float().to(torch.float8_e4m3fn)
        if not torch.equal(exact.float(), scale.float()):
            raise QuantConfigError(f"{scale_name}: NVFP4 scales must be e4m3 values, got {scale.dtype} ones "
                                   "that e4m3 does not hold")
        scale = exact
    if global_scale.numel() != 1:
        raise QuantConfigError(f"{global_name}: expected one value, got shape {tuple(global_scale.shape)}")
    if in_features % 32:
        raise QuantConfigError(f"{name}: pagoda reads NVFP4 rows in blocks of 32 or 128 weights; "
                               f"in_features {in_features} is not a multiple of 32")
    block = 128 if in_features % 128 == 0 else 32
    n_blocks, groups = in_features // block, block // NVFP4_GROUP
    # Written in place, a few rows at a time: no weight-sized temporaries.
    data = torch.empty(out_features, n_blocks, 4 + groups + block // 2, dtype=torch.uint8)
    data[:, :, :4] = global_scale.reshape(1).float().view(torch.uint8)
    data[:, :, 4 : 4 + groups] = scale.contiguous().view(torch.uint8).reshape(out_features, n_blocks, groups)
    _ggml_nibbles(packed, data[:, :, 4 + groups :].unflatten(2, (block // 32, 16)))
    return BlockWeight(data.reshape(out_features, -1), NVFP4_128 if block == 128 else NVFP4_32, in_features)


def _ggml_nibbles(packed: torch.Tensor, dest: torch.Tensor) -> None:
    """compressed-tensors' nibbles (byte i: weight 2i low, 2i + 1 high) into ``dest``
    [out, ..., 16] in ggml's order (per 32 weights, byte j: weight j low, j + 16 high),
    a few rows at a time (no weight-sized temporaries)."""
    for r in range(0, packed.shape[0], 64):
        rows = packed[r : r + 64]
        codes = torch.stack([rows & 0x0F, rows >> 4], dim=-1).reshape(*dest[r : r + 64].shape[:-1], 2, 16)
        dest[r : r + 64] = codes[..., 0, :] | (codes[..., 1, :] << 4)


def mxfp4_weight(name: str, packed: torch.Tensor, scale: torch.Tensor, scale_name: str) -> BlockWeight:
    """An MXFP4 weight as compressed-tensors stores it (``packed`` as NVFP4's; ``scale``
    E8M0 bits [out, in / 32]: w = e2m1 * 2^(scale - 127)) as ggml's MXFP4 blocks (the
    same value: 2^(e - 128) times the doubled e2m1 value, exact)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise QuantConfigError(f"{name}: expected uint8 [out_features, in_features / 2], got {packed.dtype} "
                               f"of shape {tuple(packed.shape)}")
    out_features, in_features = packed.shape[0], 2 * packed.shape[1]
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if in_features % 32 or tuple(scale.shape) != (out_features, in_features // 32) or scale.dtype != torch.uint8:
        raise QuantConfigError(f"{scale_name}: {scale.dtype} of shape {tuple(scale.shape)} does not fit {name} "
                               f"{tuple(packed.shape)} (expected E8M0 bits, uint8 {(out_features, in_features // 32)})")
    data = torch.empty(out_features, in_features // 32, 17, dtype=torch.uint8)
    data[:, :, 0] = scale
    _ggml_nibbles(packed, data[:, :, 1:])
    return BlockWeight(data.reshape(out_features, -1), GGMLQuantizationType.MXFP4, in_features)




