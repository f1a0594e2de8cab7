"""OLMo 2: norms after each block (of its output, before the residual add) instead of
before it, and RMSNorms over the whole q and k projections before RoPE (under tensor
parallelism each rank's mean square comes from every rank's sums: Attention._sharded_norm)."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig
from pagoda.model.layers.decoder import CausalLM

_OPTIONS = {"qk_norm": "full", "norm_placement": "post"}


class Olmo2ForCausalLM(CausalLM):

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        return ModelArchConfig(**{**ModelArchConfig.hf_fields(config, architecture), **_OPTIONS})

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        return ModelArchConfig(**{**ModelArchConfig.gguf_fields(md, tensor_names, architecture), **_OPTIONS})
