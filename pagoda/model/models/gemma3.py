"""Gemma 3 (text): windowed layers (five local to one global) with a RoPE base of their
own, q/k RMSNorms per head, norms before and after each block, Gemma's RMSNorm scaled by
1 + w (held as 1 + w: added to an HF checkpoint's norms at load; llama.cpp's converter
wrote them so), the embedding scaled by sqrt(hidden), a tanh-GELU gated MLP and the
attention scale 1 / sqrt(query_pre_attn_scalar)."""

from __future__ import annotations

from typing import Any

import torch

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError
from pagoda.model.layers.decoder import CausalLM

# llama.cpp's constants for Gemma 3 files (their metadata carries neither).
GGUF_WINDOW_PATTERN = 6          # every sixth layer global
GGUF_LOCAL_ROPE_THETA = 10000.0


def _pattern_layers(n: int, pattern: int) -> tuple[str, ...]:
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n))


class Gemma3ForCausalLM(CausalLM):
    @classmethod
    def hf_tensor(cls, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.float() + 1.0 if name.endswith("norm.weight") else tensor

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        if config.get("attn_logit_softcapping"):
            raise UnsupportedModelError("attention logit soft-capping is not supported")
        if config.get("use_bidirectional_attention"):
            raise UnsupportedModelError("bidirectional attention is not supported")
        fields = ModelArchConfig.hf_fields(config, architecture)
        if config.get("layer_types") is None and fields["sliding_window"]:
            fields["layer_types"] = _pattern_layers(fields["num_hidden_layers"], config.get("sliding_window_pattern", 6))
        return ModelArchConfig(
            **fields,
            qk_norm="head",
            norm_placement="sandwich",
            attention_multiplier=float(config.get("query_pre_attn_scalar") or fields["head_dim"]) ** -0.5,
            embedding_multiplier=float(fields["hidden_size"]) ** 0.5,
            final_logit_softcapping=config.get("final_logit_softcapping") or None,
        )

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        n = fields["num_hidden_layers"]
        # llama.cpp scales by 1 / sqrt(head size), except the 27B (62 layers): 1 / sqrt(hidden / heads).
        scalar = fields["hidden_size"] / fields["num_attention_heads"] if n == 62 else fields["head_dim"]
        window = fields["sliding_window"]
        return ModelArchConfig(
            **{**fields, "hidden_act": "gelu_pytorch_tanh",
               "layer_types": _pattern_layers(n, GGUF_WINDOW_PATTERN) if window else None,
               "local_rope_theta": GGUF_LOCAL_ROPE_THETA if window else None},
            qk_norm="head",
            norm_placement="sandwich",
            attention_multiplier=float(scalar) ** -0.5,
            embedding_multiplier=float(fields["hidden_size"]) ** 0.5,
            final_logit_softcapping=md.get("gemma3.final_logit_softcapping") or None,
        )
