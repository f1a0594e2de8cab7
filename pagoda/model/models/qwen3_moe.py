"""Qwen3-MoE: Qwen3's attention (q/k norms per head) and, in place of the MLP of every
``decoder_sparse_step``-th layer not in ``mlp_only_layers``, many small experts (e.g. 8 of
128 per token), their weights renormalised when ``norm_topk_prob``."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig, gguf_moe_layers, moe_fields
from pagoda.model.layers.decoder import CausalLM


class Qwen3MoeForCausalLM(CausalLM):
    unquantized_modules = (".mlp.gate",)

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        fields = ModelArchConfig.hf_fields(config, architecture)
        n, step = fields["num_hidden_layers"], config.get("decoder_sparse_step", 1)
        dense = set(config.get("mlp_only_layers") or ())
        layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
        return ModelArchConfig(
            **fields, qk_norm="head", moe_layers=None if all(layers) else layers,
            **moe_fields(config.get("num_experts") or config["num_local_experts"], config["num_experts_per_tok"],
                         config["moe_intermediate_size"],
                         bool(config.get("norm_topk_prob", False))))

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        p = f"{md['general.architecture']}."
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        # llama.cpp renormalises Qwen3-MoE's expert weights (its converter writes no flag).
        return ModelArchConfig(
            **fields, qk_norm="head", moe_layers=gguf_moe_layers(tensor_names, fields["num_hidden_layers"]),
            **moe_fields(md[p + "expert_count"], md[p + "expert_used_count"], md[p + "expert_feed_forward_length"],
                         bool(md.get(p + "expert_weights_norm", True))))
