"""Gemma 3 (text): windowed layers (five local to one global) with a RoPE base of their
own, q/k RMSNorms per head, norms before and after each block, Gemma's RMSNorm scaled by
1 + w (held as 1 + w: added to an HF checkpoint's norms at load; llama.cpp's converter
wrote them so), the embedding scaled by sqrt(hidden), a tanh-GELU gated MLP and the
attention scale 1 / sqrt(query_pre_attn_scalar)."""

from __future__ import annotations

from typing import Any

import torch

from pagoda.model.arch import (
    ModelArchConfig,
    UnsupportedModelError,
    gguf_layer_types,
    periodic_layer_types,
)
from pagoda.model.layers.decoder import CausalLM

# transformers' Gemma3TextConfig defaults: a checkpoint's config.json leaves out the fields
# that keep them (the multimodal checkpoints' text_config most of all).
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_local_base_freq": 10000.0,
    "sliding_window_pattern": 6, "tie_word_embeddings": True,
}

# llama.cpp's constants for Gemma 3 files (their metadata carries neither).
GGUF_WINDOW_PATTERN = 6          # every sixth layer global
GGUF_LOCAL_ROPE_THETA = 10000.0


class Gemma3ForCausalLM(CausalLM):
    @classmethod
    def hf_tensor(cls, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.float() + 1.0 if name.endswith("norm.weight") else tensor

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        if config.get("use_bidirectional_attention"):
            raise UnsupportedModelError("bidirectional attention is not supported")
        config = {**TEXT_DEFAULTS, **config}
        fields = ModelArchConfig.hf_fields(config, architecture)
        if config.get("layer_types") is None and fields["sliding_window"]:
            fields["layer_types"] = periodic_layer_types(fields["num_hidden_layers"],
                                                         config.get("sliding_window_pattern", 6))
        return ModelArchConfig(
            **fields,
            qk_norm="head",
            norm_placement="sandwich",
            attention_multiplier=float(config.get("query_pre_attn_scalar") or fields["head_dim"]) ** -0.5,
            embedding_multiplier=float(fields["hidden_size"]) ** 0.5,
            attn_logit_softcapping=config.get("attn_logit_softcapping") or None,
            final_logit_softcapping=config.get("final_logit_softcapping") or None,
        )

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        n = fields["num_hidden_layers"]
        # llama.cpp scales by 1 / sqrt(head size), except the 27B (62 layers): 1 / sqrt(hidden / heads).
        scalar = fields["hidden_size"] / fields["num_attention_heads"] if n == 62 else fields["head_dim"]
        window = fields["sliding_window"]
        local_theta = md.get(f"{md['general.architecture']}.rope.freq_base_swa", GGUF_LOCAL_ROPE_THETA)
        return ModelArchConfig(
            **{**fields, "hidden_act": "gelu_pytorch_tanh",
               "layer_types": gguf_layer_types(md, n, GGUF_WINDOW_PATTERN) if window else None,
               "local_rope_theta": float(local_theta) if window else None},
            qk_norm="head",
            norm_placement="sandwich",
            attention_multiplier=float(scalar) ** -0.5,
            embedding_multiplier=float(fields["hidden_size"]) ** 0.5,
            final_logit_softcapping=md.get("gemma3.final_logit_softcapping") or None,
        )
