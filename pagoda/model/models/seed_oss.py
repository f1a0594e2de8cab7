"""Seed-OSS (ByteDance): Llama's decoder with biases on q, k and v (``attention_bias``), and
where the config says so on o (``attention_out_bias``) and on the MLP (``mlp_bias``).
llama.cpp's ``seed_oss`` files keep Q/K rows in HF's order and name the MLP's norm
``attn_post_norm``."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig
from pagoda.model.layers.decoder import CausalLM


class SeedOssForCausalLM(CausalLM):
    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        return ModelArchConfig(**ModelArchConfig.hf_fields(config, architecture),
                               o_proj_bias=bool(config.get("attention_out_bias")),
                               mlp_bias=bool(config.get("mlp_bias")))

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        return ModelArchConfig(**ModelArchConfig.gguf_fields(md, tensor_names, architecture),
                               o_proj_bias="blk.0.attn_output.bias" in tensor_names,
                               mlp_bias="blk.0.ffn_up.bias" in tensor_names)
