"""Command R7B / Command A (Cohere, ``Cohere2ForCausalLM``). What it adds to the shared decoder:

- a parallel block: attention and the MLP both read the same input norm's output, and both
  outputs join the residual stream (no norm between them: ``Cohere2DecoderLayer``);
- Cohere's LayerNorm: mean-subtracted, a weight and no bias (``CohereLayerNorm``), before
  each block and at the end;
- RoPE on interleaved pairs (x0, x1), (x2, x3), ...: the Q/K rows of each head are put in
  rotate-half order at load (``hf_qk_permuted``; llama.cpp's ``cohere2`` files hold HF's
  rows, rotated by its interleaved RoPE: ``gguf_qk_permuted``), so the shared rotate-half
  RoPE gives the same scores;
- windowed attention on three layers of four (``layer_types``, or ``sliding_window_pattern``),
  and the global layers apply no RoPE (NoPE);
- the logits x ``logit_scale`` (``logits_divisor`` = 1 / logit_scale).

llama.cpp's ``cohere2`` files: ``attention.layer_norm_epsilon``, ``logit_scale``,
``attention.sliding_window`` (and ``sliding_window_pattern``, else every fourth layer global),
the LM head tied to the embedding (its files hold no other).
"""

from __future__ import annotations

from typing import Any

import torch

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError, gguf_layer_types, periodic_layer_types
from pagoda.model.layers.decoder import CausalLM, DecoderLayer
from pagoda.model.layers.norm import RMSNorm

WINDOW_PERIOD = 4   # transformers' and llama.cpp's default: every fourth layer global


class CohereLayerNorm(RMSNorm):
    """LayerNorm without a bias: w * (x - mean) / sqrt(var + eps), in float32. (An RMSNorm
    subclass for what reads the model's norms: its weight, its (x, residual) call.)"""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual.add_(x)
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        centred = x - x.mean(-1, keepdim=True)
        x = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


class Cohere2DecoderLayer(DecoderLayer):
    """h = norm(x); x + attention(h) + mlp(h)."""

    def __init__(self, config: ModelArchConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        del self.post_attention_layernorm
        self.input_layernorm = CohereLayerNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_norm(x, residual)
        return self.self_attn(h, cos, sin, kv_cache, meta) + self.mlp(h), residual


def _windowed(fields: dict[str, Any]) -> ModelArchConfig:
    """The windowed layers apply RoPE, the global ones none."""
    if not fields["sliding_window"]:
        # transformers' Cohere2 rotates only in the windowed layers: no window, no RoPE at all.
        raise UnsupportedModelError("Cohere2 without a sliding_window is not supported")
    fields["rope_layers"] = tuple(t == "sliding_attention" for t in fields["layer_types"])
    return ModelArchConfig(**fields)


class Cohere2ForCausalLM(CausalLM):
    layer_cls = Cohere2DecoderLayer
    hf_qk_permuted = True
    gguf_qk_permuted = True

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        self.model.norm = CohereLayerNorm(config.hidden_size, config.rms_norm_eps)

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        if config.get("use_qk_norm"):
            raise UnsupportedModelError("Cohere2 with use_qk_norm is not supported")
        rope = config.get("rope_parameters") or {}
        partial = config.get("rotary_pct", rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
        if partial not in (None, 1, 1.0):
            # transformers' Cohere2 rotates whole heads whatever the config says (llama.cpp
            # would rotate a part): served only where the two agree.
            raise UnsupportedModelError(f"Cohere2 with partial rotary ({partial}) is not supported")
        fields = ModelArchConfig.hf_fields(config, architecture)
        n = fields["num_hidden_layers"]
        if fields["sliding_window"] and fields["layer_types"] is None:
            pattern = config.get("sliding_window_pattern", WINDOW_PERIOD)
            fields["layer_types"] = periodic_layer_types(n, int(pattern))
        fields.update(
            rms_norm_eps=float(config.get("layer_norm_eps", 1e-5)),
            o_proj_bias=fields["attention_bias"],
            logits_divisor=1.0 / float(config.get("logit_scale", 0.0625)))
        return _windowed(fields)

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        p = f"{md['general.architecture']}."
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        rotary = md.get(p + "rope.dimension_count")
        if rotary is not None and int(rotary) != fields["head_dim"]:
            raise UnsupportedModelError(f"Cohere2 GGUF: RoPE on {rotary} of {fields['head_dim']} dimensions "
                                        "(partial rotary) is not supported")
        if fields["sliding_window"]:
            fields["layer_types"] = gguf_layer_types(md, fields["num_hidden_layers"], WINDOW_PERIOD)
        scale = md.get(p + "logit_scale")
        fields.update(
            # Only the windowed layers rotate: their base, where the file gives one of their own.
            rope_theta=float(md.get(p + "rope.freq_base_swa") or fields["rope_theta"]),
            rms_norm_eps=float(md.get(p + "attention.layer_norm_epsilon", 1e-5)),
            o_proj_bias="blk.0.attn_output.bias" in tensor_names,
            logits_divisor=1.0 / float(scale) if scale else 1.0)
        return _windowed(fields)
