"""compressed-tensors' float formats: FP8 (``float-quantized``: W8A8-FP8 / W8A16-FP8 with
per-tensor, per-channel, per-group or block scales), NVFP4 (``nvfp4-pack-quantized``) and
MXFP4 (``mxfp4-pack-quantized``: ggml's MXFP4 blocks, the same values).

Interface (for the one ``compressed-tensors`` method, pagoda/model/hf_quant/compressed_tensors.py,
which reads the integer formats itself):

    FLOAT_FORMATS                   the formats handled here
    is_float_scheme(scheme, fmt)    whether a config group (a ``QuantizationScheme`` of
                                    the library, with its format) is one of them
    FloatSchemes(qconfig)           built from config.json's ``quantization_config``
                                    (raises QuantConfigError for a float scheme pagoda
                                    cannot serve; integer schemes are left alone)
      .tensors(name, tensor, checkpoint)   QuantMethod.tensors' contract, for the layers
                                    whose scheme is a float one; None for everything else
                                    (integer layers, float tensors), so a dispatcher can
                                    ask this first and its integer reader next
      .check_quantization(mode)     "none"; "gguf" when every float scheme is NVFP4 / MXFP4
      .has_integer_schemes          whether some config group is not a float format

Which scheme a layer has is the library's matching: a config group's ``targets`` and the
config's ``ignore`` are layer names, ``re:`` regexes or module classes (``Linear``: every
quantized layer). Formats come from the group (``mixed-precision`` configs) or the
config. The numbers (float_blocks.py): FP8 weights are ``weight.float() * weight_scale``,
NVFP4 ones ``e2m1 * (weight_scale.float() / weight_global_scale)`` and MXFP4 ones
``e2m1 * 2^(weight_scale - 127)`` in float32, the library's decompressors before their
cast to the model's dtype. Activations are float32:
``input_activations`` (dynamic or static; static ``input_scale`` /
``input_global_scale`` tensors are read with the layer and not used) and a
``kv_cache_scheme``'s ``k_scale`` / ``v_scale`` only matter to FP8 / FP4 activations,
which pagoda does not compute.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pagoda.model.hf_quant.base import Checkpoint, QuantConfigError
from pagoda.model.hf_quant.float_blocks import (
    FP8_DTYPES,
    OTHER_FP8_DTYPES,
    ScaleBlocks,
    fp8_weight,
    mxfp4_weight,
    nvfp4_weight,
    release_checkpoint_pages,
)
from pagoda.model.layers.blocks import BlockWeight

FP8_FORMATS = frozenset({"float-quantized", "naive-quantized"})
NVFP4_FORMAT = "nvfp4-pack-quantized"
MXFP4_FORMAT = "mxfp4-pack-quantized"
FP4_FORMATS = frozenset({NVFP4_FORMAT, MXFP4_FORMAT})
FLOAT_FORMATS = FP8_FORMATS | FP4_FORMATS

# A layer's tensors by suffix: the main one, and companions read with it or unused.
MAIN = (".weight_packed", ".weight")
COMPANIONS = (".weight_scale", ".weight_global_scale", ".input_scale", ".input_global_scale",
              ".output_scale", ".weight_zero_point", ".input_zero_point")
KV_SCALES = (".k_scale", ".v_scale")


def _library():
    try:
        from compressed_tensors import quantization
        from compressed_tensors.utils.match import match_name
    except ImportError as e:
        raise QuantConfigError("reading a compressed-tensors checkpoint needs the compressed-tensors library "
                               f"(pip install compressed-tensors): {e}") from e
    return quantization, match_name


def is_float_scheme(scheme: Any, fmt: str | None) -> bool:
    """Whether a config group's scheme, stored in format ``fmt``, is a float format."""
    weights = scheme.weights
    return weights is not None and weights.type == "float" and fmt in FLOAT_FORMATS


def _check_scheme(group: str, scheme: Any, fmt: str) -> None:
    """Refuse, naming the group, a float scheme pagoda does not read."""
    w = scheme.weights
    where = f"config.json: quantization_config.config_groups.{group}"
    if not w.symmetric:
        raise QuantConfigError(f"{where}: asymmetric float weights (zero points) are not supported")
    if fmt in FP4_FORMATS:
        size = 16 if fmt == NVFP4_FORMAT else 32
        if w.num_bits != 4 or w.group_size != size or w.strategy not in ("tensor_group", "group"):
            raise QuantConfigError(f"{where}: {fmt} needs 4-bit weights in groups of {size}, got "
                                   f"{w.num_bits} bits, strategy {w.strategy}, group_size {w.group_size}")
        return
    if w.num_bits != 8:
        raise QuantConfigError(f"{where}: {w.num_bits}-bit float weights in {fmt} are not supported (FP8 only)")
    if w.strategy not in ("tensor", "channel", "group", "block"):
        raise QuantConfigError(f"{where}: FP8 strategy {w.strategy!r} is not supported "
                               "(tensor, channel, group or block)")


