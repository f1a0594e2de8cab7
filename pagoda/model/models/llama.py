"""Llama 2/3.x (and SmolLM2, which is a Llama) and Mistral: the shared decoder as it is."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig

from pagoda.model.layers.decoder import CausalLM, GatedMLP as LlamaMLP  # noqa: F401 (LlamaMLP re-exported)
from pagoda.model.layers.norm import RMSNorm  # noqa: F401 (re-exported)
from pagoda.model.layers.rotary import apply_rope  # noqa: F401 (re-exported)


class LlamaForCausalLM(CausalLM):
    # llama.cpp's Llama converter interleaves each head's Q/K rows for its rotary layout.
    gguf_qk_permuted = True

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        if md.get(f"{md['general.architecture']}.expert_count"):   # llama.cpp writes Mixtral as a llama file
            from pagoda.model.models.mixtral import MixtralForCausalLM

            return MixtralForCausalLM.arch_from_gguf(md, tensor_names, "MixtralForCausalLM")
        return super().arch_from_gguf(md, tensor_names, architecture)


class MistralForCausalLM(LlamaForCausalLM):
    pass
