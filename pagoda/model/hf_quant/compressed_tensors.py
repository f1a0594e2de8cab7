"""compressed-tensors checkpoints (llm-compressor): the one ``compressed-tensors`` method.
Integer weights here: W4A16 / W8A16 (``pack-quantized``) and W8A8 (``int-quantized``);
float schemes (FP8 ``float-quantized``, ``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``)
through compressed_tensors_float.FloatSchemes, asked first for every tensor. A config may
mix them (``mixed-precision``: a format per config group). The config is read by the
``compressed-tensors`` library's own ``QuantizationConfig``.

Per quantized linear layer ``<prefix>`` (q signed, in [-2^(bits-1), 2^(bits-1))):

    pack-quantized  weight_packed  int32 [out, in * bits / 32]   q + 2^(bits-1) packed along the
                                                                inputs, the first in the lowest bits
                    weight_zero_point (asymmetric)  int32 [out * bits / 32, groups], packed the
                                                    same way along the outputs
                    weight_shape   [out, in]
    int-quantized   weight         int8 [out, in];  weight_zero_point int8 [out, groups] (asymmetric)
    both            weight_scale   float [out, groups]  (group: in / group_size groups; channel: 1)

    W[o, i] = scale[o, g] * (q[o, i] - zero[o, g]),  g = i // group_size (weight_g_idx[i] if stored)

W8A8's activations (per-token int8, dynamic or with a static ``input_scale``) are not
reproduced: the exact mode multiplies the weights with float32 activations, the gguf mode
with int8 activations per 32 inputs.
"""

from __future__ import annotations

from typing import Any

import torch

from pagoda.model.hf_quant.base import QuantConfigError, register
from pagoda.model.hf_quant.compressed_tensors_float import FloatSchemes, is_float_scheme
from pagoda.model.hf_quant.int_groups import (
    IntGroupsMethod,
    act_order,
    companion,
    group_blocks,
    unpack_int32,
)
from pagoda.hub.paths import ModelLoadError

_INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
_COMPANIONS = (".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx",
               ".input_scale", ".input_zero_point", ".output_scale", ".output_zero_point")
_KV_SCALES = (".k_scale", ".v_scale", ".q_scale")


def _parse(qconfig: dict[str, Any]):
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError as e:
        raise QuantConfigError("a compressed-tensors checkpoint needs the compressed-tensors library "
                               "(pip install compressed-tensors)") from e
    try:
        return QuantizationConfig.model_validate(qconfig)
    except Exception as e:   # pydantic's ValidationError: the field and the problem
        raise QuantConfigError(f"config.json: quantization_config is not a compressed-tensors config: {e}") from e


def _is_w8a8(scheme, fmt: str) -> bool:
    """Whether a scheme is W8A8 as vLLM runs it on int8 kernels: symmetric int8 weights, one
    scale per output channel, activations quantized per token at run time."""
    w, a = scheme.weights, scheme.input_activations
    value = lambda v: getattr(v, "value", v)
    return (fmt == "int-quantized" and w.num_bits == 8 and w.symmetric and value(w.strategy) == "channel"
            and a is not None and value(a.type) == "int" and a.num_bits == 8 and a.symmetric
            and bool(a.dynamic) and value(a.strategy) == "token")


