"""Gemma 2: Gemma 3's block without q/k norms and with one RoPE base, windowed and global
layers alternating (the first windowed), attention logits soft-capped (cap x tanh(s /
cap), 50) and the final logits too (30)."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig, gguf_layer_types, periodic_layer_types
from pagoda.model.models.gemma3 import Gemma3ForCausalLM

GGUF_WINDOW = 4096   # llama.cpp's Gemma 2 window when a file states none

# transformers' Gemma2Config defaults, for the fields a config.json leaves out.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0, "tie_word_embeddings": True,
}


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        config = {**TEXT_DEFAULTS, **config}
        fields = ModelArchConfig.hf_fields(config, architecture)
        if config.get("layer_types") is None and fields["sliding_window"]:
            fields["layer_types"] = periodic_layer_types(fields["num_hidden_layers"], 2)
        return ModelArchConfig(
            **fields,
            norm_placement="sandwich",
            attention_multiplier=float(config["query_pre_attn_scalar"]) ** -0.5,
            embedding_multiplier=float(fields["hidden_size"]) ** 0.5,
            attn_logit_softcapping=config.get("attn_logit_softcapping") or None,
            final_logit_softcapping=config.get("final_logit_softcapping") or None,
        )

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        p = f"{md['general.architecture']}."
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        n = fields["num_hidden_layers"]
        # llama.cpp scales by 1 / sqrt(head size), except the 27B (46 layers): 1 / sqrt(hidden / heads).
        scalar = fields["hidden_size"] / fields["num_attention_heads"] if n == 46 else fields["head_dim"]
        window = fields["sliding_window"] or GGUF_WINDOW   # llama.cpp's default when the key is absent
        swa_theta = md.get(p + "rope.freq_base_swa")
        return ModelArchConfig(
            **{**fields, "hidden_act": "gelu_pytorch_tanh", "sliding_window": window,
               "layer_types": gguf_layer_types(md, n, 2),
               "local_rope_theta": float(swa_theta) if swa_theta is not None else None},
            norm_placement="sandwich",
            attention_multiplier=float(scalar) ** -0.5,
            embedding_multiplier=float(fields["hidden_size"]) ** 0.5,
            attn_logit_softcapping=md.get(p + "attn_logit_softcapping") or None,
            final_logit_softcapping=md.get(p + "final_logit_softcapping") or None,
        )
