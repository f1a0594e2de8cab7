"""GPTQ checkpoints (AutoGPTQ, GPTQModel, transformers / optimum), 4 or 8 bits.

Per quantized linear layer ``<prefix>``, with pack = 32 / bits:

    qweight  int32 [in / pack, out]      q of inputs pack*i .. pack*i + pack - 1 in word i,
                                         the first in the lowest bits
    qzeros   int32 [groups, out / pack]  the groups' zero-points, packed the same way along out
    scales   float16 [groups, out]
    g_idx    int32 [in] (optional)       each input channel's group; i // group_size
                                         unless the layer was quantized in act order (desc_act)

    W[o, i] = scales[g, o] * (q[i, o] - zero[g, o]),  g = g_idx[i]

"GPTQ v1" (``checkpoint_format`` "gptq", what AutoGPTQ and transformers write) stores
zero - 1 (a 4-bit zero of 0 wraps to 15 and reads back as 16); "gptq_v2" (GPTQModel)
stores the zero itself. ``group_size`` -1 is one group per output channel. ``sym`` only
says how the zeros were chosen (2^(bits-1) for symmetric): they are stored either way.
"""

from __future__ import annotations

from typing import Any

import torch

from pagoda.model.hf_quant.base import QuantConfigError, register
from pagoda.model.hf_quant.int_groups import (
    PackedWordsMethod,
    act_order,
    companion,
    group_blocks,
    unpack_int32,
)
from pagoda.hub.paths import ModelLoadError



@register
class GPTQMethod(PackedWordsMethod):
    name = "gptq"
    companions = (".qzeros", ".scales", ".g_idx")

    def __init__(self, qconfig: dict[str, Any]) -> None:
        super().__init__(qconfig)
        self.bits = qconfig.get("bits")
        if self.bits not in (4, 8):
            raise QuantConfigError(f"config.json: quantization_config.bits {self.bits!r} is not supported for "
                                   "gptq (4 or 8)")
        self.group_size = qconfig.get("group_size", -1)
        if not isinstance(self.group_size, int) or (self.group_size != -1 and self.group_size <= 0):
            raise QuantConfigError(f"config.json: quantization_config.group_size {self.group_size!r} is not a "
                                   "group size (a positive number, or -1)")
        fmt = qconfig.get("checkpoint_format") or qconfig.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2") or qconfig.get("is_marlin_format"):
            raise QuantConfigError(f"config.json: quantization_config.checkpoint_format {fmt!r} is not supported "
                                   "(gptq or gptq_v2)")
        # GPTQ v1 stores each zero-point minus one.
        self.zero_offset = 1 if fmt == "gptq" else 0
        if qconfig.get("pack_dtype", "int32") != "int32":
            raise QuantConfigError(f"config.json: quantization_config.pack_dtype {qconfig['pack_dtype']!r} is not "
                                   "supported (int32)")
        if qconfig.get("dynamic"):
            raise QuantConfigError("config.json: quantization_config.dynamic (per-module bits) is not supported")

    def _weight(self, prefix, qweight, checkpoint):
        name = prefix + ".qweight"
        bits, pack = self.bits, 32 // self.bits
        scales = companion(checkpoint, prefix + ".scales", name)
        qzeros = companion(checkpoint, prefix + ".qzeros", name)
        if qweight.dtype != torch.int32 or qweight.dim() != 2:
            raise QuantConfigError(f"{name}: expected int32 [in_features / {pack}, out_features], got "
                                   f"{qweight.dtype} {tuple(qweight.shape)}")
        in_features, out_features = qweight.shape[0] * pack, qweight.shape[1]
        if scales.dim() != 2 or scales.shape[1] != out_features or not scales.dtype.is_floating_point:
            raise QuantConfigError(f"{prefix}.scales: expected float [groups, {out_features}], got {scales.dtype} "
                                   f"{tuple(scales.shape)}")
        groups = scales.shape[0]
        group_size = in_features if self.group_size == -1 else self.group_size
        if groups != -(-in_features // group_size):
            raise QuantConfigError(f"{prefix}.scales: {groups} groups for {in_features} input channels in groups "
                                   f"of {group_size}")
        if qzeros.dtype != torch.int32 or qzeros.shape != (groups, out_features // pack) or out_features % pack:
            raise QuantConfigError(f"{prefix}.qzeros: expected int32 [{groups}, {out_features // pack}], got "
                                   f"{qzeros.dtype} {tuple(qzeros.shape)}")
        try:
            g_idx = checkpoint(prefix + ".g_idx")
        except ModelLoadError:   # no g_idx: groups in input order
            g_idx = torch.arange(in_features) // group_size
        order, block_groups = act_order(g_idx, in_features, groups, prefix + ".g_idx")
        zeros = unpack_int32(qzeros, bits, 1) + self.zero_offset   # [groups, out]

        def values(o0: int, o1: int) -> torch.Tensor:   # q [o1 - o0, in]
            return unpack_int32(qweight[:, o0:o1], bits, 0).t()

        return group_blocks(name, values, out_features, in_features, bits, scales.t(), zeros.t(), block_groups,
                            order)
