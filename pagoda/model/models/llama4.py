"""Llama 4 (text; Scout and Maverick as published, with their vision tower, serve text):
chunked local attention (a query sees only the keys of its own chunk of
``attention_chunk_size`` positions) on the layers with RoPE, three of four; the fourth
attends globally with no RoPE and scales its queries by position (attention-temperature
tuning); a weightless per-head q/k RMSNorm on the RoPE layers (``use_qk_norm``); RoPE on
interleaved pairs (rows permuted to rotate-half order at load); MoE layers every
``interleave_moe_layer_step`` layers between dense ones: the top router logits choose, their
sigmoids weigh each chosen expert's *input*, and a shared expert of the experts' width runs
beside them. HF checkpoints stack each layer's experts (gate and up as one
[experts, hidden, 2 x width] tensor).

llama.cpp's ``llama4`` files hold HF's Q/K rows and fix what their metadata leaves out: chunks
of 8192 on three of four layers (``attention.sliding_window_pattern``), every fourth without
RoPE, temperature tuning at floor 8192 and scale 0.1, q/k norms unless 128 experts."""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator

import torch

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError, gguf_layer_types, moe_fields, text_config
from pagoda.model.layers.decoder import CausalLM, split_stacked_experts
from pagoda.model.layers.hybrid import renamed

_EXPERTS = re.compile(r"(.*\.)feed_forward\.experts\.(gate_up_proj|down_proj)$")
_RENAMES = ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.shared_expert.", ".mlp.shared_experts."),
            (".feed_forward.", ".mlp."))
# llama.cpp's constants for llama4 files (not in their metadata).
GGUF_CHUNK = 8192
GGUF_PERIOD = 4                  # three chunked layers with RoPE, then a global one without
GGUF_TEMPERATURE = (8192.0, 0.1)
_ROPE_TYPES = ("default", "llama3")


def _hf_layers(config: dict[str, Any], n: int) -> tuple[tuple[bool, ...], tuple[str, ...], tuple[bool, ...]]:
    """(RoPE per layer, layer types, MoE per layer) of a config, transformers' defaults filled in."""
    interval = config.get("no_rope_layer_interval", 4)
    rope = tuple(bool(f) for f in (config.get("no_rope_layers") or [(i + 1) % interval != 0 for i in range(n)]))
    chunk = config.get("attention_chunk_size")
    types = config.get("layer_types") or ["chunked_attention" if r and chunk else "full_attention" for r in rope]
    step = config.get("interleave_moe_layer_step", 1)
    moe = config.get("moe_layers")
    moe = set(moe if moe is not None else range(step - 1, n, step))
    return rope, tuple(types), tuple(i in moe for i in range(n))


class Llama4ForCausalLM(CausalLM):
    hf_qk_permuted = True     # transformers' Llama 4 rotates interleaved pairs
    gguf_qk_permuted = True   # llama.cpp's files keep them so
    unquantized_modules = (".mlp.gate",)

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        return renamed(name, _RENAMES)

    @classmethod
    def hf_tensors(cls, name: str, tensor: torch.Tensor,
                   checkpoint: Callable[[str], torch.Tensor] | None = None) -> Iterator[tuple[str, Any]]:  # fmt: skip
        ours = cls.hf_name(name)
        m = _EXPERTS.match(name) if ours is not None else None
        if m is None:
            yield from super().hf_tensors(name, tensor, checkpoint)
            return
        yield from split_stacked_experts(cls.hf_name(m.group(1) + "feed_forward.") + "experts", m.group(2), tensor,
                                         transposed=True)

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        fields = ModelArchConfig.hf_fields(config, architecture)
        kind = (fields["rope_scaling"] or {}).get("rope_type", "default")
        if kind not in _ROPE_TYPES:
            raise UnsupportedModelError(f"Llama 4 rope scaling {kind!r} is not supported; supported: {_ROPE_TYPES}")
        n = fields["num_hidden_layers"]
        rope, types, moe = _hf_layers(config, n)
        experts = config.get("num_local_experts") or 0
        if not experts:
            raise UnsupportedModelError("Llama 4 without experts is not supported")
        return _arch(fields, rope, types, moe, config.get("attention_chunk_size"),
                     (float(config.get("floor_scale", 8192)), float(config.get("attn_scale", 0.1)))
                     if config.get("attn_temperature_tuning", True) else None,
                     bool(config.get("use_qk_norm", True)),
                     intermediate_size=config.get("intermediate_size_mlp") or fields["intermediate_size"],
                     o_proj_bias=fields["attention_bias"],
                     **moe_fields(experts, config.get("num_experts_per_tok", 1), fields["intermediate_size"], False))

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        p = f"{md['general.architecture']}."
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        window = md.get(p + "attention.sliding_window")
        if window is not None and int(window) == 0:
            raise UnsupportedModelError("llama4 GGUF files without chunked attention (sliding_window 0) are not "
                                        "supported")
        base_swa = md.get(p + "rope.freq_base_swa")
        if base_swa is not None and float(base_swa) != fields["rope_theta"]:
            raise UnsupportedModelError("llama4 GGUF: a RoPE base of the chunked layers' own is not supported")
        n = fields["num_hidden_layers"]
        types = tuple("chunked_attention" if t == "sliding_attention" else t
                      for t in gguf_layer_types(md, n, GGUF_PERIOD))
        rope = tuple((i + 1) % GGUF_PERIOD != 0 for i in range(n))
        step = int(md.get(p + "interleave_moe_layer_step") or 1)
        moe = tuple(step > 0 and (i + 1) % step == 0 for i in range(n))
        experts = int(md.get(p + "expert_count") or 0)
        if not experts:
            raise UnsupportedModelError("llama4 GGUF files without experts are not supported")
        return _arch(fields, rope, types, moe, GGUF_CHUNK, GGUF_TEMPERATURE, experts != 128,
                     **moe_fields(experts, md[p + "expert_used_count"], md[p + "expert_feed_forward_length"], False))


def _arch(fields: dict[str, Any], rope: tuple[bool, ...], types: tuple[str, ...], moe: tuple[bool, ...],
          chunk: int | None, temperature: tuple[float, float] | None, qk_norm: bool, **extra: Any) -> ModelArchConfig:
    if any(t == "chunked_attention" for t in types) and not chunk:
        raise UnsupportedModelError("Llama 4 chunked_attention layers need an attention_chunk_size")
    chunked = "chunked_attention" in types
    return ModelArchConfig(**{
        **fields, **extra, "sliding_window": None,
        "layer_types": types if chunked else None, "attention_chunk_size": chunk if chunked else None,
        "rope_layers": rope if not all(rope) else None, "attn_temperature": temperature if not all(rope) else None,
        "qk_norm": "head" if qk_norm else None, "qk_norm_layers": rope, "qk_norm_weights": False,
        "moe_layers": moe if not all(moe) else None, "num_shared_experts": 1,
        "expert_scoring": "sigmoid", "expert_weights_on_input": True})

class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """Llama 4 Scout / Maverick as published (with a vision tower): the language model is
    served, text in and text out; the vision tower's and projector's tensors are not read."""

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        if name.startswith(("vision_model.", "multi_modal_projector.", "model.vision_model.",
                            "model.multi_modal_projector.")):
            return None
        for prefix, new in (("language_model.model.", "model."), ("model.language_model.", "model."),
                            ("language_model.lm_head.", "lm_head.")):
            if name.startswith(prefix):
                name = new + name[len(prefix):]
                break
        return super().hf_name(name)

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        return super().arch_from_hf(text_config(config), architecture)
