"""Llama 2/3.x (and SmolLM2, which is a Llama) and Mistral: the shared decoder as it is."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig, gguf_moe_layers, moe_fields

from pagoda.model.layers.decoder import CausalLM, GatedMLP as LlamaMLP  # noqa: F401 (LlamaMLP re-exported)
from pagoda.model.layers.norm import RMSNorm  # noqa: F401 (re-exported)
from pagoda.model.layers.rotary import apply_rope  # noqa: F401 (re-exported)


class LlamaForCausalLM(CausalLM):
    # llama.cpp's Llama converter interleaves each head's Q/K rows for its rotary layout.
    gguf_qk_permuted = True

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        p = f"{md['general.architecture']}."
        if md.get(p + "expert_count"):   # llama.cpp writes Mixtral as a llama file (mixtral.py serves it)
            fields = ModelArchConfig.gguf_fields(md, tensor_names, "MixtralForCausalLM")
            return ModelArchConfig(**fields, **moe_fields(md[p + "expert_count"], md[p + "expert_used_count"],
                                                          fields["intermediate_size"], True),
                                   moe_layers=gguf_moe_layers(tensor_names, fields["num_hidden_layers"]))
        return super().arch_from_gguf(md, tensor_names, architecture)


class MistralForCausalLM(LlamaForCausalLM):
    pass
