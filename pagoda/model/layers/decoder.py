"""The decoder-only transformer that every family assembles: GQA attention (optional q/k
norms, RoPE or none, a fixed or configured scale), a gated MLP, pre- or post-norm blocks,
and the causal-LM wrapper with the declarations the loader, tensor parallelism, LoRA and
the runner read (``CausalLM``). A family (``pagoda/model/models/<family>.py``) subclasses
``CausalLM``: its config parsing, its weight names, and any layer it changes.

Parameter names follow Hugging Face's, except that q/k/v and gate/up are stacked into one
projection each (one GEMM instead of three or two; ``packed_modules_mapping``); the loader
maps the checkpoint's separate tensors into their row ranges. The model takes a flat batch
of tokens from many requests plus the attention metadata for this step; it knows nothing
of scheduling or parallelism.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.attention import AttentionMetadata, kernel_cache, paged_attention, rope_writes_kv
from pagoda.model.arch import ModelArchConfig, UnsupportedModelError
from pagoda.model.layers.expert_parallel import dispatch_combine
from pagoda.model.layers.norm import RMSNorm, UnitRMSNorm, fused_ops
from pagoda.model.layers.pipeline import MissingLayer
from pagoda.model.layers.rotary import (
    apply_rope,
    longrope_tables,
    mrope_axes,
    mrope_cos_sin,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
    rope_kind,
)
from pagoda.ops import cpu_kernels


@dataclass(frozen=True)
class KVSpec:
    """What one layer keeps in the KV cache."""

    num_kv_heads: int          # this process's share under tensor parallelism
    head_dim: int
    sliding_window: int | None = None


class Attention(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.kv_heads_of(layer_idx)
        self.head_dim = config.head_dim_of(layer_idx)
        h = config.hidden_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Qwen3-Next / Qwen3.5: q_proj's rows hold, per head, the query then a gate of the
        # head's output (o * sigmoid(gate)).
        self.output_gate = config.attn_output_gate
        self.q_rows = self.q_size * (2 if self.output_gate else 1)
        # KV shared across layers (Gemma 4 E2B / E4B): a layer that reads an earlier layer's cache
        # (kv_source) computes only its queries; that layer hands it the step's keys and values
        # (kv_share, a dict the model gives every layer; stores_kv on the layers read).
        self.layer_idx = layer_idx
        self.kv_source = config.kv_source[layer_idx] if config.kv_source is not None else None
        self.stores_kv = config.kv_source is not None and layer_idx in config.kv_source
        self.kv_share: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        if self.kv_source is not None:
            self.q_proj = nn.Linear(h, self.q_rows, bias=config.attention_bias)
        else:
            # q, k and v in one GEMM (the loader fills the three row ranges).
            self.qkv_proj = nn.Linear(h, self.q_rows + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=config.o_proj_bias)
        # GPT-OSS: per query head, a logit in every softmax's denominator (no value).
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False) if config.attention_sinks else None
        self.scale = config.attention_multiplier if config.attention_multiplier is not None else self.head_dim ** -0.5
        self.rotary_dim = config.rotary_dim or self.head_dim
        self.rope_table = config.rope_table_of(layer_idx)
        self.window = config.sliding_window_of(layer_idx)
        self.softcap = config.attn_logit_softcapping
        # q/k RMSNorm before RoPE: per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2);
        # on some layers only, and without weights (Llama 4: a weightless per-head norm commutes
        # with RoPE, a rotation of each pair, so before it is as after it).
        self.qk_norm = config.qk_norm if config.has_qk_norm(layer_idx) else None
        norm_cls = RMSNorm if config.qk_norm_weights else UnitRMSNorm
        if self.qk_norm == "head":
            self.q_norm = norm_cls(self.head_dim, config.rms_norm_eps)
            if self.kv_source is None:
                self.k_norm = norm_cls(self.head_dim, config.rms_norm_eps)
        elif self.qk_norm == "full":
            self.q_norm = norm_cls(self.q_size, config.rms_norm_eps)
            self.k_norm = norm_cls(self.kv_size, config.rms_norm_eps)
        # Gemma 4: values RMS-normed per head, no weight.
        self.v_norm = UnitRMSNorm(self.head_dim, config.rms_norm_eps) if config.v_norm else None
        # Tensor parallelism with whole-width q/k norms: the ranks' sums of squares (ShardPlan.apply).
        self.qk_comm = None
        # HunYuan: the per-head q/k norms apply to the rotated heads (after RoPE, not before).
        self.norm_after_rope = config.qk_norm_after_rope and self.qk_norm is not None

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "head":
            q = self.q_norm.rows(q.reshape(t, self.num_heads, self.head_dim)).reshape(t, -1)
            k = self.k_norm.rows(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, -1)
        elif self.qk_comm is not None:
            q, k = self._sharded_norm(q, self.q_norm), self._sharded_norm(k, self.k_norm)
        else:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        return torch.cat((q, k, v), dim=-1)

    def _sharded_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """A whole-width RMSNorm of a projection split over ranks: the mean square from
        every rank's sum of squares and width (a KV head held by several ranks counts in
        both as often, so the mean stays its own)."""
        x32 = x.float()
        stats = torch.cat((x32.pow(2).sum(-1, keepdim=True), torch.full_like(x32[:, :1], x.shape[-1])), dim=-1)
        stats = self.qk_comm.all_reduce(stats)
        return norm.weight * (x32 * torch.rsqrt(stats[:, :1] / stats[:, 1:] + norm.eps)).to(x.dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,      # [T, 1, D]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.kv_source is not None:
            return self._forward_reading(x, cos, sin, kv_cache, meta)
        qkv = self.qkv_proj(x)
        gate = None
        if self.output_gate:
            q_gate, kv = qkv.split([self.q_rows, 2 * self.kv_size], dim=-1)
            q, gate = q_gate.view(t, self.num_heads, 2, self.head_dim).unbind(2)
            qkv = torch.cat((q.reshape(t, -1), kv), dim=-1)
        if self.qk_norm is not None and not self.norm_after_rope:
            qkv = self._norm_qk(qkv)
        if self.v_norm is not None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            v = self.v_norm.rows(v.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, -1)
            qkv = torch.cat((q, k, v), dim=-1)
        ops = fused_ops(qkv)
        # (partial rotary, and queries scaled per position: the torch path)
        if ops is not None and self.rotary_dim == self.head_dim and self.rope_table != "tuned":
            # One op: rotary q and k, and (a cache the kernels write, where the step's attention
            # backend lets them) k and v into their slots.
            # (Norms after RoPE: the rotated keys are normed before they are cached.)
            writes = rope_writes_kv(meta) and not self.norm_after_rope
            cache, scales = (kernel_cache(kv_cache) if writes else None) or (None, None)
            in_place = cache is not None
            q, k, v = ops.rope_qkv(qkv, cos.view(t, -1), sin.view(t, -1), self.num_heads, self.num_kv_heads,
                                   cache, meta.slot_mapping if in_place else None, scales)
            if self.norm_after_rope:
                q, k = self.q_norm.rows(q), self.k_norm.rows(k)
            if self.stores_kv:
                self.kv_share[self.layer_idx] = (k, v)
            o = paged_attention(q, k, v, kv_cache, meta, self.scale, kv_written=in_place, window=self.window,
                                softcap=self.softcap, sinks=self.sinks)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(t, self.num_heads, self.head_dim)
            k = k.reshape(t, self.num_kv_heads, self.head_dim)
            if self.rope_table == "tuned":   # no RoPE; cos: each token's query scale [T, 1, 1]
                q = (q.float() * cos).to(q.dtype)
            elif self.rope_table != "none":
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if self.norm_after_rope:
                q, k = self.q_norm.rows(q), self.k_norm.rows(k)
            v = v.reshape(t, self.num_kv_heads, self.head_dim)
            if self.stores_kv:
                self.kv_share[self.layer_idx] = (k, v)
            o = paged_attention(q, k, v, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap,
                                sinks=self.sinks)
        o = o.reshape(t, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(o)

    def _forward_reading(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                         meta: AttentionMetadata) -> torch.Tensor:
        """A layer reading another's KV cache: its queries over that layer's keys and values
        (written already this step, by that earlier layer)."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        if self.qk_norm is not None:
            q = self.q_norm.rows(q)
        if self.rope_table == "tuned":
            q = (q.float() * cos).to(q.dtype)
        elif self.rope_table != "none":
            q = apply_rope(q, cos, sin)
        k, v = self.kv_share[self.kv_source]
        o = paged_attention(q.contiguous(), k, v, kv_cache, meta, self.scale, kv_written=True, window=self.window,
                            softcap=self.softcap, sinks=self.sinks)
        return self.o_proj(o.reshape(t, -1))


