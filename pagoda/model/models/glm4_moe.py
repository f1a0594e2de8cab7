"""GLM-4.5 / 4.6 (Zhipu): GQA attention with biases on q, k and v, optional per-head q/k
norms and RoPE on the first half of each head (``partial_rotary_factor``, GPT-NeoX order);
dense first layers (``first_k_dense_replace``), then DeepSeek-V3's router (sigmoid scores, a
per-expert bias that chooses but does not weigh, groups ranked by their best two, weights
renormalised x ``routed_scaling_factor``) over routed experts plus shared experts.
llama.cpp's ``glm4moe`` files keep Q/K rows in HF's order; their multi-token-prediction
blocks past the last layer (``nextn_predict_layers``) are not read, nor are an HF
checkpoint's (layers from ``num_hidden_layers`` on)."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError, gguf_moe_layers, moe_fields
from pagoda.model.layers.decoder import CausalLM

class Glm4MoeForCausalLM(CausalLM):
    unquantized_modules = (".mlp.gate",)

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        return name.replace(".mlp.gate.e_score_correction_bias", ".mlp.score_bias")

    @classmethod
    def gguf_lookup_name(cls, name: str) -> str:
        # (llama.cpp's converter: "e_score_correction.bias", its exp_probs_b.bias)
        return name.replace(".mlp.score_bias", ".mlp.gate.e_score_correction.bias")

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        fields = ModelArchConfig.hf_fields(config, architecture)
        n = fields["num_hidden_layers"]
        rope = config.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))
        groups = config.get("n_group") or 1
        return ModelArchConfig(
            **fields, rotary_dim=int(fields["head_dim"] * partial), qk_norm="head" if config.get("use_qk_norm") else None,
            moe_layers=tuple(i >= config.get("first_k_dense_replace", 1) for i in range(n)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            num_shared_experts=config.get("n_shared_experts") or 0,
            expert_scoring="sigmoid", expert_score_bias=True, expert_group_score="top2",
            expert_groups=(groups, config.get("topk_group") or groups),
            **moe_fields(config["n_routed_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"],
                         bool(config.get("norm_topk_prob", True))))

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        p = f"{md['general.architecture']}."
        n = int(md[p + "block_count"]) - int(md.get(p + "nextn_predict_layers", 0) or 0)
        fields = ModelArchConfig.gguf_fields({**md, p + "block_count": n}, tensor_names, architecture)
        if int(md.get(p + "expert_gating_func", 2)) != 2:
            raise UnsupportedModelError("GLM-4.5 GGUF: only sigmoid expert gating (expert_gating_func 2) is supported")
        groups = int(md.get(p + "expert_group_count") or 1)
        return ModelArchConfig(
            **fields, rotary_dim=int(md.get(p + "rope.dimension_count") or fields["head_dim"] // 2),
            qk_norm="head" if "blk.0.attn_q_norm.weight" in tensor_names else None,
            moe_layers=gguf_moe_layers(tensor_names, n),
            routed_scaling_factor=float(md.get(p + "expert_weights_scale") or 1.0),
            num_shared_experts=int(md.get(p + "expert_shared_count") or 0),
            expert_scoring="sigmoid", expert_score_bias=True, expert_group_score="top2",
            expert_groups=(groups, int(md.get(p + "expert_group_used_count") or groups)),
            **moe_fields(md[p + "expert_count"], md[p + "expert_used_count"], md[p + "expert_feed_forward_length"],
                         bool(md.get(p + "expert_weights_norm", True))))
