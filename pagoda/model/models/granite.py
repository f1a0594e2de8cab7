"""Granite 3: Llama's decoder with four multipliers: the embedding's output, each block's
output before the residual add, the attention scale (in place of 1 / sqrt(head_dim)) and
the logits (divided)."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig
from pagoda.model.models.llama import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        return ModelArchConfig(
            **ModelArchConfig.hf_fields(config, architecture),
            embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(config.get("residual_multiplier", 1.0)),
            attention_multiplier=float(config.get("attention_multiplier", 1.0)),
            logits_divisor=float(config.get("logits_scaling", 1.0)),
        )

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        p = f"{md['general.architecture']}."
        return ModelArchConfig(
            **ModelArchConfig.gguf_fields(md, tensor_names, architecture),
            embedding_multiplier=float(md.get(p + "embedding_scale", 1.0)),
            residual_multiplier=float(md.get(p + "residual_scale", 1.0)),
            attention_multiplier=float(md.get(p + "attention.scale", 1.0)),
            logits_divisor=float(md.get(p + "logit_scale", 1.0)),
        )
