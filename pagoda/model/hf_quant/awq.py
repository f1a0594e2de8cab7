"""AWQ checkpoints (AutoAWQ, llm-awq, transformers), GEMM packing, 4 bits.

Per quantized linear layer ``<prefix>``:

    qweight  int32 [in, out / 8]         8 output channels' 4-bit q per word, interleaved:
                                         nibble k (from the lowest) is column 8j + AWQ_ORDER[k]
    qzeros   int32 [groups, out / 8]     the groups' zero-points, packed the same way
    scales   float16 [groups, out]

    W[o, i] = scales[g, o] * (q[i, o] - zero[g, o]),  g = i // group_size

(the zeros stored as they are). The GEMV layout (``version`` "gemv": packed along the
inputs, another order) and the others are refused.
"""

from __future__ import annotations

from typing import Any

import torch

from pagoda.model.hf_quant.base import QuantConfigError, register
from pagoda.model.hf_quant.int_groups import (
    PackedWordsMethod,
    companion,
    group_blocks,
    unpack_int32,
)

# Nibble k of a word holds column AWQ_ORDER[k] of its 8; column m is nibble _COLUMN_NIBBLE[m].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_COLUMN_NIBBLE = torch.tensor([AWQ_ORDER.index(m) for m in range(8)])


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] in AWQ's order -> the 4-bit values [rows, cols] (int32) in column order."""
    v = unpack_int32(packed, 4, 1).view(packed.shape[0], packed.shape[1], 8)
    return v[:, :, _COLUMN_NIBBLE].reshape(packed.shape[0], packed.shape[1] * 8)


@register
class AWQMethod(PackedWordsMethod):
    name = "awq"
    companions = (".qzeros", ".scales")

    def __init__(self, qconfig: dict[str, Any]) -> None:
        super().__init__(qconfig)
        bits = qconfig.get("bits", qconfig.get("w_bit"))
        if bits != 4:
            raise QuantConfigError(f"config.json: quantization_config.bits {bits!r} is not supported for awq (4)")
        version = str(qconfig.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantConfigError(f"config.json: quantization_config.version {version!r} is not supported for awq "
                                   "(gemm: the layout AutoAWQ writes by default)")
        if not qconfig.get("zero_point", True):
            raise QuantConfigError("config.json: quantization_config.zero_point false is not supported for awq")
        self.group_size = qconfig.get("group_size", qconfig.get("q_group_size", 128))
        if not isinstance(self.group_size, int) or (self.group_size != -1 and self.group_size <= 0):
            raise QuantConfigError(f"config.json: quantization_config.group_size {self.group_size!r} is not a "
                                   "group size")

    def _weight(self, prefix, qweight, checkpoint):
        name = prefix + ".qweight"
        scales = companion(checkpoint, prefix + ".scales", name)
        qzeros = companion(checkpoint, prefix + ".qzeros", name)
        if qweight.dtype != torch.int32 or qweight.dim() != 2:
            raise QuantConfigError(f"{name}: expected int32 [in_features, out_features / 8], got {qweight.dtype} "
                                   f"{tuple(qweight.shape)}")
        in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
        group_size = in_features if self.group_size == -1 else self.group_size
        if in_features % group_size:
            raise QuantConfigError(f"{name}: group_size {group_size} does not divide {in_features} input channels")
        groups = in_features // group_size
        if scales.shape != (groups, out_features) or not scales.dtype.is_floating_point:
            raise QuantConfigError(f"{prefix}.scales: expected float [{groups}, {out_features}], got {scales.dtype} "
                                   f"{tuple(scales.shape)}")
        if qzeros.dtype != torch.int32 or qzeros.shape != (groups, out_features // 8):
            raise QuantConfigError(f"{prefix}.qzeros: expected int32 [{groups}, {out_features // 8}], got "
                                   f"{qzeros.dtype} {tuple(qzeros.shape)}")
        if group_size % 32:
            raise QuantConfigError(f"{name}: group_size {group_size} is not a multiple of 32 (pagoda's blocks)")
        zeros = unpack_awq(qzeros)   # [groups, out]

        def values(o0: int, o1: int) -> torch.Tensor:   # q [o1 - o0, in]
            w0, w1 = o0 // 8, -(-o1 // 8)
            return unpack_awq(qweight[:, w0:w1])[:, o0 - 8 * w0:o1 - 8 * w0].t()

        block_groups = torch.arange(in_features // 32) * 32 // group_size
        return group_blocks(name, values, out_features, in_features, 4, scales.t(), zeros.t(), block_groups)
