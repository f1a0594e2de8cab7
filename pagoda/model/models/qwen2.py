"""Qwen2 / Qwen2.5: Llama's decoder with biases on q, k and v (always, whatever the
config says); llama.cpp keeps their Q/K rows in HF's order."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig
from pagoda.model.layers.decoder import CausalLM


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        return ModelArchConfig(**{**ModelArchConfig.hf_fields(config, architecture), "attention_bias": True})