class GatedMLP(nn.Module):
    # The C++ kernels' codes of the activations (gated_activation in pagoda/csrc): the
    # decode stack and the one-call MoE kernel compute these with the module's own ops.
    KERNEL_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "swiglu_oai": 2}

    def __init__(self, config: ModelArchConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        h, i = config.hidden_size, intermediate_size or config.intermediate_size
        self.intermediate_size = i
        # gate and up in one GEMM (rows [0, i) and [i, 2i)).
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias)
        self.act = config.hidden_act
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha

    def kernel_activation(self, ops: Any) -> int | None:
        """This MLP's activation as the C++ kernels' code, or None where they do not
        compute it (GPT-OSS's clamped SwiGLU at another limit or alpha than theirs)."""
        if self.act == "swiglu_oai" and (self.limit, self.alpha) != tuple(ops.SWIGLU_OAI):
            return None
        return self.KERNEL_ACTIVATIONS.get(self.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        if self.act == "gelu_pytorch_tanh":
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if self.act == "swiglu_oai":
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))
        ops = fused_ops(gate_up)
        if ops is not None and gate_up.dim() == 2 and gate_up.shape[1] % 64 == 0:
            # One pass, the same bits as the line below (torch's own SLEEF exp).
            return self.down_proj(ops.silu_mul(gate_up.contiguous()))
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    """Mixture of experts: a router (``gate``) scores every expert per token; the top
    ``num_experts_per_tok`` by softmax probability (renormalised to sum 1 when
    ``norm_topk_prob``) weigh their experts' outputs. Tokens are grouped by expert: one
    product per active expert over its tokens, the weighted outputs added in expert order
    (transformers' order, so its float32 sums are matched)."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.norm_topk_min = config.norm_topk_min   # ERNIE 4.5: the renormalising sum's floor
        self.weights_on_input = config.expert_weights_on_input
        self.scaling = config.routed_scaling_factor
        self.groups, self.group_score = config.expert_groups, config.expert_group_score
        self.sigmoid = config.expert_scoring == "sigmoid"
        # DeepSeek-V3: a per-expert bias on the scores that choose (not on the weights).
        self.score_bias = (nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
                           if config.expert_score_bias else None)  # fmt: skip
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=config.router_bias)
        self.experts = nn.ModuleList(GatedMLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        # DeepSeek: experts every token goes through (one MLP of their combined width).
        shared = config.shared_expert_intermediate_size or config.moe_intermediate_size * config.num_shared_experts
        self.shared_experts = GatedMLP(config, shared) if config.num_shared_experts else None
        # Qwen3-Next / Qwen3.5: the shared expert's output x sigmoid(a per-token gate).
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if config.shared_expert_gate else None
        self._fused: tuple | bool | None = None   # the gguf mode's one-call arguments, found on first use
        # Expert parallelism (ShardPlan.apply): the experts this rank holds, and its group.
        self.local_experts = range(config.num_experts)
        self.comm = None
        # Expert parallelism across data-parallel replicas (expert_parallel.shard_experts):
        # the replicas' exchange group; tokens go to their experts' replicas and back.
        self.ep = None
        # Tokens routed to each expert since start (top-k picks), for /metrics.
        self.expert_tokens: torch.Tensor | None = None

    def _fused_args(self) -> tuple | bool:
        """(kernel, gate/up parts, their types, down parts, their types, activation (the
        kernels' code: GatedMLP.kernel_activation), gate/up biases, down biases (one per
        expert, or none)) when every expert's weights are kept as blocks (GGUF, or an HF
        checkpoint's bfloat16/float16): one kernel call then runs the layer,
        ``gguf_moe_int8`` in the gguf mode (int8 activations), ``gguf_moe`` in the exact
        mode, the same numbers as the per-expert path. False otherwise (nn.Linear experts,
        int8 / q4 / bf16 modes)."""
        if self._fused is None:
            from pagoda.model.layers.blocks import BlocksLinear

            layers = [(e.gate_up_proj, e.down_proj) for e in self.experts]
            modules = [m for pair in layers for m in pair]
            ops = cpu_kernels.kernels()
            activation = None if ops is None else self.experts[0].kernel_activation(ops)
            biased = {m.bias is not None for m in modules}   # every expert's (GPT-OSS) or none
            ok = (activation is not None and len({(e.act, e.limit, e.alpha) for e in self.experts}) == 1
                  and all(isinstance(m, BlocksLinear) for m in modules) and len(biased) == 1
                  and all(len(g.parts) == 2 and len(d.parts) == 1 for g, d in layers)
                  and not any(m.permutes_inputs for m in modules)   # GPTQ act-order: per expert
                  and len({m.int8_activations for m in modules}) == 1)
            self._fused = (
                ops.gguf_moe_int8 if modules[0].int8_activations else ops.gguf_moe,
                [p.data for g, _ in layers for p in g.parts], [int(p.ggml_type) for g, _ in layers for p in g.parts],
                [d.parts[0].data for _, d in layers], [int(d.parts[0].ggml_type) for _, d in layers], activation,
                [g.bias for g, _ in layers] if True in biased else [],
                [d.bias for _, d in layers] if True in biased else [],
            ) if ok else False
        return self._fused

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k], picks per expert [E]) per step; the
        picks also add to the counts /metrics reports."""
        logits = self.gate(x).float()
        probs = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)
        choice = probs if self.score_bias is None else probs + self.score_bias.float()
        if self.groups is not None:
            # Only the experts of the kept groups: those whose best expert (or best two)
            # score highest; the others cannot be chosen.
            groups, kept = self.groups
            by_group = choice.view(choice.shape[0], groups, -1)
            rank = by_group.amax(dim=-1) if self.group_score == "max" else by_group.topk(2, dim=-1).values.sum(-1)
            best = torch.topk(rank, kept, dim=-1).indices
            keep = torch.zeros(choice.shape[0], groups, 1, dtype=torch.bool, device=choice.device)
            keep.scatter_(1, best[..., None], True)
            choice = by_group.masked_fill(~keep, float("-inf")).view(choice.shape[0], -1)
        if choice is probs:
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
        else:   # a bias or a group mask chose: the weights are the plain probabilities
            ids = torch.topk(choice, self.top_k, dim=-1).indices
            weights = probs.gather(1, ids)
        if self.norm_topk_prob:
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total.clamp(min=self.norm_topk_min) if self.norm_topk_min else total)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        picks = torch.bincount(ids.flatten(), minlength=self.num_experts)
        if self.expert_tokens is None:
            self.expert_tokens = picks.clone()
        else:
            self.expert_tokens.add_(picks)
        return weights, ids, picks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts_forward(x, *self.route(x))

    def experts_forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                        picks: torch.Tensor) -> torch.Tensor:
        """The experts' (and shared experts') output for ``x``, routed as ``route`` chose
        (on x itself, or where a family routes on another input: Gemma 4)."""
        weights = weights.to(x.dtype)
        routed_in = x
        if self.weights_on_input and self.top_k == 1:
            # One expert per token: its input scaled by its weight, its output taken whole.
            routed_in, weights = x * weights, torch.ones_like(weights)
        elif self.weights_on_input:
            if self.ep is not None:
                raise NotImplementedError("expert weights on the inputs of several experts per token under "
                                          "expert parallelism across replicas")
            out = self._experts_sum(x, weights, ids, picks)
            return self._add_shared(out if self.comm is None else self.comm.all_reduce(out), x)
        if self.ep is not None:
            return self._add_shared(dispatch_combine(routed_in, weights, ids, self.experts, self.num_experts, self.ep),
                                    x)
        if self.comm is None and x.dtype == torch.float32 and x.device.type == "cpu":
            fused = self._fused_args()
            if fused:
                kernel, *args = fused
                return self._add_shared(kernel(routed_in, ids, weights, *args), x)
        out = self._experts_sum(routed_in, weights, ids, picks)
        # Expert parallelism: this rank's experts' share, summed over ranks.
        return self._add_shared(out if self.comm is None else self.comm.all_reduce(out), x)

    def _add_shared(self, routed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum plus the shared experts' output (transformers' order)."""
        if self.shared_experts is None:
            return routed
        shared = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return routed + shared

    def _experts_sum(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     picks: torch.Tensor) -> torch.Tensor:
        """The weighted outputs of this process's experts (``local_experts``), added per
        token in expert order."""
        out = torch.zeros_like(x)
        local = self.local_experts
        if x.shape[0] == 1:
            # One token (a single-stream decode): its experts in index order, no grouping.
            for e, slot in sorted(zip(ids[0].tolist(), range(self.top_k))):
                if e in local:
                    w = weights[:, slot:slot + 1]
                    out += self.experts[e](x * w) if self.weights_on_input else self.experts[e](x) * w
            return out
        # The (token, slot) pairs grouped by expert once: a stable sort keeps each
        # expert's tokens in order.
        order = torch.argsort(ids.flatten(), stable=True)
        tokens_all, slots_all = order // self.top_k, order % self.top_k
        start = 0
        for e, n in enumerate(picks.tolist()):
            tokens, slot = tokens_all[start:start + n], slots_all[start:start + n]
            start += n
            if n and e in local:
                w = weights[tokens, slot, None]
                y = self.experts[e](x[tokens] * w) if self.weights_on_input else self.experts[e](x[tokens]) * w
                out.index_add_(0, tokens, y)
        return out


def split_stacked_experts(base: str, proj: str, tensor: torch.Tensor,
                          transposed: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """A layer's experts stacked in one checkpoint tensor (``gate_up_proj``: gate rows then
    up rows; ``down_proj``) as one Linear weight per expert, ``{base}.{e}.gate_proj.weight``
    etc. ``transposed``: stored [experts, in, out] (Llama 4), else [experts, out, in] (Gemma 4)."""
    for e in range(tensor.shape[0]):
        t = tensor[e].T if transposed else tensor[e]
        if proj == "down_proj":
            yield f"{base}.{e}.down_proj.weight", t.contiguous()
        else:
            gate, up = t.chunk(2, dim=0)
            yield f"{base}.{e}.gate_proj.weight", gate.contiguous()
            yield f"{base}.{e}.up_proj.weight", up.contiguous()


class DecoderLayer(nn.Module):
    """A transformer block. ``config.norm_placement``: "pre" (Llama: norm before attention
    and before the MLP), "post" (OLMo 2: norm of each block's output, before the add) or
    "sandwich" (Gemma: both).
    The residual stream is carried separately, so each "add, then norm" is one fused op:
    forward returns (this layer's output, the stream before it), their sum the stream."""

    # The attention block (DeepSeek's latent attention replaces it).
    attention_cls: ClassVar[type[nn.Module]] = Attention

    def __init__(self, config: ModelArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_idx)
        self.mlp = SparseMoeBlock(config) if config.is_moe_layer(layer_idx) else GatedMLP(config)
        self.post_norm = config.norm_placement == "post"
        self.sandwich = config.norm_placement == "sandwich"
        h, eps = config.hidden_size, config.rms_norm_eps
        if self.post_norm:
            self.post_attention_layernorm = RMSNorm(h, eps)
            self.post_feedforward_layernorm = RMSNorm(h, eps)
        elif self.sandwich:
            self.input_layernorm = RMSNorm(h, eps)
            self.post_attention_layernorm = RMSNorm(h, eps)
            self.pre_feedforward_layernorm = RMSNorm(h, eps)
            self.post_feedforward_layernorm = RMSNorm(h, eps)
        else:
            self.input_layernorm = RMSNorm(h, eps)
            self.post_attention_layernorm = RMSNorm(h, eps)
        self.residual_multiplier = config.residual_multiplier

    @property
    def rope_table(self) -> str:
        return self.self_attn.rope_table

    def input_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the input norm of the stream, the stream): x is the stream before the first
        layer, else the previous layer's output added to ``residual`` in place."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm(x, residual)

    def forward(self, x, residual, cos, sin, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        if self.post_norm:
            stream = x if residual is None else x + residual
            stream = stream + self.post_attention_layernorm(self.self_attn(stream, cos, sin, kv_cache, meta))
            return self.post_feedforward_layernorm(self.mlp(stream)), stream
        h, residual = self.input_norm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        if self.sandwich:
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        if self.residual_multiplier != 1.0:
            h = h * self.residual_multiplier
        h, residual = self.post_attention_layernorm(h, residual)
        h = self.mlp(h)
        if self.residual_multiplier != 1.0:
            h = h * self.residual_multiplier
        return h, residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_cls: type[nn.Module]) -> None:
        super().__init__()
        # nn.Embedding's own init (normal_) on the meta device, where the loader builds
        # the model, goes through torch._refs and imports torch._dynamo: ~2.8 s of start.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """A decoder-only causal LM, and what the shared code needs to know of its family."""

    # Stacked pagoda module -> the checkpoint projections it holds, in row order.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    # Whether llama.cpp's converter permuted the Q/K rows of this family's GGUF files
    # (its Llama converter does, for its interleaved rotary layout).
    gguf_qk_permuted: ClassVar[bool] = False
    # Whether the family's own RoPE rotates interleaved pairs (Cohere, ERNIE 4.5): the HF
    # checkpoint's Q/K rows (and LoRA B's) are then put in rotate-half order at load.
    hf_qk_permuted: ClassVar[bool] = False
    # Whether tensor parallelism (pagoda.model.layers.parallel.ShardPlan) applies.
    tensor_parallel: ClassVar[bool] = True
    # Whether LoRA adapters (pagoda.lora: on qkv/o/gate_up/down) apply.
    lora: ClassVar[bool] = True
    # Modules (name suffixes) the quantized modes leave in float: MoE routers, whose
    # choice of experts a rounding would change.
    unquantized_modules: ClassVar[tuple[str, ...]] = ()
    # A vision-language model's tower and projector (name prefixes): not converted with the
    # language model; float in every mode but int8, which converts them after (quantize_tower).
    tower_prefixes: ClassVar[tuple[str, ...]] = ()
    layer_cls: ClassVar[type[nn.Module]] = DecoderLayer

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.layer_cls)
        if config.kv_source is not None:   # the step's keys and values, from the layers others read
            share: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for m in self.modules():
                if isinstance(m, Attention):
                    m.kv_share = share
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.num_labels:
            # A sequence-classification checkpoint (Qwen3ForSequenceClassification): a score head
            # over the pooled (last) hidden state, read by ``classify``.
            self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.init_rope(torch.device("cpu"))
        # Pipeline parallelism (pagoda/model/layers/pipeline.py, StagePlan.apply): this
        # stage's part of the forward and of the logits.
        self.stage = None
        # Decode-only steps' layers in one C++ call, set by the model runner once the
        # model is final (pagoda/model/layers/decode_stack.py).
        self.decode_stack = None

    # ---- the family's declarations ---------------------------------------------------

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        """The hyper-parameters of an HF config.json of this family."""
        return ModelArchConfig(**ModelArchConfig.hf_fields(config, architecture))

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        """The hyper-parameters of a GGUF file's metadata of this family."""
        return ModelArchConfig(**ModelArchConfig.gguf_fields(md, tensor_names, architecture))

    @classmethod
    def hf_name(cls, name: str) -> str | None:
        """A tensor name of an HF checkpoint as this model names it (Mixtral's
        block_sparse_moe.experts.N.w1 -> mlp.experts.N.gate_proj), or None for a tensor
        the model does not use (a multimodal checkpoint's vision tower)."""
        return name

    @classmethod
    def gguf_lookup_name(cls, name: str) -> str:
        """The name under which llama.cpp's table (``gguf``'s TensorNameMap) knows one of
        this model's checkpoint names, where the family renamed it (LFM2's final norm)."""
        return name

    @classmethod
    def hf_tensor(cls, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor of an HF checkpoint as the model holds it (Gemma's norms: 1 + w)."""
        return tensor

    @classmethod
    def hf_tensors(cls, name: str, tensor: torch.Tensor,
                   checkpoint: Callable[[str], torch.Tensor] | None = None) -> Iterator[tuple[str, Any]]:  # fmt: skip
        """(name, tensor) of every model tensor one HF checkpoint tensor holds: itself,
        renamed and converted (``hf_name`` / ``hf_tensor``), or none; a family whose
        checkpoints stack several tensors in one (GPT-OSS's experts) splits them here.
        ``checkpoint(name)`` reads another tensor of the checkpoint (MXFP4 blocks and
        their scales are two); a weight may come as a ``BlockWeight`` (kept in its blocks
        where the kernels read them, dequantized elsewhere)."""
        ours = cls.hf_name(name)
        if ours is not None:
            yield ours, cls.hf_tensor(name, tensor)

    @classmethod
    def with_projector(cls, arch: ModelArchConfig, md: dict[str, Any]) -> ModelArchConfig:
        """A vision-language family's architecture from a GGUF language model (metadata ``md``)
        and llama.cpp's projector file (already in ``arch.vision``): what the family reads
        from the language model's keys beside (Qwen's M-RoPE sections)."""
        return arch

    @classmethod
    def gguf_tensor(cls, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A float tensor of a GGUF file (read under ``hf_name``, the checkpoint name it
        maps to) as the model holds it, where llama.cpp's converter stored it transformed
        (the SSM's D as [heads, 1]). Quantized weights kept in their blocks do not pass here."""
        return tensor

    def init_rope(self, device: torch.device) -> None:
        """The rotary tables' inverse frequencies (buffers: checkpoints do not hold them):
        ``inv_freq`` for every layer, ``inv_freq_local`` for windowed layers with a base
        of their own (Gemma 3), ``inv_freq_long`` past LongRoPE's original context."""
        c = self.config
        # Each table's width: its layers' heads (Gemma 4's global and windowed heads differ).
        tables = [c.rope_table_of(i) for i in range(c.num_hidden_layers)]
        dim_of = {t: c.rotary_dim or c.head_dim_of(tables.index(t)) for t in set(tables)}
        dim = c.global_rope_dim
        self.register_buffer("inv_freq", rope_inv_freq(dim, c.rope_theta, c.rope_scaling).to(device),
                             persistent=False)
        self.longrope = None
        self.rope_scale = rope_attention_factor(c.rope_scaling)
        axes = None   # M-RoPE: each frequency's position row
        if c.mrope_section is not None:
            axes = mrope_axes(c.mrope_section, c.mrope_interleaved).to(device)
            if len(axes) != dim // 2:
                raise UnsupportedModelError(f"mrope_section {list(c.mrope_section)} covers {len(axes)} frequencies "
                                            f"of {dim // 2}")
        self.register_buffer("mrope", axes, persistent=False)
        if rope_kind(c.rope_scaling) == "longrope":
            long, original, attention = longrope_tables(dim, c.rope_theta, c.rope_scaling)
            self.register_buffer("inv_freq_long", long.to(device), persistent=False)
            self.longrope = (original, attention)
        if c.local_rope_theta is not None:
            self.register_buffer("inv_freq_local",
                                 rope_inv_freq(dim_of.get("local", dim), c.local_rope_theta, None).to(device),
                                 persistent=False)

    def expert_load(self) -> list[list[int]] | None:
        """Per MoE layer (in order), the tokens routed to each expert since start; None
        for a model without experts. (A pipeline stage's: see ``expert_counts``.)"""
        counts = self.expert_counts()
        return None if counts is None else counts.tolist()

    def expert_counts(self) -> torch.Tensor | None:
        """[MoE layers of the whole model, experts] int64 on the CPU: the tokens routed to each
        expert since start, layers in order. A pipeline stage fills the rows of its own layers
        and leaves the others' zero, so the stages' tensors add up to one process's. None for a
        model without experts."""
        c = self.config
        rows = [i for i in range(len(self.model.layers)) if c.is_moe_layer(i)]
        if not rows:
            return None
        counts = torch.zeros(len(rows), c.num_experts, dtype=torch.long)
        held = [(row, next(m for m in self.model.layers[i].modules() if isinstance(m, SparseMoeBlock)))
                for row, i in enumerate(rows) if not isinstance(self.model.layers[i], MissingLayer)]
        held = [(row, b.expert_tokens) for row, b in held if b.expert_tokens is not None]
        if held:
            counts[[row for row, _ in held]] = torch.stack([t for _, t in held]).cpu()
        return counts

    def kv_specs(self) -> list[KVSpec | None]:
        """Per layer: the KV heads this process holds, their size, and the window; None for
        a layer another pipeline stage holds, or one without a KV cache (a hybrid model's
        state layers: ``state_shapes``)."""
        return [None if isinstance(layer, MissingLayer) or self.config.is_state_layer(i) else
                KVSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, self.config.sliding_window_of(i))
                for i, layer in enumerate(self.model.layers)]

    def state_shapes(self) -> list[tuple[int, ...] | None]:
        """Per layer: the shape of one request's recurrent state (a hybrid model's state
        layers), else None. The runner keeps one per request slot and passes the layer its
        [slots, *shape] tensor where attention layers get their KV cache."""
        return [None] * len(self.model.layers)

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of the hidden states between layers (the norms' weights')."""
        return next(m.weight.dtype for m in self.modules() if isinstance(m, RMSNorm))

    def shard_rows(self, module_path: str, shard: int) -> tuple[int, int]:
        """Row range [start, end) of a shard inside the stacked projection at
        ``module_path`` (read from its parent module, which holds only a rank's heads
        under tensor parallelism, and an expert's own intermediate size)."""
        parent_path, _, stacked = module_path.rpartition(".")
        parent = self.get_submodule(parent_path)
        if stacked == "qkv_proj":
            q, kv = parent.q_rows, parent.kv_size
            bounds = [0, q, q + kv, q + 2 * kv]
        elif stacked == "gate_up_proj":
            i = parent.intermediate_size
            bounds = [0, i, 2 * i]
        else:
            raise KeyError(f"{stacked} is not a stacked projection of {type(self).__name__}")
        return bounds[shard], bounds[shard + 1]

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # ---- the forward -----------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,        # [T]
        positions: torch.Tensor,        # [T], or [3, T] (M-RoPE, a step holding image tokens)
        kv_caches: list[torch.Tensor | None],  # per layer (None: a layer another pipeline stage holds)
        meta: AttentionMetadata | Sequence[AttentionMetadata],  # one for all layers, or one per layer
        num_layers: int | None = None,  # run only the first num_layers (a layer-skip draft)
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden] in place of embed(input_ids): images in
    ) -> torch.Tensor:                  # hidden states [T, hidden]
        if self.stage is not None:
            # A pipeline stage: its own layers, activations from and to its neighbours.
            if inputs_embeds is not None:
                raise ValueError("image inputs are not supported with pipeline parallelism")
            return self.stage.forward(self, input_ids, positions, kv_caches, meta)
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        end = len(self.model.layers) if num_layers is None else num_layers
        x, residual = self.run_layers(x, None, positions, kv_caches, meta, 0, end)
        return self.model.norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        return x

    def run_layers(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                   kv_caches: list[torch.Tensor | None], meta: AttentionMetadata | Sequence[AttentionMetadata],
                   start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers [start, end) over the hidden states ``x`` and the residual stream (None
        before the first layer); returns both after layer end - 1."""
        tables = {"global": self._rope_tables(positions, x.dtype)}
        if self.config.local_rope_theta is not None:
            tables["local"] = rope_cos_sin(positions, self.inv_freq_local, x.dtype)
        if self.config.rope_layers is not None:
            # Layers without RoPE: the identity rotation, exactly (q * 1 + rotated * 0), so
            # the fused rotary op serves them too.
            cos = tables["global"][0]
            tables["none"] = (torch.ones_like(cos), torch.zeros_like(cos))
            if self.config.attn_temperature is not None:
                # Attention-temperature tuning: each token's query scale, by its position.
                floor_scale, scale = self.config.attn_temperature
                p = positions.float()
                tables["tuned"] = ((torch.log1p(torch.floor((p + 1.0) / floor_scale)) * scale + 1.0)[:, None, None],
                                   None)
        if self.decode_stack is not None:
            # A decode-only step in one C++ call (pagoda/model/layers/decode_stack.py).
            done = self.decode_stack.run(x, residual, tables, kv_caches, meta, start, end)
            if done is not None:
                return done
        metas = itertools.repeat(meta) if isinstance(meta, AttentionMetadata) else itertools.islice(meta, start, None)
        for layer, kv_cache, layer_meta in zip(self.model.layers[start:end], kv_caches[start:end], metas):
            cos, sin = tables[layer.rope_table]
            x, residual = layer(x, residual, cos, sin, kv_cache, layer_meta)
        return x, residual

    def _rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 2:   # M-RoPE's [3, T] (a step holding an image's tokens)
            if self.mrope is None:
                raise ValueError(f"positions of shape {tuple(positions.shape)} for a model with one position a token")
            return mrope_cos_sin(positions, self.inv_freq, self.mrope, dtype, self.rope_scale)
        if self.longrope is None:
            return rope_cos_sin(positions, self.inv_freq, dtype, self.rope_scale)
        original, attention = self.longrope
        short, long = rope_cos_sin(positions, self.inv_freq, torch.float32), rope_cos_sin(positions, self.inv_freq_long,
                                                                                           torch.float32)
        past = (positions >= original)[:, None, None]
        return tuple((torch.where(past, lt, st) * attention).to(dtype) for st, lt in zip(short, long))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.stage is not None:   # the last pipeline stage computes them, rank 0 receives them
            return self.stage.compute_logits(self, hidden)
        return self.head_logits(hidden)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[n, hidden] pooled states -> [n, num_labels] float32 logits of the score head."""
        return self.score(pooled).float()

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        c = self.config
        if c.logits_divisor != 1.0:
            logits = logits / c.logits_divisor
        if c.final_logit_softcapping:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits.float()
