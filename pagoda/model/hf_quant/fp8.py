"""``quant_method: "fp8"``: FP8 (e4m3) checkpoints as transformers' FineGrainedFP8,
DeepSeek-V3 and the Qwen3-FP8 releases write them, and the per-tensor / per-channel FP8
checkpoints of other tools (AutoFP8, vLLM).

A quantized layer is ``<prefix>.weight`` (float8_e4m3fn) with ``<prefix>.weight_scale_inv``
(DeepSeek-V3's name; despite it, the dequantized weight is ``weight * scale_inv``) or
``<prefix>.weight_scale`` (the same product). The scale's shape says its granularity:
``[ceil(out / b0), ceil(in / b1)]`` for ``weight_block_size: [b0, b1]``, one value per
tensor, or one per output channel (``[out]`` / ``[out, 1]``).

Activations: pagoda computes them in float32 whatever ``activation_scheme`` says;
``dynamic`` and ``static`` only decide how an FP8 kernel would quantize activations,
which pagoda does not do. A static checkpoint's ``input_scale`` / ``activation_scale``
tensors (and FP8 KV-cache scales ``k_scale`` / ``v_scale``) are read as the layer's
companions and not used: the products are exactly the float32 products with the
dequantized weights.

Modules the checkpoint leaves unquantized (``modules_to_not_convert``, AutoFP8's
``ignored_layers``: the LM head, MoE routers) are stored in float and stay float: each
weight's dtype says whether it is FP8.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pagoda.model.hf_quant.base import (
    Checkpoint,
    QuantConfigError,
    QuantMethod,
    register,
)
from pagoda.model.hf_quant.float_blocks import (
    FP8_DTYPES,
    OTHER_FP8_DTYPES,
    ScaleBlocks,
    fp8_weight,
    release_checkpoint_pages,
)
from pagoda.hub.paths import ModelLoadError
from pagoda.model.layers.blocks import BlockWeight

SCALE_NAMES = (".weight_scale_inv", ".weight_scale")
# Activation / KV-cache scales: read with their layer and not needed by float32 products.
UNUSED_COMPANIONS = (".input_scale", ".activation_scale", ".k_scale", ".v_scale", ".output_scale")


def companion(checkpoint: Checkpoint, name: str) -> torch.Tensor | None:
    """The checkpoint's tensor ``name``, or None when it has none."""
    try:
        return checkpoint(name)
    except QuantConfigError:
        raise
    except ModelLoadError:
        return None


@register
class FP8(QuantMethod):
    name = "fp8"

    def __init__(self, qconfig: dict[str, Any]) -> None:
        super().__init__(qconfig)
        block = qconfig.get("weight_block_size")
        if block is not None and not (isinstance(block, (list, tuple)) and len(block) == 2
                                      and all(isinstance(b, int) and b > 0 for b in block)):
            raise QuantConfigError(f"config.json: quantization_config.weight_block_size must be two positive "
                                   f"integers or null, got {block!r}")
        self.block = ScaleBlocks(*block) if block is not None else None
        scheme = str(qconfig.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise QuantConfigError(f"config.json: quantization_config.activation_scheme {scheme!r} is not "
                                   "supported (dynamic or static)")
        fmt = qconfig.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantConfigError(f"config.json: quantization_config.fmt {fmt!r} is not supported (e4m3)")

    def tensors(self, name: str, tensor: torch.Tensor,
                checkpoint: Checkpoint) -> Iterator[tuple[str, torch.Tensor | BlockWeight]] | None:
        if name.endswith(SCALE_NAMES + UNUSED_COMPANIONS):
            return iter(())
        if not name.endswith(".weight") or tensor.dtype not in FP8_DTYPES + OTHER_FP8_DTYPES:
            return None   # a float tensor (norms, embeddings, unconverted modules)
        prefix = name[: -len(".weight")]
        for suffix in SCALE_NAMES:
            scale = companion(checkpoint, prefix + suffix)
            if scale is not None:
                weight = fp8_weight(name, tensor, scale, prefix + suffix, self._blocks(tensor, scale))
                release_checkpoint_pages(tensor)
                return iter([(name, weight)])
        raise QuantConfigError(f"{name} is FP8 but the checkpoint has no {prefix}.weight_scale_inv "
                               f"(nor {prefix}.weight_scale)")

    def _blocks(self, weight: torch.Tensor, scale: torch.Tensor) -> ScaleBlocks:
        """The scale's granularity, from its shape: the config's blocks, per tensor or
        per output channel (a shape that is none of them fails in fp8_weight, named)."""
        out_features, in_features = weight.shape if weight.dim() == 2 else (1, 1)
        if self.block is not None and tuple(scale.shape) == self.block.shape(out_features, in_features):
            return self.block
        if scale.numel() == 1:
            return ScaleBlocks(out_features, in_features)
        if tuple(scale.shape) in ((out_features,), (out_features, 1)):
            return ScaleBlocks(1, in_features)
        return self.block or ScaleBlocks(1, in_features)