@register
class CompressedTensorsMethod(IntGroupsMethod):
    name = "compressed-tensors"

    def __init__(self, qconfig: dict[str, Any]) -> None:
        super().__init__(qconfig)
        config = _parse(qconfig)
        sparsity = qconfig.get("sparsity_config") or {}
        if sparsity.get("format", "dense") != "dense":
            raise QuantConfigError(f"config.json: sparsity_config format {sparsity['format']!r} is not supported")
        self.ignore = list(config.ignore or [])
        self.kv_scales = config.kv_cache_scheme is not None   # pagoda's KV cache stays float: its scales unused
        self.floats = FloatSchemes(qconfig)   # the float groups (checked there)
        self.schemes = []   # integer groups: (targets, weights args, format)
        w8a8 = []
        for group, scheme in config.config_groups.items():
            fmt = scheme.format or config.format or "pack-quantized"
            fmt = getattr(fmt, "value", fmt)
            w = scheme.weights
            if w is None:
                raise QuantConfigError(f"config.json: config_groups.{group} quantizes no weights "
                                       "(activation-only schemes are not supported)")
            if is_float_scheme(scheme, fmt):
                continue
            if getattr(w.type, "value", w.type) != "int" or fmt not in _INT_FORMATS:
                raise QuantConfigError(f"config.json: config_groups.{group}: {getattr(w.type, 'value', w.type)} "
                                       f"weights in format {fmt} are not supported (integers: pack-quantized, "
                                       "int-quantized; floats: float-quantized, nvfp4-pack-quantized, "
                                       "mxfp4-pack-quantized)")
            if w.num_bits not in (4, 8):
                raise QuantConfigError(f"config.json: config_groups.{group}.weights.num_bits {w.num_bits} is not "
                                       "supported (4 or 8)")
            strategy = getattr(w.strategy, "value", w.strategy)
            if strategy not in ("group", "channel", "tensor"):
                raise QuantConfigError(f"config.json: config_groups.{group}.weights.strategy {strategy!r} is not "
                                       "supported for integer weights (group, channel, tensor)")
            self.schemes.append((list(scheme.targets), w, fmt))
            w8a8.append(_is_w8a8(scheme, fmt))
        # Every integer group is W8A8 (int8 weights per channel, int8 activations per token):
        # ``--quantization int8`` then runs the checkpoint's own arithmetic on its own weights.
        self.w8a8 = bool(self.schemes) and all(w8a8) and not self.floats.groups

    def check_quantization(self, mode: str) -> None:
        if mode == "int8" and self.w8a8:
            return
        if self.floats.groups:
            self.floats.check_quantization(mode)
        if self.schemes:
            super().check_quantization(mode)

    def _scheme(self, prefix: str, tensor_name: str):
        from compressed_tensors.utils.match import match_name

        def hit(targets: list[str]) -> bool:
            # "Linear" (a class) names every linear layer: those are the ones holding these tensors.
            return any(t == "Linear" or match_name(prefix, t) for t in targets)

        if not hit(self.ignore):
            for targets, weights, fmt in self.schemes:
                if hit(targets):
                    return weights, fmt
        raise QuantConfigError(f"{tensor_name}: no config_groups scheme of quantization_config targets "
                               f"{prefix} (or it is ignored), yet it is stored quantized")

    def tensors(self, name, tensor, checkpoint):
        floats = self.floats.tensors(name, tensor, checkpoint)   # a float group's layer
        if floats is not None:
            return floats
        if name.endswith(_COMPANIONS) or (self.kv_scales and name.endswith(_KV_SCALES)):
            return iter(())
        if name.endswith(".weight_packed"):
            prefix = name[: -len(".weight_packed")]
        elif name.endswith(".weight") and tensor.dtype == torch.int8:
            prefix = name[: -len(".weight")]
        else:
            return None
        return iter([(prefix + ".weight", self._weight(prefix, name, tensor, checkpoint))])

    def _weight(self, prefix, name, stored, checkpoint):
        weights, fmt = self._scheme(prefix, name)
        bits = weights.num_bits
        offset = 1 << (bits - 1)   # signed q -> unsigned
        scale = companion(checkpoint, prefix + ".weight_scale", name)
        if name.endswith(".weight_packed"):
            if fmt != "pack-quantized" or stored.dtype != torch.int32 or stored.dim() != 2:
                raise QuantConfigError(f"{name}: expected int32 [out, in * {bits} / 32] of a pack-quantized scheme, "
                                       f"got {stored.dtype} {tuple(stored.shape)} ({fmt})")
            shape = companion(checkpoint, prefix + ".weight_shape", name).tolist()
            if len(shape) != 2 or stored.shape != (shape[0], -(-shape[1] * bits // 32)):
                raise QuantConfigError(f"{name}: shape {tuple(stored.shape)} does not hold weight_shape {shape} "
                                       f"at {bits} bits")
            out_features, in_features = shape
            if in_features % 32:
                raise QuantConfigError(f"{name}: {in_features} input channels are not a multiple of 32")

            def values(o0: int, o1: int) -> torch.Tensor:
                return unpack_int32(stored[o0:o1], bits, 1)
        else:
            out_features, in_features = stored.shape

            def values(o0: int, o1: int) -> torch.Tensor:
                return stored[o0:o1].to(torch.int32) + offset

        strategy = getattr(weights.strategy, "value", weights.strategy)
        if scale.dim() < 2:   # tensor strategy: one scale
            scale = scale.reshape(-1, 1)
        if strategy == "tensor":
            scale = scale.reshape(1, 1).expand(out_features, 1)
        if scale.dim() != 2 or scale.shape[0] != out_features or not scale.dtype.is_floating_point:
            raise QuantConfigError(f"{prefix}.weight_scale: expected float [{out_features}, groups], got "
                                   f"{scale.dtype} {tuple(scale.shape)}")
        groups = scale.shape[1]
        group_size = weights.group_size if strategy == "group" else in_features
        if groups != -(-in_features // group_size):
            raise QuantConfigError(f"{prefix}.weight_scale: {groups} groups for {in_features} input channels in "
                                   f"groups of {group_size}")
        zeros = torch.full((out_features, groups), offset, dtype=torch.int32)
        if not weights.symmetric:
            zp = companion(checkpoint, prefix + ".weight_zero_point", name)
            if zp.dtype == torch.int32 and fmt == "pack-quantized":   # packed along the outputs
                if zp.shape != (-(-out_features * bits // 32), groups):
                    raise QuantConfigError(f"{prefix}.weight_zero_point: expected int32 "
                                           f"[{-(-out_features * bits // 32)}, {groups}], got {tuple(zp.shape)}")
                zp = (unpack_int32(zp, bits, 0)[:out_features] - offset).to(torch.int32)
            zp = zp.reshape(out_features, -1) if zp.numel() == out_features * groups else zp
            if zp.shape != (out_features, groups) or zp.dtype.is_floating_point:
                raise QuantConfigError(f"{prefix}.weight_zero_point: expected integers [{out_features}, {groups}], "
                                       f"got {zp.dtype} {tuple(zp.shape)}")
            zeros = zp.to(torch.int32) + offset
        try:
            g_idx = checkpoint(prefix + ".weight_g_idx")
        except ModelLoadError:
            g_idx = torch.arange(in_features) // group_size
        order, block_groups = act_order(g_idx, in_features, groups, prefix + ".weight_g_idx")
        return group_blocks(name, values, out_features, in_features, bits, scale, zeros, block_groups, order)
