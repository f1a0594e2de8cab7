"""EXAONE 4 (LG AI): OLMo 2's post-norms (each block's output normed before the residual
add, no input norm), q/k RMSNorms per head before RoPE; with a sliding window, three
windowed layers to one global (``layer_types``, or ``sliding_window_pattern`` as "LLLG" or a
period), and the global layers apply no RoPE (NoPE). llama.cpp's ``exaone4`` files keep Q/K
rows in HF's order; their windows are ``attention.sliding_window`` and
``attention.sliding_window_pattern``."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError, gguf_layer_types, periodic_layer_types
from pagoda.model.layers.decoder import CausalLM

_OPTIONS = {"qk_norm": "head", "norm_placement": "post"}
WINDOW_PERIOD = 4   # transformers' and llama.cpp's default: every fourth layer global


def _layer_types(config: dict[str, Any], n: int) -> tuple[str, ...]:
    pattern = config.get("sliding_window_pattern", WINDOW_PERIOD)
    if isinstance(pattern, str):   # "LLLG": L windowed, G global, repeated
        return tuple("sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(n))
    if isinstance(pattern, int) and pattern > 0:
        return periodic_layer_types(n, pattern)
    raise UnsupportedModelError(f"EXAONE 4 sliding_window_pattern {pattern!r} is not supported")


def _windowed(fields: dict[str, Any]) -> dict[str, Any]:
    """The windowed layers apply RoPE, the global ones none (with no window, every layer does)."""
    if fields["sliding_window"]:
        fields["rope_layers"] = tuple(t == "sliding_attention" for t in fields["layer_types"])
    return {**fields, **_OPTIONS}


class Exaone4ForCausalLM(CausalLM):
    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        fields = ModelArchConfig.hf_fields(config, architecture)
        if fields["sliding_window"] and fields["layer_types"] is None:
            fields["layer_types"] = _layer_types(config, fields["num_hidden_layers"])
        return ModelArchConfig(**_windowed(fields))

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        if fields["sliding_window"]:
            fields["layer_types"] = gguf_layer_types(md, fields["num_hidden_layers"], WINDOW_PERIOD)
        return ModelArchConfig(**_windowed(fields))
