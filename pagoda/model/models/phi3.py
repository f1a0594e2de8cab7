"""Phi-3 and Phi-4: Llama's decoder, with q/k/v and gate/up stored already stacked in the
checkpoint (``qkv_proj``, ``gate_up_proj``: gate rows first, as pagoda stacks them) and in
llama.cpp's files (``attn_qkv``; ``ffn_up`` holding gate and up). LongRoPE scaling and
partial rotary (Phi-3.5 / Phi-4-mini) are refused, as is tensor parallelism (the stacked
tensors would be split by part, not yet done)."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError
from pagoda.model.layers.decoder import CausalLM


class Phi3ForCausalLM(CausalLM):
    packed_modules_mapping = {}   # the checkpoint's own tensors are the stacked projections
    tensor_parallel = False

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        params = config.get("rope_parameters") or {}
        partial = config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise UnsupportedModelError(f"partial_rotary_factor {partial} is not supported")
        return ModelArchConfig(**ModelArchConfig.hf_fields(config, architecture))

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        rot = md.get("phi3.rope.dimension_count")
        if rot is not None and rot != fields["head_dim"]:
            raise UnsupportedModelError(f"partial rotary ({rot} of {fields['head_dim']} dimensions) is not supported")
        if "rope_factors_long.weight" in tensor_names:
            raise UnsupportedModelError("LongRoPE scaling (rope_factors_long) is not supported")
        return ModelArchConfig(**fields)
