"""The registry of pre-quantized checkpoint formats (re-exported by the package) - pre-quantized HF checkpoints: ``quantization_config`` in config.json picks one
``QuantMethod`` (a class per format, registered by its ``quant_method`` name).

A method turns the checkpoint's tensors of one linear layer (GPTQ's ``qweight`` /
``qzeros`` / ``scales`` / ``g_idx``, FP8's ``weight`` / ``weight_scale``, ...) into the
layer's weight as a ``BlockWeight``: the blocks pagoda's kernels multiply in place
(pagoda/csrc/gguf_blocks.cpp), so no full-precision copy stays resident. The loader
(pagoda/model/loader.py) hands every checkpoint tensor to ``QuantMethod.tensors`` before
the model family's own ``hf_tensors``; what the method does not claim passes unchanged.

A new format is one module in this package with a ``@register``-ed subclass, and one
import line below.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from pagoda.hub.paths import ModelLoadError
from pagoda.model.layers.blocks import BlockWeight


class QuantConfigError(ModelLoadError):
    """A checkpoint's quantization (its config or its tensors) pagoda cannot serve; the
    message names the tensor or the config field."""


Checkpoint = Callable[[str], torch.Tensor]   # name -> that tensor of the checkpoint


class QuantMethod:
    """One pre-quantized checkpoint format, built from the config's
    ``quantization_config`` (raise ``QuantConfigError`` for what it cannot serve)."""

    name: ClassVar[str]   # ``quant_method`` as config.json spells it

    def __init__(self, qconfig: dict[str, Any]) -> None:
        self.qconfig = qconfig

    def tensors(self, name: str, tensor: torch.Tensor,
                checkpoint: Checkpoint) -> Iterator[tuple[str, torch.Tensor | BlockWeight]] | None:
        """The checkpoint tensor ``name`` as model tensors: a quantized layer's main
        tensor yields ``(prefix + ".weight", BlockWeight)`` (its companions read through
        ``checkpoint``), a companion tensor yields nothing, and None means the tensor is
        not this format's (the loader passes it on as it is)."""
        raise NotImplementedError

    def check_quantization(self, mode: str) -> None:
        """``--quantization mode`` given with this checkpoint: "none" (serve the
        checkpoint's own format) is always fine; another mode must agree with the
        checkpoint or be refused here with a clear error."""
        if mode != "none":
            raise QuantConfigError(f"the checkpoint is quantized with {self.name!r}; "
                                   f"--quantization {mode} does not apply to it (leave it out)")


METHODS: dict[str, type[QuantMethod]] = {}


def register(cls: type[QuantMethod]) -> type[QuantMethod]:
    METHODS[cls.name] = cls
    return cls


# Formats handled by a model family itself (GPT-OSS's MXFP4 experts: models/gpt_oss.py).
FAMILY_FORMATS = frozenset({"mxfp4"})


def method_for(config: dict[str, Any]) -> QuantMethod | None:
    """The method of an HF config.json's ``quantization_config``; None when the
    checkpoint is not pre-quantized (or its family reads the format itself)."""
    qconfig = config.get("quantization_config")
    if not qconfig:
        return None
    if not isinstance(qconfig, dict) or not isinstance(qconfig.get("quant_method"), str):
        raise QuantConfigError("config.json: quantization_config has no quant_method")
    name = qconfig["quant_method"]
    if name in FAMILY_FORMATS:
        return None
    if name not in METHODS:
        raise QuantConfigError(f"config.json: quant_method {name!r} is not supported "
                               f"(supported: {', '.join(sorted(METHODS | dict.fromkeys(FAMILY_FORMATS)))})")
    return METHODS[name](qconfig)
