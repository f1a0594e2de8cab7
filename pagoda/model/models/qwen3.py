"""Qwen3 (dense): an RMSNorm over each head of q and of k before RoPE, a head size
independent of the hidden size, no q/k/v biases."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig
from pagoda.model.layers.decoder import CausalLM


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        return ModelArchConfig(**{**ModelArchConfig.hf_fields(config, architecture), "qk_norm": "head"})

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        return ModelArchConfig(**{**ModelArchConfig.gguf_fields(md, tensor_names, architecture), "qk_norm": "head"})