class FloatSchemes:
    """The float-format config groups of a compressed-tensors ``quantization_config``, and
    the layers they quantize as ``BlockWeight``s (see the module's docstring)."""

    def __init__(self, qconfig: dict[str, Any]) -> None:
        quantization, self._match_name = _library()
        try:
            self.config = quantization.QuantizationConfig.model_validate(qconfig)
        except (ValueError, KeyError, TypeError) as e:
            raise QuantConfigError(f"config.json: quantization_config is not a valid compressed-tensors config: {e}") from e
        sparsity = qconfig.get("sparsity_config") or {}
        if sparsity.get("format") not in (None, "dense"):
            raise QuantConfigError(f"config.json: sparsity_config.format {sparsity.get('format')!r} "
                                   "(sparse compressed-tensors checkpoints) is not supported")
        self.groups: dict[str, tuple[Any, str]] = {}   # float groups: name -> (scheme, format)
        self.has_integer_schemes = False
        self._schemes: dict[str, tuple[Any, str] | None] = {}
        for group, scheme in self.config.config_groups.items():
            fmt = scheme.format or self.config.format
            if is_float_scheme(scheme, fmt):
                _check_scheme(group, scheme, fmt)
                self.groups[group] = (scheme, fmt)
            elif scheme.weights is not None:
                self.has_integer_schemes = True

    def scheme_for(self, layer: str) -> tuple[Any, str] | None:
        """The float (scheme, format) that quantizes layer ``layer``, or None (not
        targeted, ignored, or an integer scheme's)."""
        if layer not in self._schemes:
            self._schemes[layer] = None
            if not any(self._match_name(layer, t) for t in self.config.ignore or []):
                for group, scheme in self.config.config_groups.items():
                    # "Linear" (a module class) targets every layer that has quantized tensors.
                    if any(t == "Linear" or self._match_name(layer, t) for t in scheme.targets):
                        self._schemes[layer] = self.groups.get(group)   # the first group that targets it
                        break
        return self._schemes[layer]

    def tensors(self, name: str, tensor: torch.Tensor,
                checkpoint: Checkpoint) -> Iterator[tuple[str, torch.Tensor | BlockWeight]] | None:
        if name.endswith(KV_SCALES) and self.config.kv_cache_scheme is not None:
            return iter(())
        suffix = next((s for s in MAIN + COMPANIONS if name.endswith(s)), None)
        if suffix is None:
            return None
        layer = name[: -len(suffix)]
        found = self.scheme_for(layer)
        if found is None:
            return None
        scheme, fmt = found
        if suffix in COMPANIONS:
            return iter(())
        if suffix == ".weight" and tensor.dtype not in FP8_DTYPES + OTHER_FP8_DTYPES:
            return None   # a layer the checkpoint keeps in float
        if fmt in FP4_FORMATS:
            if suffix != ".weight_packed":
                raise QuantConfigError(f"{name}: {fmt} stores {layer}.weight_packed, not {tensor.dtype} weights")
            scale = _companion(checkpoint, layer + ".weight_scale", name)
            if fmt == MXFP4_FORMAT:
                weight = mxfp4_weight(name, tensor, scale, layer + ".weight_scale")
            else:
                weight = nvfp4_weight(name, tensor, scale,
                                      _companion(checkpoint, layer + ".weight_global_scale", name),
                                      layer + ".weight_scale", layer + ".weight_global_scale")
            release_checkpoint_pages(tensor, scale)
            return iter([(layer + ".weight", weight)])
        if suffix != ".weight":
            raise QuantConfigError(f"{name}: {fmt} stores FP8 {layer}.weight, not packed weights")
        scale_name = layer + ".weight_scale"
        weight = fp8_weight(name, tensor, _companion(checkpoint, scale_name, name), scale_name,
                            _fp8_blocks(scheme.weights, tensor))
        release_checkpoint_pages(tensor)
        return iter([(name, weight)])

    def check_quantization(self, mode: str) -> None:
        if mode == "none":
            return
        if mode == "gguf" and self.groups and all(fmt in FP4_FORMATS for _, fmt in self.groups.values()):
            return   # NVFP4's and MXFP4's blocks multiply int8 activations (llama.cpp's arithmetic)
        raise QuantConfigError(f"the checkpoint is quantized with compressed-tensors "
                               f"({', '.join(sorted({f for _, f in self.groups.values()}))}); --quantization "
                               f"{mode} does not apply to it (leave it out"
                               + ("; gguf applies to NVFP4 and MXFP4 alone)" if mode == "gguf" else ")"))


def _fp8_blocks(weights: Any, tensor: torch.Tensor) -> ScaleBlocks:
    out_features, in_features = tensor.shape if tensor.dim() == 2 else (1, 1)
    if weights.strategy == "tensor":
        return ScaleBlocks(out_features, in_features)
    if weights.strategy == "channel":
        return ScaleBlocks(1, in_features)
    if weights.strategy == "group":
        return ScaleBlocks(1, weights.group_size)
    return ScaleBlocks(*weights.block_structure)


def _companion(checkpoint: Checkpoint, name: str, owner: str) -> torch.Tensor:
    from pagoda.hub.paths import ModelLoadError

    try:
        return checkpoint(name)
    except ModelLoadError as e:
        raise QuantConfigError(f"{owner} is quantized but the checkpoint has no {name}") from e
