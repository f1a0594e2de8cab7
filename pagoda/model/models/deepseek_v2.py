"""DeepSeek-V2 (V2-Lite, V2, V2.5): multi-head latent attention (MLA) and fine-grained
experts with shared ones.

**MLA.** Keys and values come from one compressed latent per token (``kv_lora_rank``,
normed) through ``kv_b_proj``, plus a rotary key (``qk_rope_head_dim``) shared by every
head. The cache keeps only [latent | rotated key] per token: one "KV head" of
kv_lora_rank + qk_rope_head_dim (576 for the real models, against 2 x heads x 128 for
their MHA equivalent). Attention runs on it directly ("absorbed" MLA): each head's
query is taken into latent space through its key block of ``kv_b_proj`` (q_nope . W_uk k =
(W_uk^T q_nope) . latent), attends over [latent | rope key] as one grouped-query head,
and its latent output goes back through its value block (W_uv). The same numbers as
transformers' decompressed keys and values, up to float32 rounding; the paged cache,
its kernels, prefix caching and preemption serve it as any single-KV-head layer (the
cache's V half holds the same vector as K: simple, at twice the latent's bytes).

RoPE: transformers rotates DeepSeek's rope dimensions as interleaved pairs; pagoda takes
them de-interleaved (even dimensions, then odd) and rotates halves: a permutation applied
to queries and keys alike, so every dot product is the same.

**Experts.** The first ``first_k_dense_replace`` layers are dense; the others route each
token to ``num_experts_per_tok`` of ``n_routed_experts`` (softmax, greedy or limited to
the best ``topk_group`` of ``n_group`` groups), weights x ``routed_scaling_factor``, and
add ``n_shared_experts`` experts every token takes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import nn

from pagoda.attention import AttentionMetadata, paged_attention
from pagoda.model.arch import ModelArchConfig, UnsupportedModelError, moe_fields
from pagoda.model.layers.decoder import CausalLM, DecoderLayer
from pagoda.model.layers.norm import RMSNorm
from pagoda.model.layers.rotary import apply_rope, rope_kind, yarn_mscale


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., 2n] pairs (x0, x1), (x2, x3), ... -> [x0, x2, ..., x1, x3, ...]."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    """Multi-head latent attention, absorbed: see the module's docstring."""

    def __init__(self, config: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.rank, self.rope = config.kv_lora_rank, config.rotary_dim
        self.nope, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        # What the cache holds per token: one head of [latent | rotary key].
        self.num_kv_heads, self.head_dim = 1, self.rank + self.rope
        self.q_lora_rank = config.q_lora_rank
        q_out = self.num_heads * (self.nope + self.rope)
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)   # transformers' default eps
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=config.attention_bias)
        self.scale = config.attention_multiplier
        self.window = config.sliding_window_of(layer_idx)
        self.rope_table = config.rope_table_of(layer_idx)
        self.interleaved = config.mla_rope_interleaved
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk [heads, nope, rank], W_uv [heads, v, rank]) from kv_b_proj, once (it stays
        unquantized in every mode: ``unquantized_modules``)."""
        if self._absorbed is None:
            proj = self.kv_b_proj
            w = proj.weight if isinstance(proj, nn.Linear) else proj.dequantized()
            w = w.float().view(self.num_heads, self.nope + self.v_dim, self.rank)
            self._absorbed = (w[:, :self.nope].contiguous(), w[:, self.nope:].contiguous())
        return self._absorbed

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        t = x.shape[0]
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        if self.interleaved:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe = apply_rope(q_pe, cos, sin)
        k_pe = apply_rope(k_pe[:, None, :], cos, sin)
        w_uk, w_uv = self.absorbed()
        # Each head's query in latent space: [H, T, nope] @ [H, nope, rank] -> [T, H, rank].
        q_lat = torch.bmm(q_nope.transpose(0, 1).to(w_uk.dtype), w_uk).transpose(0, 1).to(q.dtype)
        queries = torch.cat((q_lat, q_pe), dim=-1)
        kv = torch.cat((latent[:, None, :], k_pe.to(latent.dtype)), dim=-1)
        o = paged_attention(queries.contiguous(), kv, kv, kv_cache, meta, self.scale, window=self.window)
        # Each head's latent output through its value block: [H, T, rank] @ [H, rank, v].
        out = torch.bmm(o[..., :self.rank].transpose(0, 1).to(w_uv.dtype), w_uv.transpose(1, 2))
        return self.o_proj(out.transpose(0, 1).reshape(t, -1).to(x.dtype))


class DeepseekV2DecoderLayer(DecoderLayer):
    attention_cls = MLAttention


class DeepseekV2ForCausalLM(CausalLM):
    # Only the MLP's gate and up are stacked (MLA's projections are its own).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up_proj": ("gate_proj", "up_proj")}
    # The routers stay float32; kv_b_proj is read as a matrix (the absorbed attention).
    unquantized_modules = (".mlp.gate", ".kv_b_proj")
    # MLA's heads and the shared experts are not sharded yet.
    tensor_parallel = False
    # LoRA's projections (qkv_proj, ...) are not MLA's.
    lora = False
    layer_cls = DeepseekV2DecoderLayer

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        fields = ModelArchConfig.hf_fields(config, architecture)
        method = config.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedModelError(f"DeepSeek routing {method!r} is not supported (greedy, group_limited_greedy)")
        if config.get("scoring_func", "softmax") != "softmax":
            raise UnsupportedModelError(f"DeepSeek expert scoring {config['scoring_func']!r} is not supported")
        rope, nope = config["qk_rope_head_dim"], config["qk_nope_head_dim"]
        rank = config["kv_lora_rank"]
        scale = (nope + rope) ** -0.5
        scaling = fields["rope_scaling"]
        if rope_kind(scaling) == "yarn" and scaling.get("mscale_all_dim"):
            # transformers: the softmax scale takes YaRN's temperature squared.
            scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
        layers = fields["num_hidden_layers"]
        first_dense = config.get("first_k_dense_replace", 0)
        groups = (config["n_group"], config["topk_group"]) if method == "group_limited_greedy" else None
        fields.update(head_dim=rank + rope, num_key_value_heads=1)
        return ModelArchConfig(
            **fields, rotary_dim=rope, kv_lora_rank=rank, q_lora_rank=config.get("q_lora_rank"),
            qk_nope_head_dim=nope, v_head_dim=config["v_head_dim"], attention_multiplier=scale,
            moe_layers=tuple(i >= first_dense for i in range(layers)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            num_shared_experts=config.get("n_shared_experts") or 0, expert_groups=groups,
            **moe_fields(config["n_routed_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"],
                         bool(config.get("norm_topk_prob", False))))  # fmt: skip


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 (and Kimi K2's layout): V2's latent attention and shared experts; the
    router scores by sigmoid, chooses with a per-expert bias (``e_score_correction_bias``)
    among the groups whose best two experts score highest, weighs by the unbiased scores
    (renormalised), x ``routed_scaling_factor``."""

    @classmethod
    def hf_name(cls, name: str) -> str:
        return name.replace(".mlp.gate.e_score_correction_bias", ".mlp.score_bias")

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        method = config.get("topk_method") or "noaux_tc"
        if method != "noaux_tc":
            raise UnsupportedModelError(f"DeepSeek-V3 routing {method!r} is not supported (noaux_tc)")
        v2 = dict(config, topk_method="greedy", scoring_func="softmax",
                  n_routed_experts=config.get("n_routed_experts") or config["num_local_experts"])
        arch = super().arch_from_hf(v2, architecture)
        groups = config.get("n_group") or 1
        return replace(arch, expert_scoring="sigmoid", expert_score_bias=True, expert_group_score="top2",
                       expert_groups=(groups, config.get("topk_group") or groups),
                       norm_topk_prob=bool(config.get("norm_topk_prob", True)),
                       mla_rope_interleaved=bool(config.get("rope_interleave", True)))


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: V3 with DeepSeek Sparse Attention, a lightning indexer choosing the
    ``index_topk`` cached keys each query attends to. Up to that many keys it chooses every
    one, so attention is V3's exactly: the model is served up to ``index_topk`` tokens of
    context (2048 in the published checkpoints; a longer max_model_len is refused) and its
    indexer's weights are not read. Longer contexts need the indexer itself: not yet."""

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        return None if ".self_attn.indexer." in name else super().hf_name(name)

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        arch = super().arch_from_hf(config, architecture)
        return replace(arch, context_limit=int(config.get("index_topk", 2048)))
