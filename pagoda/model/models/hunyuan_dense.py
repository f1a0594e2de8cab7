"""Hunyuan dense (Tencent, ``HunYuanDenseV1ForCausalLM``): Llama's decoder with per-head q/k
RMSNorms applied to the rotated heads (after RoPE, not before: ``qk_norm_after_rope``),
biases on q, k, v and o where ``attention_bias``, and its "dynamic" RoPE with a fixed
``alpha`` (NTK-alpha): a static base rope_theta x alpha ** (head_dim / (head_dim - 2)), as
transformers computes it ("dynamic" without ``alpha``, a scaling by sequence length, is
refused). llama.cpp's ``hunyuan-dense`` files keep Q/K rows in HF's order and hold the base
already stretched (``rope.freq_base``; a ``rope.scaling.alpha`` key stretches it at load,
as llama.cpp does)."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError
from pagoda.model.layers.decoder import CausalLM
from pagoda.model.layers.rotary import rope_kind

_RENAMES = ((".self_attn.query_layernorm.", ".self_attn.q_norm."), (".self_attn.key_layernorm.", ".self_attn.k_norm."))


def ntk_alpha_theta(theta: float, alpha: float, head_dim: int) -> float:
    """The RoPE base NTK-alpha stretches ``theta`` to."""
    return theta * alpha ** (head_dim / (head_dim - 2))


class HunYuanDenseV1ForCausalLM(CausalLM):
    @classmethod
    def hf_name(cls, name: str) -> str:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return name

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        for key, refused in (("use_cla", True), ("use_mixed_mlp_moe", True), ("use_qk_norm", False),
                             ("mlp_bias", True)):
            if key in config and bool(config[key]) == refused:
                raise UnsupportedModelError(f"HunYuan dense with {key}={config[key]} is not supported")
        experts = config.get("num_experts") or 1
        if not isinstance(experts, int) or experts > 1:
            raise UnsupportedModelError(f"HunYuan dense with num_experts={experts} (a mixture of experts) "
                                        "is not supported")
        fields = ModelArchConfig.hf_fields(config, architecture)
        scaling = fields["rope_scaling"]
        if rope_kind(scaling) == "dynamic":
            if not scaling.get("alpha"):
                raise UnsupportedModelError("HunYuan's dynamic RoPE without an alpha (scaled by the sequence "
                                            "length) is not supported")
            fields["rope_theta"] = ntk_alpha_theta(fields["rope_theta"], float(scaling["alpha"]), fields["head_dim"])
            fields["rope_scaling"] = None
        return ModelArchConfig(**fields, qk_norm="head", qk_norm_after_rope=True, o_proj_bias=fields["attention_bias"])

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        p = f"{md['general.architecture']}."
        if md.get(p + "rope.dimension_sections"):
            raise UnsupportedModelError("HunYuan GGUF with rope.dimension_sections (XD-RoPE) is not supported")
        if int(md.get(p + "expert_count") or 0) > 1:
            raise UnsupportedModelError("HunYuan dense GGUF with experts is not supported")
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        alpha = float(md.get(p + "rope.scaling.alpha") or 0.0)
        if alpha > 0:
            fields["rope_theta"] = ntk_alpha_theta(fields["rope_theta"], alpha, fields["head_dim"])
        if "blk.0.attn_q_norm.weight" not in tensor_names:
            raise UnsupportedModelError("HunYuan dense GGUF without q/k norms is not supported")
        return ModelArchConfig(**fields, qk_norm="head", qk_norm_after_rope=True,
                               o_proj_bias="blk.0.attn_output.bias" in tensor_names)
