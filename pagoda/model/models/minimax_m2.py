"""MiniMax-M2 (``MiniMaxM2ForCausalLM``): GQA attention with RMSNorms over the whole q and k
projections (across heads, before RoPE: ``qk_norm="full"``; under tensor parallelism the
mean square comes from every rank's sums), RoPE on the first ``rotary_dim`` dimensions of
each head (partial rotary), and experts in every layer: a sigmoid router whose per-expert
bias (``e_score_correction_bias``) chooses the top ``num_experts_per_tok`` but does not weigh
them, their scores renormalised; no shared experts, no routed scaling. Checkpoints name the
block ``block_sparse_moe`` and an expert's projections w1 (gate), w3 (up), w2 (down), as
Mixtral's. llama.cpp's ``minimax-m2`` files keep Q/K rows in HF's order, the rotary width as
``rope.dimension_count``, the bias as ``exp_probs_b``, ``expert_gating_func`` sigmoid.

Refused: a window (transformers' MiniMax-M2 attends over the whole context), linear-attention
layers (``attn_type_list`` with 0: MiniMax-01's), another ``scoring_func``, q/k norms off or
not ``per_layer``, shared experts (``shared_intermediate_size``), a ``routed_scaling_factor``."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig, UnsupportedModelError, gguf_moe_layers, moe_fields
from pagoda.model.layers.decoder import CausalLM
from pagoda.model.models.mixtral import block_sparse_moe_name



def _refuse(config: dict[str, Any]) -> None:
    checks = (
        ("scoring_func", lambda v: v not in (None, "sigmoid")),
        ("use_qk_norm", lambda v: v is not None and not v),
        ("qk_norm_type", lambda v: v not in (None, "per_layer")),
        ("shared_intermediate_size", lambda v: bool(v)),
        ("n_shared_experts", lambda v: bool(v)),
        ("routed_scaling_factor", lambda v: v not in (None, 1, 1.0)),
        ("attn_type_list", lambda v: v is not None and any(t != 1 for t in v)),
        ("sliding_window", lambda v: bool(v)),
    )
    for key, refused in checks:
        if refused(config.get(key)):
            raise UnsupportedModelError(f"MiniMax-M2 with {key}={config[key]!r} is not supported")


class MiniMaxM2ForCausalLM(CausalLM):
    unquantized_modules = (".mlp.gate",)

    @classmethod
    def hf_name(cls, name: str) -> str:
        # Mixtral's expert names; the router's choice bias as the model's score_bias.
        return block_sparse_moe_name(name.replace(".block_sparse_moe.e_score_correction_bias", ".mlp.score_bias"))

    @classmethod
    def gguf_lookup_name(cls, name: str) -> str:
        # (llama.cpp's converter: "e_score_correction.bias", its exp_probs_b.bias)
        return name.replace(".mlp.score_bias", ".block_sparse_moe.e_score_correction.bias")

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        _refuse(config)
        fields = ModelArchConfig.hf_fields(config, architecture)
        head_dim = fields["head_dim"]
        rope = config.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor") or config.get("partial_rotary_factor")
        if partial is None:   # the released checkpoints' legacy rotary_dim
            partial = config["rotary_dim"] / head_dim if config.get("rotary_dim") else 1.0
        rotary = int(head_dim * partial)
        return ModelArchConfig(
            **fields, qk_norm="full", rotary_dim=None if rotary == head_dim else rotary,
            expert_scoring="sigmoid", expert_score_bias=bool(config.get("use_routing_bias", True)),
            **moe_fields(config.get("num_local_experts") or config["num_experts"], config["num_experts_per_tok"],
                         fields["intermediate_size"], True))

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        p = f"{md['general.architecture']}."
        if int(md.get(p + "expert_gating_func", 2)) != 2:
            raise UnsupportedModelError("MiniMax-M2 GGUF: only sigmoid expert gating (expert_gating_func 2) "
                                        "is supported")
        if float(md.get(p + "expert_weights_scale") or 1.0) != 1.0 or md.get(p + "expert_shared_count"):
            raise UnsupportedModelError("MiniMax-M2 GGUF with scaled expert weights or shared experts "
                                        "is not supported")
        if "blk.0.attn_q_norm.weight" not in tensor_names:
            raise UnsupportedModelError("MiniMax-M2 GGUF without q/k norms is not supported")
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        n, head_dim = fields["num_hidden_layers"], fields["head_dim"]
        rotary = int(md.get(p + "rope.dimension_count") or head_dim)
        moe = gguf_moe_layers(tensor_names, n)
        first = next((i for i in range(n) if moe is None or moe[i]), 0)
        return ModelArchConfig(
            **fields, qk_norm="full", rotary_dim=None if rotary == head_dim else rotary, moe_layers=moe,
            expert_scoring="sigmoid", expert_score_bias=f"blk.{first}.exp_probs_b.bias" in tensor_names,
            **moe_fields(md[p + "expert_count"], md[p + "expert_used_count"], md[p + "expert_feed_forward_length"],
                         True))
