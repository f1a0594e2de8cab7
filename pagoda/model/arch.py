"""Architecture hyper-parameters, read from an HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF `architectures` name -> (model family, q/k/v projections carry a bias).
# Every entry is served by the same plain Llama-style module.
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

SUPPORTED_ROPE_SCALING = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported; supported: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in SUPPORTED_ROPE_SCALING:
                raise UnsupportedModelError(
                    f"rope scaling {kind!r} is not supported; supported: {SUPPORTED_ROPE_SCALING}"
                )

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + lm_head

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArchConfig:
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {archs or config.get('model_type')!r} is not supported; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {config['hidden_act']!r} is not supported")
        if config.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention is not supported")
        heads = config["num_attention_heads"]
        rope_scaling = config.get("rope_scaling")
        rope_theta = config.get("rope_theta")
        # transformers 5 moved rope settings into "rope_parameters".
        params = config.get("rope_parameters")
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=SUPPORTED_ARCHITECTURES[arch] or bool(config.get("attention_bias")),
            rope_scaling=rope_scaling,
            sliding_window=config.get("sliding_window"),
        )

    @classmethod
    def from_gguf_metadata(cls, md: dict[str, Any], tensor_names: set[str]) -> ModelArchConfig:
        gguf_arch = md.get("general.architecture")
        if gguf_arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {gguf_arch!r} is not supported; supported: "
                f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
            )
        p = f"{gguf_arch}."
        hidden = md[p + "embedding_length"]
        heads = md[p + "attention.head_count"]
        vocab = md.get(p + "vocab_size") or len(md["tokenizer.ggml.tokens"])
        rope_scaling = None
        if md.get(p + "rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": "linear", "factor": md[p + "rope.scaling.factor"]}
        elif md.get(p + "rope.scaling.type") not in (None, "none"):
            raise UnsupportedModelError(
                f"GGUF rope scaling {md[p + 'rope.scaling.type']!r} is not supported"
            )
        arch = GGUF_ARCHITECTURES[gguf_arch]
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=md[p + "feed_forward_length"],
            num_hidden_layers=md[p + "block_count"],
            num_attention_heads=heads,
            num_key_value_heads=md.get(p + "attention.head_count_kv") or heads,
            head_dim=md.get(p + "attention.key_length") or hidden // heads,
            rms_norm_eps=md.get(p + "attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=float(md.get(p + "rope.freq_base", 10000.0)),
            max_position_embeddings=md.get(p + "context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            rope_scaling=rope_scaling,
        )
