"""Phi-3 and Phi-4: Llama's decoder, with q/k/v and gate/up stored already stacked in the
checkpoint (``qkv_proj``, ``gate_up_proj``: gate rows first, as pagoda stacks them) and in
llama.cpp's files (``attn_qkv``; ``ffn_up`` holding gate and up). Phi-3.5 and Phi-4-mini
add partial rotary (``partial_rotary_factor``) and LongRoPE scaling (short factors within
the original context, long ones past it: pagoda.model.layers.rotary.longrope_tables);
llama.cpp's LongRoPE files keep the factors as tensors (``rope_factors_long`` /
``rope_factors_short``), read as configuration. Under tensor parallelism the
stacked tensors are split part by part (ShardPlan.narrow). Phi-3-mini's window (2047) is
honoured from GGUF files too, as transformers honours it (llama.cpp disables Phi's SWA)."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError
from pagoda.model.layers.decoder import CausalLM
from pagoda.model.layers.rotary import rope_kind


class Phi3ForCausalLM(CausalLM):
    packed_modules_mapping = {}   # the checkpoint's own tensors are the stacked projections

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        params = config.get("rope_parameters") or {}
        partial = config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) or 1.0
        fields = ModelArchConfig.hf_fields(config, architecture)
        scaling = fields["rope_scaling"]
        if scaling and rope_kind(scaling) == "longrope":
            fields["rope_scaling"] = {
                **scaling, "rope_type": "longrope",
                "original_max_position_embeddings": scaling.get("original_max_position_embeddings")
                or config.get("original_max_position_embeddings"),
                "max_position_embeddings": fields["max_position_embeddings"]}
        rotary = int(fields["head_dim"] * partial)
        return ModelArchConfig(**fields, rotary_dim=None if rotary == fields["head_dim"] else rotary)

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        rot = md.get("phi3.rope.dimension_count")
        if "rope_factors_long.weight" in tensor_names:
            # llama.cpp's LongRoPE: the factors as tensors (the loader reads them into md),
            # the original context and the attention factor as keys.
            original = md.get("phi3.rope.scaling.original_context_length")
            if original is None or "rope_factors_short.weight" not in md:
                raise UnsupportedModelError("a LongRoPE GGUF file needs rope_factors_short and "
                                            "phi3.rope.scaling.original_context_length")
            fields["rope_scaling"] = {
                "rope_type": "longrope", "long_factor": md["rope_factors_long.weight"],
                "short_factor": md["rope_factors_short.weight"], "original_max_position_embeddings": int(original),
                "max_position_embeddings": fields["max_position_embeddings"],
                "attention_factor": md.get("phi3.rope.scaling.attn_factor")}
        return ModelArchConfig(**fields, rotary_dim=None if rot in (None, fields["head_dim"]) else rot)
