"""Integer weights in groups with a scale and a zero-point (GPTQ, AWQ, compressed-tensors'
``pack-quantized`` / ``int-quantized``) as pagoda's own blocks.

Every one of these formats dequantizes a weight as ``w = scale[g] * (q - zero[g])`` (q and
the zero unsigned integers, the scale float16, bfloat16 or float32), which is the float32
value ``float32(scale) * (q - zero)``: the difference is an exact integer, so one rounding.
No ggml type holds that exactly (Q4_1 stores ``-scale * zero`` rounded to float16, and
rounds twice), hence pagoda's block layouts, 32 weights each, the group's scale and zero
repeated in each of its blocks:

    PAGODA_Q4Z   d (float16), z (uint8), 16 bytes of nibbles   w = d * (nibble - z)
    PAGODA_Q8Z   d (float16), z (int16), 32 bytes (uint8)      w = d * (q - z)
    PAGODA_Q4ZF, PAGODA_Q8ZF: the same with d a float32, for scales a float16 cannot hold

Nibbles as in ggml's 32-blocks: byte j holds weight j (low) and weight j + 16 (high). The
kernels (pagoda/csrc/gguf_blocks.cpp) dequantize these to the very float32 values above and
multiply them in float32 (``gguf_linear``), or against int8 activations (the gguf mode:
integer dot products per block of 32, as for Q4_0 / Q8_0).

A group is a run of ``group_size`` input channels (a multiple of 32); GPTQ's act-order
groups (``g_idx``) are made runs by sorting the input channels by group, and the weight
keeps that order (``BlockWeight.input_order``: the layer permutes x to match).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from pagoda.hub.paths import ModelLoadError
from pagoda.model.hf_quant.base import Checkpoint, QuantConfigError, QuantMethod
from pagoda.model.layers.blocks import BlockWeight, own_type

PQ4Z = own_type(200, "PAGODA_Q4Z", 32, 19)
PQ8Z = own_type(201, "PAGODA_Q8Z", 32, 36)
PQ4ZF = own_type(202, "PAGODA_Q4ZF", 32, 21)
PQ8ZF = own_type(203, "PAGODA_Q8ZF", 32, 38)
_TYPES = {(4, 2): PQ4Z, (8, 2): PQ8Z, (4, 4): PQ4ZF, (8, 4): PQ8ZF}   # (bits, scale bytes) -> type

# Output channels converted at a time: the unpacked int32 values of a chunk stay small.
_CHUNK = 256


def companion(checkpoint: Checkpoint, name: str, of: str) -> torch.Tensor:
    """The checkpoint tensor ``name`` that quantized tensor ``of`` needs (its scales, zeros,
    group index), or an error naming both."""
    try:
        return checkpoint(name)
    except ModelLoadError:
        raise QuantConfigError(f"{of}: its companion tensor {name} is missing from the checkpoint") from None


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``bits``-bit values packed into int32 along ``dim`` (0 or 1), value k of a
    word in its bits [bits k, bits (k + 1)) (GPTQ's, compressed-tensors' order): int32 with
    that dimension 32 / bits times longer. E.g. 4 bits, dim 0: word [i, j] holds rows
    8i .. 8i + 7 of column j, row 8i in the lowest nibble."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:
        return ((p.unsqueeze(1) >> shifts[None, :, None]) & mask).reshape(p.shape[0] * per, p.shape[1])
    return ((p.unsqueeze(2) >> shifts) & mask).reshape(p.shape[0], p.shape[1] * per)


def act_order(g_idx: torch.Tensor, in_features: int, groups: int, name: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    """From a group index per input channel (GPTQ's ``g_idx``): (the input order that makes
    each group a run, or None when they already are; the group of each block of 32 in that
    order)."""
    if g_idx.dim() != 1 or g_idx.numel() != in_features or g_idx.dtype.is_floating_point:
        raise QuantConfigError(f"{name}: expected {in_features} integer group indices, got {g_idx.dtype} "
                               f"{tuple(g_idx.shape)}")
    if in_features % 32:
        raise QuantConfigError(f"{name}: {in_features} input channels are not a multiple of 32 "
                               "(pagoda's blocks hold 32)")
    g = g_idx.to(torch.int64)
    if g.numel() and (g.min() < 0 or g.max() >= groups):
        raise QuantConfigError(f"{name}: group indices must lie in [0, {groups}) (the groups of the scales)")
    order = torch.argsort(g, stable=True)
    if torch.equal(order, torch.arange(in_features)):
        order = None
    blocks = (g if order is None else g[order]).view(-1, 32)
    if not torch.equal(blocks, blocks[:, :1].expand_as(blocks)):
        raise QuantConfigError(f"{name}: a group holds a number of input channels that is not a multiple of 32; "
                               "pagoda's blocks hold 32 channels of one group")
    return order, blocks[:, 0].contiguous()


def group_blocks(name: str, values: Callable[[int, int], torch.Tensor], out_features: int, in_features: int,
                 bits: int, scales: torch.Tensor, zeros: torch.Tensor, block_groups: torch.Tensor,
                 input_order: torch.Tensor | None = None) -> BlockWeight:
    """The blocks of one layer. ``values(o0, o1)``: the unsigned q of output channels
    [o0, o1) ([o1 - o0, in_features], any integer dtype, inputs in the checkpoint's order);
    ``scales`` / ``zeros``: [out_features, groups] (zeros unsigned, the q a zero weight
    has); ``block_groups``: the group of each block of 32 inputs (in ``input_order``)."""
    if bits not in (4, 8):
        raise QuantConfigError(f"{name}: {bits}-bit weights are not supported (4 or 8)")
    if in_features % 32:
        raise QuantConfigError(f"{name}: {in_features} input channels are not a multiple of 32 "
                               "(pagoda's blocks hold 32)")
    if scales.shape != zeros.shape or scales.shape[0] != out_features or scales.dim() != 2:
        raise QuantConfigError(f"{name}: scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} do not "
                               f"match {out_features} output channels")
    scale_f32 = scales.float()
    if not torch.isfinite(scale_f32).all():
        raise QuantConfigError(f"{name}: its scales are not all finite")
    # float16 where it holds the scales exactly (GPTQ's, AWQ's are float16), else float32.
    half = scale_f32.half()
    scale_bytes = 2 if torch.equal(half.float(), scale_f32) else 4
    kind = _TYPES[(bits, scale_bytes)]
    z = zeros.to(torch.int32)
    lo, hi = (0, 127) if bits == 4 else (-32768, 32767)   # q - z in int8 for 4 bits; an int16 zero for 8
    if z.numel() and (z.min() < lo or z.max() > hi):
        raise QuantConfigError(f"{name}: zero-points outside [{lo}, {hi}]")
    nblocks = in_features // 32
    block_scales = (half if scale_bytes == 2 else scale_f32)[:, block_groups]   # [out, nblocks]
    block_zeros = z[:, block_groups]
    data = torch.empty(out_features, nblocks, kind.nbytes, dtype=torch.uint8)
    data[:, :, :scale_bytes] = block_scales.contiguous().view(torch.uint8).view(out_features, nblocks, scale_bytes)
    if bits == 4:
        data[:, :, scale_bytes] = block_zeros.to(torch.uint8)
    else:
        data[:, :, scale_bytes:scale_bytes + 2] = block_zeros.to(torch.int16).contiguous().view(torch.uint8).view(
            out_features, nblocks, 2)
    first = scale_bytes + (1 if bits == 4 else 2)
    limit = (1 << bits) - 1
    for o0 in range(0, out_features, _CHUNK):
        o1 = min(out_features, o0 + _CHUNK)
        q = values(o0, o1)
        if q.shape != (o1 - o0, in_features):
            raise QuantConfigError(f"{name}: expected {in_features} values per output channel, got {tuple(q.shape)}")
        if input_order is not None:
            q = q[:, input_order]
        q = q.to(torch.int32)
        if q.numel() and (q.min() < 0 or q.max() > limit):
            raise QuantConfigError(f"{name}: values outside [0, {limit}] for {bits} bits")
        q = q.to(torch.uint8).contiguous().view(o1 - o0, nblocks, 32)
        if bits == 4:
            data[o0:o1, :, first:] = q[:, :, :16] | (q[:, :, 16:] << 4)
        else:
            data[o0:o1, :, first:] = q
    return BlockWeight(data.view(out_features, -1), kind, in_features, input_order=input_order)



class IntGroupsMethod(QuantMethod):
    """What the integer-group formats share: ``--quantization`` may be left out (exact
    float32 products of the blocks) or be ``gguf`` (int8 activations against the blocks,
    the llama.cpp arithmetic); the other modes would quantize the dequantized weights a
    second time, and are refused."""

    def check_quantization(self, mode: str) -> None:
        if mode in ("none", "gguf"):
            return
        raise QuantConfigError(f"the checkpoint is quantized with {self.name!r}; --quantization {mode} would "
                               "quantize its dequantized weights again. Leave it out (the checkpoint's own "
                               "weights, float32 products) or use gguf (its weights against int8 activations)")


class PackedWordsMethod(IntGroupsMethod):
    """GPTQ and AWQ: a layer is ``prefix.qweight`` (int32 words of packed codes) with
    companions (``companions``: scales, zero points, ...) read through the checkpoint."""

    companions: ClassVar[tuple[str, ...]]

    def tensors(self, name, tensor, checkpoint):
        if name.endswith(self.companions):
            return iter(())
        if not name.endswith(".qweight"):
            return None
        prefix = name[: -len(".qweight")]
        return iter([(prefix + ".weight", self._weight(prefix, tensor, checkpoint))])

    def _weight(self, prefix: str, qweight: torch.Tensor, checkpoint) -> BlockWeight:
        raise NotImplementedError
