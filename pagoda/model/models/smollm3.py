"""SmolLM3: Llama's decoder where every fourth layer applies no rotary embedding (NoPE)."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError
from pagoda.model.models.llama import LlamaForCausalLM

# llama.cpp's fixed interval for SmolLM3 (its GGUF files carry none).
GGUF_NO_ROPE_INTERVAL = 4


def _interval_layers(n: int, interval: int) -> tuple[bool, ...]:
    return tuple((i + 1) % interval != 0 for i in range(n))


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        fields = ModelArchConfig.hf_fields(config, architecture)
        n = fields["num_hidden_layers"]
        flags = config.get("no_rope_layers")   # 1: the layer applies RoPE
        if flags is None:
            rope_layers = _interval_layers(n, config.get("no_rope_layer_interval", GGUF_NO_ROPE_INTERVAL))
        elif len(flags) != n:
            raise UnsupportedModelError(f"no_rope_layers has {len(flags)} entries for {n} layers")
        else:
            rope_layers = tuple(bool(f) for f in flags)
        return ModelArchConfig(**fields, rope_layers=rope_layers)

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        return ModelArchConfig(**fields, rope_layers=_interval_layers(fields["num_hidden_layers"], GGUF_NO_ROPE_INTERVAL))
