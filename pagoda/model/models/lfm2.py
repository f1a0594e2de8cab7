"""LFM2 (Liquid AI): a hybrid. Most layers are gated short convolutions, the rest GQA
attention with per-head q/k norms; both are followed by a SwiGLU MLP, pre-norm.

A convolution layer computes ``B, C, x = in_proj(h)``, a depthwise causal convolution of
width L over ``B * x`` along the sequence, then ``out_proj(C * conv)``. What a request
carries from one step to the next is its last L - 1 inputs ``B * x`` per channel: a state
of fixed size ([hidden, L - 1]) in a slot of the runner's state pool
(pagoda/core/state_pool.py), not KV blocks. A prompt chunk starting at position 0
starts from zeros (the convolution's causal padding); a later chunk or a decode step from
the slot's state, which it then updates in place. With prefix caching, the state at the end
of every KV block a step crosses is kept beside the block, and a request whose prefix hit
ends at that block starts from it (pagoda/attention/state.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention import AttentionMetadata
from pagoda.attention.state import StateCache, StepStates
from pagoda.model.arch import ModelArchConfig, moe_fields
from pagoda.model.layers.decoder import CausalLM
from pagoda.model.layers.hybrid import HybridDecoderLayer, processing_order, renamed, sequence_spans
from pagoda.model.models import UnsupportedModelError

# HF checkpoint name parts -> this model's (the shared layers' names), in order.
_RENAMES = (
    (".feed_forward.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."),
    (".mlp.expert_bias", ".mlp.score_bias"),   # LFM2-MoE: the bias that chooses experts, not weighs them
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."), (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".operator_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
    (".conv.conv.weight", ".conv.conv_weight"), (".conv.conv.bias", ".conv.conv_bias"),
    ("model.embedding_norm.", "model.norm."),
)  # fmt: skip


class ShortConv(nn.Module):
    """The gated short convolution of one LFM2 layer."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        h, self.kernel = config.hidden_size, config.conv_kernel
        self.hidden_size = h
        self.in_proj = nn.Linear(h, 3 * h, bias=config.conv_bias)
        self.out_proj = nn.Linear(h, h, bias=config.conv_bias)
        self.conv_weight = nn.Parameter(torch.empty(h, self.kernel), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.zeros(h), requires_grad=False) if config.conv_bias else None

    def forward(self, x: torch.Tensor, cache: StateCache, meta: AttentionMetadata) -> torch.Tensor:
        b, c, v = self.in_proj(x).split(self.hidden_size, dim=-1)
        u = b * v                                   # [T, hidden]: the convolution's input
        out = torch.empty_like(u)
        plan: StepStates = meta.states
        weight = self.conv_weight.to(u.dtype)
        keep = self.kernel - 1
        d = meta.num_decodes
        spans = sequence_spans(meta)
        order = processing_order(plan)
        decodes = [i for i in order if i < d and plan.restore[i] < 0]   # batched: one token each
        if decodes:
            # One token each: the state's L - 1 inputs and this one, times the kernel.
            index = torch.tensor([plan.slots[i] for i in decodes], dtype=torch.long, device=u.device)
            rows = torch.tensor(decodes, dtype=torch.long, device=u.device)
            window = torch.cat((cache.slots.index_select(0, index).to(u.dtype), u[rows, :, None]), dim=-1)   # [D, h, L]
            y = (window * weight).sum(-1)
            out[rows] = y if self.conv_bias is None else y + self.conv_bias
            cache.slots.index_copy_(0, index, window[:, :, 1:].to(cache.slots.dtype))
            for j, i in enumerate(decodes):
                for offset, block in plan.checkpoints[i]:
                    cache.blocks[block] = window[j, :, offset:offset + keep].to(cache.blocks.dtype)
        for i in [i for i in order if i not in decodes]:
            a, n, context = spans[i]
            slot = plan.slots[i]
            if plan.restore[i] >= 0:
                cache.slots[slot] = cache.blocks[plan.restore[i]]
            before = cache.slots[slot].to(u.dtype) if context else u.new_zeros(self.hidden_size, keep)
            window = torch.cat((before, u[a:a + n].t()), dim=-1)          # [h, L - 1 + n]
            out[a:a + n] = F.conv1d(window[None], weight[:, None, :], self.conv_bias, groups=self.hidden_size)[0].t()
            cache.slots[slot] = window[:, -keep:].to(cache.slots.dtype)
            for offset, block in plan.checkpoints[i]:
                cache.blocks[block] = window[:, offset:offset + keep].to(cache.blocks.dtype)
        return self.out_proj(c * out)


class Lfm2DecoderLayer(HybridDecoderLayer):
    mixer_name = "conv"

    def __init__(self, config: ModelArchConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx, ShortConv(config) if config.is_conv_layer(layer_idx) else None)


class Lfm2ForCausalLM(CausalLM):
    layer_cls = Lfm2DecoderLayer
    # Not yet: adapters on the convolutions' projections. (Under tensor parallelism a rank
    # convolves its share of the channels: pagoda/model/layers/parallel.py.)
    lora = False

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        n = config["num_hidden_layers"]
        layer_types = config.get("layer_types")
        if layer_types is None:
            full = set(config.get("full_attn_idxs") or ())
            layer_types = ["full_attention" if i in full else "conv" for i in range(n)]
        unknown = set(layer_types) - {"conv", "full_attention"}
        if unknown:
            raise UnsupportedModelError(f"LFM2 layer types {sorted(unknown)} are not supported")
        intermediate = config.get("block_ff_dim", config["intermediate_size"])
        if config.get("block_auto_adjust_ff_dim", False):
            intermediate = int(2 * intermediate / 3)
            multiplier = config.get("block_ffn_dim_multiplier")
            if multiplier is not None:
                intermediate = int(multiplier * intermediate)
                step = config.get("block_multiple_of", 256)
                intermediate = step * ((intermediate + step - 1) // step)
        fields = {**config, "intermediate_size": intermediate, "rms_norm_eps": config.get("norm_eps", 1e-5),
                  "tie_word_embeddings": config.get("tie_embedding", config.get("tie_word_embeddings", True)),
                  "layer_types": None, "sliding_window": None}
        return ModelArchConfig(**{**ModelArchConfig.hf_fields(fields, architecture), "qk_norm": "head",
                                  "conv_layers": tuple(t == "conv" for t in layer_types),
                                  "conv_kernel": config.get("conv_L_cache", 3),
                                  "conv_bias": bool(config.get("conv_bias", False))})

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        """llama.cpp's ``lfm2`` files: ``attention.head_count_kv`` per layer, 0 for the
        convolution layers; ``shortconv.l_cache`` the kernel width."""
        p = f"{md['general.architecture']}."
        kv = md[p + "attention.head_count_kv"]
        n = md[p + "block_count"]
        per_layer = list(kv) if isinstance(kv, (list, tuple)) else [kv] * n
        attention = [int(k) for k in per_layer if int(k)]
        if len(per_layer) != n or len(set(attention)) != 1:
            raise UnsupportedModelError(f"LFM2 GGUF: head_count_kv {per_layer} for {n} layers")
        fields = ModelArchConfig.gguf_fields({**md, p + "attention.head_count_kv": attention[0]}, tensor_names,
                                             architecture)
        return ModelArchConfig(**{**fields, "qk_norm": "head", "conv_layers": tuple(int(k) == 0 for k in per_layer),
                                  "conv_kernel": int(md[p + "shortconv.l_cache"]),
                                  "conv_bias": "blk.0.shortconv.in_proj.bias" in tensor_names})

    @classmethod
    def gguf_lookup_name(cls, name: str) -> str:
        return name.replace("model.norm.", "model.embedding_norm.").replace(".conv.conv_weight", ".conv.conv.weight")

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        return renamed(name, _RENAMES)

    @classmethod
    def hf_tensor(cls, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(".conv.conv.weight"):   # [hidden, 1, L] -> [hidden, L]
            return tensor.reshape(tensor.shape[0], -1)
        return tensor

    def state_shapes(self) -> list[tuple[int, ...] | None]:
        # (A layer's channels: a tensor-parallel rank's share.)
        return [(layer.conv.hidden_size, layer.conv.kernel - 1) if getattr(layer, "conv", None) is not None else None
                for layer in self.model.layers]


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE: LFM2's layers, the MLP of every layer from ``num_dense_layers`` on replaced by
    experts chosen by sigmoid scores plus a per-expert bias (``expert_bias``: it chooses,
    it does not weigh), their weights renormalised and scaled."""

    unquantized_modules = (".mlp.gate",)

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        """llama.cpp's ``lfm2moe`` files: LFM2's keys, ``leading_dense_block_count`` dense
        layers first, then experts of ``expert_feed_forward_length`` (a key or one per layer)
        scored by ``expert_gating_func``, chosen with the bias ``blk.N.exp_probs_b.bias``, their
        weights renormalised and not scaled (llama.cpp reads neither ``expert_weights_norm``
        nor ``expert_weights_scale`` for this architecture: its converter writes neither)."""
        import dataclasses

        p = f"{md['general.architecture']}."
        arch = super().arch_from_gguf(md, tensor_names, architecture)
        n, dense = arch.num_hidden_layers, int(md.get(p + "leading_dense_block_count") or 0)
        moe = tuple(i >= dense for i in range(n))
        width = md[p + "expert_feed_forward_length"]
        widths = {int(w) for w, m in zip(width, moe) if m} if isinstance(width, (list, tuple)) else {int(width)}
        if len(widths) != 1:
            raise UnsupportedModelError(f"LFM2-MoE GGUF: expert_feed_forward_length {width} (one width only)")
        gating = int(md.get(p + "expert_gating_func", 2))
        scoring = {1: "softmax", 2: "sigmoid"}.get(gating)
        if scoring is None:
            raise UnsupportedModelError(f"LFM2-MoE GGUF: expert_gating_func {gating} is not supported")
        return dataclasses.replace(
            arch, moe_layers=moe, expert_scoring=scoring,
            expert_score_bias=f"blk.{dense}.exp_probs_b.bias" in tensor_names, routed_scaling_factor=1.0,
            **moe_fields(int(md[p + "expert_count"]), int(md[p + "expert_used_count"]), widths.pop(), True))

    @classmethod
    def gguf_lookup_name(cls, name: str) -> str:
        # The bias llama.cpp's converter renames expert_bias.bias (its exp_probs_b.bias).
        return super().gguf_lookup_name(name.replace(".mlp.score_bias", ".feed_forward.expert_bias.bias"))

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        import dataclasses

        arch = super().arch_from_hf(config, architecture)
        n, dense = arch.num_hidden_layers, config.get("num_dense_layers", 0)
        return dataclasses.replace(
            arch, moe_layers=tuple(i >= dense for i in range(n)), expert_scoring="sigmoid",
            expert_score_bias=bool(config.get("use_expert_bias", True)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            **moe_fields(config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"],
                         bool(config.get("norm_topk_prob", True))))
