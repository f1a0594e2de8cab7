"""Tensor-parallel layers and the plan that shards a model over ranks.

The loader applies the plan to a model built on the meta device (before any
weight exists), so each rank allocates and reads only its shard; the model
code itself never mentions parallelism (as in gpt-fast).

- q/k/v and gate/up (stacked): column-parallel. A rank keeps the rows of its
  attention heads (of q, of k and of v, each sharded on its own) and of its
  slice of the intermediate size; no communication.
- o_proj and down_proj: row-parallel; each rank multiplies its input columns
  and the partial sums are all-reduced.
- embedding: vocab-parallel; each rank looks up the ids in its vocab range,
  zeros for the rest, then all-reduce.
- LM head: vocab-parallel; each rank computes its logits, then all-gather.
- The parallel layers wrap a ``local`` layer that multiplies this rank's part: a float
  ``nn.Linear`` / ``nn.Embedding`` as built here, which the loader or the quantized modes
  replace as they replace any projection (GGUF blocks, int8, q4, bf16). Checkpoint names
  skip the wrapper (``o_proj.local.weight`` is ``o_proj.weight``: ``checkpoint_name``).
- MoE layers: every rank routes every token (the router is replicated) and adds up its
  experts' weighted outputs; the partial sums are all-reduced once per layer. With expert
  parallelism (``--enable-expert-parallel``) a rank holds whole experts, a contiguous share
  of each layer's; without it (vLLM's default), every expert split by rows as a dense MLP
  is (gate/up rows, down columns; a down bias on rank 0 only, so it is added once).

Heads are split by KV group, so that every rank keeps whole GQA groups, and
shares need not be equal: E.g. 6 query heads, 3 KV heads (groups of 2) on
2 ranks -> rank 0 has KV heads 0-1 and query heads 0-3, rank 1 KV head 2 and
query heads 4-5. With fewer KV heads than ranks, each KV head is replicated on
ranks // kv_heads ranks, which split its group of query heads: E.g. 4 query
heads, 1 KV head on 2 ranks -> both hold KV head 0, with query heads 0-1 and 2-3.

Weights kept in blocks along the input dimension (GGUF blocks, q4's groups of 32) split
row-parallel layers' inputs on block boundaries only (``ShardPlan.build``'s
``input_units``): the intermediate size in whole blocks (shares as equal as that allows),
the heads' columns of o_proj checked, with an error naming the layer where a rank's
share is not whole blocks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.arch import ModelArchConfig

if TYPE_CHECKING:
    from pagoda.model.layers.blocks import BlockWeight


# An expert's tensor or module in a checkpoint name: ``...mlp.experts.{index}.gate_proj...``.
EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.")


class Collectives(Protocol):
    world_size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """Contiguous near-equal split, larger shares first: split_range(5, 2, 1) -> (3, 5)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def split_units(n: int, unit: int, parts: int, index: int, what: str) -> tuple[int, int]:
    """``split_range`` in whole units of ``unit``: split_units(768, 256, 2, 1) -> (512, 768)."""
    if unit == 1:
        return split_range(n, parts, index)
    if n % unit or n // unit < parts:
        raise ValueError(f"tensor parallelism splits {what} ({n}) over {parts} ranks in whole blocks of "
                         f"{unit} weights: {'it is not a multiple of' if n % unit else 'too few blocks of'} {unit}")
    start, end = split_range(n // unit, parts, index)
    return start * unit, end * unit


@dataclass(frozen=True)
class TensorShard:
    """The part of a checkpoint tensor one rank keeps: the row ranges ``rows`` (of dim 0,
    concatenated; None: every row), then the columns ``cols`` (of dim 1; None: all), then
    zero rows up to ``pad_rows``; ``zero``: zeros of the tensor's shape (a bias that
    another rank adds)."""

    rows: tuple[tuple[int, int], ...] | None = None
    cols: tuple[int, int] | None = None
    pad_rows: int = 0
    zero: bool = False

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        if self.zero:
            return torch.zeros_like(t)
        if self.rows is not None:
            t = torch.cat([t[a:b] for a, b in self.rows]) if len(self.rows) > 1 else t[self.rows[0][0]:self.rows[0][1]]
        if self.cols is not None:
            t = t[:, self.cols[0]:self.cols[1]]
        pad = self.pad_rows - t.shape[0]
        return F.pad(t, (0, 0, 0, pad)) if pad > 0 else t

    def apply_blocks(self, w: BlockWeight, name: str) -> BlockWeight:
        """The same part of a weight kept as blocks: whole rows of blocks (a view of the
        file's map where one range of rows is kept), columns in whole blocks only (a copy),
        padding rows of zero bytes (which every block type reads as zeros; they are never
        looked up, and their logits are cut off)."""
        from pagoda.model.layers.blocks import BlockWeight, block_format

        data, in_features, mapped, order = w.data, w.in_features, w.file_mapped, w.input_order
        if self.rows is not None:
            if len(self.rows) > 1:
                data, mapped = torch.cat([data[a:b] for a, b in self.rows]), False
            else:
                data = data[self.rows[0][0]:self.rows[0][1]]
        if self.cols is not None:
            block, nbytes = block_format(w.ggml_type)
            c0, c1 = self.cols
            if c0 % block or c1 % block or order is not None:
                why = ("its input channels are stored permuted (act-order)" if order is not None else
                       f"columns [{c0}, {c1}) of {in_features} are not whole {w.ggml_type.name} blocks of {block}")
                raise ValueError(f"tensor parallelism splits {name} ({w.out_features} x {in_features}, "
                                 f"{w.ggml_type.name}) by its input columns, and this rank's share cannot be cut "
                                 f"from the blocks: {why}; use a tensor-parallel size whose shares are whole blocks")
            data = data[:, c0 // block * nbytes:c1 // block * nbytes].contiguous()
            in_features, mapped = c1 - c0, False
        pad = self.pad_rows - data.shape[0]
        if pad > 0:
            data, mapped = torch.cat([data, data.new_zeros(pad, data.shape[1])]), False
        return BlockWeight(data, w.ggml_type, in_features, mapped, order)


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world_size: int
    q_heads: tuple[int, int]       # [start, end) of the query heads this rank computes
    kv_heads: tuple[int, int]      # [start, end) of the KV heads it holds
    intermediate: tuple[int, int]  # [start, end) of the MLP intermediate dimension
    vocab: tuple[int, int]         # [start, end) of the vocabulary rows it holds
    vocab_per_rank: int            # padded rows per rank (all ranks equal, for all-gather)
    head_dim: int
    vocab_size: int
    experts: tuple[int, int] = (0, 0)  # [start, end) of each MoE layer's experts this rank holds
    # Experts split by rows (no expert parallelism): [start, end) of each expert's
    # intermediate dimension this rank holds; None: whole experts.
    expert_rows: tuple[int, int] | None = None
    # The model's totals, to split tensors a checkpoint stores stacked (Phi-3's qkv_proj, gate_up_proj).
    total_heads: int = 0
    total_kv_heads: int = 0
    total_intermediate: int = 0
    # Gated DeltaNet layers (Qwen3.5, Qwen3-Next): [start, end) of the key heads this rank
    # computes, each with its value heads (grouped order); the layers' geometry (linear_attn).
    linear_k_heads: tuple[int, int] = (0, 0)
    linear_attn: tuple[tuple[str, int], ...] = ()
    # Shared experts (a GatedMLP of their own width beside the routed ones): [start, end)
    # of their intermediate dimension, and the whole width.
    shared: tuple[int, int] = (0, 0)
    total_shared: int = 0
    # LFM2's gated short convolutions: [start, end) of the channels this rank convolves,
    # and the whole width.
    conv_channels: tuple[int, int] = (0, 0)
    total_conv: int = 0
    # q_proj's rows per head and head dimension: 2 with an output gate (Qwen3.5's: a query
    # and a gate row block per head).
    q_rows_per_head: int = 1

    @classmethod
    def build(cls, arch: ModelArchConfig, rank: int, world_size: int, expert_parallel: bool = False,
              input_units: dict[str, int] | None = None) -> ShardPlan:
        """``input_units``: the blocks (weights along the input dimension) the row-parallel
        layers' weights are kept in, ``{"o_proj": 256, "down_proj": 32}``: the intermediate
        sizes (dense and experts') are split in whole ``down_proj`` blocks, and every rank's
        share of o_proj's input (its heads) must be whole ``o_proj`` blocks."""
        units = input_units or {}
        heads, kv = arch.num_attention_heads, arch.num_key_value_heads
        q_range, kv_range = _heads_of(heads, kv, world_size, rank)
        o_unit = units.get("o_proj", 1)
        for r in range(world_size):   # every rank's share: each rank raises the same error
            q0, q1 = _heads_of(heads, kv, world_size, r)[0]
            if (q1 - q0) * arch.head_dim % o_unit:
                raise ValueError(
                    f"tensor_parallel_size={world_size} gives rank {r} {q1 - q0} of the {heads} attention heads: "
                    f"{(q1 - q0) * arch.head_dim} of o_proj's {heads * arch.head_dim} input columns (o_proj is "
                    f"{arch.hidden_size} x {heads * arch.head_dim}), not whole blocks of {o_unit} weights, the "
                    f"blocks its weights are kept in; use a tensor-parallel size that splits the heads into "
                    f"multiples of {o_unit // math.gcd(o_unit, arch.head_dim)}")
        down_unit = units.get("down_proj", 1)
        per = -(-arch.vocab_size // world_size)
        vocab = (min(rank * per, arch.vocab_size), min((rank + 1) * per, arch.vocab_size))
        experts, expert_rows = (0, 0), None
        if arch.num_experts and expert_parallel:
            if arch.num_experts < world_size:
                raise ValueError(f"tensor_parallel_size={world_size} exceeds the model's {arch.num_experts} experts")
            experts = split_range(arch.num_experts, world_size, rank)
        elif arch.num_experts:
            if arch.moe_intermediate_size < world_size:
                raise ValueError(f"tensor_parallel_size={world_size} exceeds the experts' intermediate size "
                                 f"{arch.moe_intermediate_size}")
            experts = (0, arch.num_experts)
            expert_rows = split_units(arch.moe_intermediate_size, down_unit, world_size, rank,
                                      "the experts' intermediate size")
        if arch.num_experts and arch.intermediate_size % down_unit:
            # A MoE model's dense width that no layer may use: a dense layer's down_proj,
            # if any, reports its blocks when it is read.
            intermediate = split_range(arch.intermediate_size, world_size, rank)
        else:
            intermediate = split_units(arch.intermediate_size, down_unit, world_size, rank, "the intermediate size")
        linear_k, linear = (0, 0), ()
        if arch.linear_attn and any(arch.linear_attn_layers or ()):
            linear_k, linear = _linear_heads_of(arch, world_size, rank, units.get("out_proj", 1))
        conv = (0, 0)
        if arch.conv_layers is not None and any(arch.conv_layers):
            conv = split_units(arch.hidden_size, units.get("out_proj", 1), world_size, rank, "the convolutions' channels")
        shared, total_shared = (0, 0), 0
        if arch.num_experts and arch.num_shared_experts:
            total_shared = arch.shared_expert_intermediate_size or arch.moe_intermediate_size * arch.num_shared_experts
            shared = split_units(total_shared, down_unit, world_size, rank, "the shared experts' intermediate size")
        return cls(rank, world_size, q_range, kv_range, intermediate,
                   vocab, per, arch.head_dim, arch.vocab_size, experts, expert_rows, heads, kv,
                   arch.intermediate_size, linear_k, linear, shared, total_shared,
                   conv, arch.hidden_size if arch.conv_layers is not None else 0,
                   2 if arch.attn_output_gate else 1)

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    # ---- sharding the module tree (on the meta device) -------------------------------

    def apply(self, model: nn.Module, comm: Collectives) -> None:
        """Swap in this rank's layers. The model must be on the meta device."""
        d = self.head_dim
        i0, i1 = self.intermediate
        q_cols = (self.q_heads[0] * d, self.q_heads[1] * d, self.total_heads * d)
        for layer in model.model.layers:
            mlp = layer.mlp
            attn = getattr(layer, "self_attn", None)   # (a hybrid's state layer has none)
            if attn is not None:
                self._apply_attention(attn, comm, q_cols)
            if getattr(layer, "linear_attn", None) is not None:
                self._apply_linear_attn(layer.linear_attn, comm)
            if getattr(layer, "conv", None) is not None:
                self._apply_short_conv(layer.conv, comm)
            shared = getattr(mlp, "shared_experts", None)
            if shared is not None:   # split as a dense MLP is, its own sum all-reduced
                s0, s1 = self.shared
                shared.intermediate_size = s1 - s0
                shared.gate_up_proj = nn.Linear(shared.gate_up_proj.in_features, 2 * (s1 - s0), bias=False)
                shared.down_proj = RowParallelLinear(nn.Linear(s1 - s0, shared.down_proj.out_features, bias=False),
                                                     comm, (s0, s1, self.total_shared))
            if hasattr(mlp, "experts") and self.expert_rows is None:   # whole experts, this rank's share
                e0, e1 = self.experts
                for e in range(len(mlp.experts)):
                    if not e0 <= e < e1:
                        mlp.experts[e] = nn.Identity()   # held by another rank
                mlp.local_experts, mlp.comm = range(e0, e1), comm
                continue
            if hasattr(mlp, "experts"):   # every expert, this rank's rows (the block all-reduces)
                r0, r1 = self.expert_rows
                for expert in mlp.experts:
                    bias = expert.gate_up_proj.bias is not None
                    total = expert.intermediate_size
                    expert.intermediate_size = r1 - r0
                    expert.gate_up_proj = nn.Linear(expert.gate_up_proj.in_features, 2 * (r1 - r0), bias=bias)
                    # Its columns' partial sum; the MoE block all-reduces the experts' sum.
                    expert.down_proj = RowParallelLinear(nn.Linear(r1 - r0, expert.down_proj.out_features, bias=False),
                                                         comm, (r0, r1, total), bias=bias, reduce=False)
                mlp.comm = comm
                continue
            mlp.intermediate_size = i1 - i0
            bias = mlp.gate_up_proj.bias is not None   # (Seed-OSS's mlp_bias: gate/up rows, down once)
            mlp.gate_up_proj = nn.Linear(mlp.gate_up_proj.in_features, 2 * (i1 - i0), bias=bias)
            mlp.down_proj = RowParallelLinear(nn.Linear(i1 - i0, mlp.down_proj.out_features, bias=False), comm,
                                              (i0, i1, self.total_intermediate), bias=bias)
        hidden = model.model.embed_tokens.embedding_dim
        model.model.embed_tokens = VocabParallelEmbedding(self.vocab, nn.Embedding(self.vocab_per_rank, hidden), comm)
        model.lm_head = ParallelLMHead(nn.Linear(hidden, self.vocab_per_rank, bias=False), self.vocab_size, comm)

    def _apply_attention(self, attn: nn.Module, comm: Collectives, q_cols: tuple[int, int, int]) -> None:
        d = self.head_dim
        attn.num_heads, attn.num_kv_heads = self.num_heads, self.num_kv_heads
        attn.q_size, attn.kv_size = self.num_heads * d, self.num_kv_heads * d
        attn.q_rows = attn.q_size * (2 if attn.output_gate else 1)
        bias = attn.qkv_proj.bias is not None
        attn.qkv_proj = nn.Linear(attn.qkv_proj.in_features, attn.q_rows + 2 * attn.kv_size, bias=bias)
        attn.o_proj = RowParallelLinear(nn.Linear(attn.q_size, attn.o_proj.out_features, bias=False), comm,
                                        q_cols, bias=attn.o_proj.bias is not None)
        if getattr(attn, "sinks", None) is not None:   # GPT-OSS: this rank's heads' sinks
            attn.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        if getattr(attn, "qk_norm", None) == "full":   # OLMo 2: each rank's rows of the norms
            attn.q_norm = type(attn.q_norm)(attn.q_size, attn.q_norm.eps)
            attn.k_norm = type(attn.k_norm)(attn.kv_size, attn.k_norm.eps)
            attn.qk_comm = comm

    def _apply_linear_attn(self, m: nn.Module, comm: Collectives) -> None:
        """A Gated DeltaNet layer (pagoda/model/layers/gated_deltanet.py) of this rank's key
        heads and their value heads: its projection's rows, convolution channels, decays and
        state (``state_numel``) theirs; out_proj row-parallel. The gated norm is per value
        head, so no rank needs another's."""
        g = dict(self.linear_attn)
        k0, k1 = self.linear_k_heads
        per_key = g["v_heads"] // g["k_heads"]
        m.k_heads, m.v_heads = k1 - k0, (k1 - k0) * per_key
        m.key_size, m.value_size = m.k_heads * m.k_dim, m.v_heads * m.v_dim
        m.conv_dim = 2 * m.key_size + m.value_size
        m.in_proj = nn.Linear(m.in_proj.in_features, sum(m.row_sizes), bias=False)
        m.conv_weight = nn.Parameter(torch.empty(m.conv_dim, m.kernel), requires_grad=False)
        m.dt_bias = nn.Parameter(torch.empty(m.v_heads), requires_grad=False)
        m.A = nn.Parameter(torch.empty(m.v_heads), requires_grad=False)
        v = g["v_dim"]
        m.out_proj = RowParallelLinear(nn.Linear(m.value_size, m.out_proj.out_features, bias=False), comm,
                                       (k0 * per_key * v, k1 * per_key * v, g["v_heads"] * v))

    def _apply_short_conv(self, m: nn.Module, comm: Collectives) -> None:
        """An LFM2 gated short convolution (pagoda/model/models/lfm2.py) of this rank's
        channels: their rows of B, C and x, their kernels and state; out_proj row-parallel."""
        c0, c1 = self.conv_channels
        bias = m.conv_bias is not None
        m.hidden_size = c1 - c0
        m.in_proj = nn.Linear(m.in_proj.in_features, 3 * (c1 - c0), bias=bias)
        m.conv_weight = nn.Parameter(torch.empty(c1 - c0, m.kernel), requires_grad=False)
        if bias:
            m.conv_bias = nn.Parameter(torch.empty(c1 - c0), requires_grad=False)
        m.out_proj = RowParallelLinear(nn.Linear(c1 - c0, m.out_proj.out_features, bias=False), comm,
                                       (c0, c1, self.total_conv), bias=bias)

    def _short_conv_shard(self, name: str) -> TensorShard | None:
        c0, c1 = self.conv_channels
        h = self.total_conv
        part = name.split(".conv.")[1].split(".")[0]
        if part == "in_proj":   # B, C, x: each part's channels of this rank (weight and bias)
            return TensorShard(rows=((c0, c1), (h + c0, h + c1), (2 * h + c0, 2 * h + c1)))
        if part in ("conv_weight", "conv_bias"):
            return TensorShard(rows=((c0, c1),))
        if part == "out_proj":
            return TensorShard(cols=(c0, c1)) if name.endswith("weight") else None   # the bias: added once
        raise ValueError(f"cannot split short-convolution tensor {name} over ranks")

    def _linear_attn_shard(self, name: str) -> TensorShard | None:
        """This rank's part of a Gated DeltaNet tensor (``...linear_attn.{part}...``)."""
        g = dict(self.linear_attn)
        nk, kd, vd, per_key = g["k_heads"], g["k_dim"], g["v_dim"], g["v_heads"] // g["k_heads"]
        k0, k1 = self.linear_k_heads
        v0, v1 = k0 * per_key, k1 * per_key
        part = name.split(".linear_attn.")[1].split(".")[0]
        qkv = ((k0 * kd, k1 * kd), (nk * kd + k0 * kd, nk * kd + k1 * kd),
               (2 * nk * kd + v0 * vd, 2 * nk * kd + v1 * vd))
        if part in ("in_proj_qkv", "conv_weight"):
            return TensorShard(rows=qkv)
        if part == "in_proj_z":
            return TensorShard(rows=((v0 * vd, v1 * vd),))
        if part in ("in_proj_b", "in_proj_a", "dt_bias", "A"):
            return TensorShard(rows=((v0, v1),))
        if part == "in_proj_qkvz":   # q, k, v, z stacked per key head
            per = 2 * kd + 2 * per_key * vd
            return TensorShard(rows=((k0 * per, k1 * per),))
        if part == "in_proj_ba":     # b, a stacked per key head
            return TensorShard(rows=((k0 * 2 * per_key, k1 * 2 * per_key),))
        if part == "out_proj":
            return TensorShard(cols=(v0 * vd, v1 * vd))
        if part == "norm_weight":    # per value head, the same weights: every rank's
            return None
        raise ValueError(f"cannot split Gated DeltaNet tensor {name} over ranks")

    # ---- sharding the checkpoint's tensors as they are read ---------------------------

    def holds(self, name: str) -> bool:
        """Whether this rank holds (a part of) checkpoint tensor ``name``: all but other
        ranks' experts."""
        expert = EXPERT_NAME.search(name)
        return expert is None or self.experts[0] <= int(expert[1]) < self.experts[1]

    def shard(self, name: str, shape: tuple[int, ...]) -> TensorShard | None:
        """This rank's part of checkpoint tensor ``name`` (HF naming) of shape ``shape``;
        None: the whole tensor."""
        if EXPERT_NAME.search(name):
            return None if self.expert_rows is None else self._expert_rows(name)
        if ".linear_attn." in name:
            return self._linear_attn_shard(name)
        if self.total_conv and ".conv." in name:
            return self._short_conv_shard(name)
        d = self.head_dim
        kind = name.split(".")[-2] if "." in name else name
        if ".shared_experts." in name:   # a dense MLP of its own width
            if kind in ("gate_proj", "up_proj"):
                return TensorShard(rows=(self.shared,))
            if kind == "down_proj" and name.endswith("weight"):
                return TensorShard(cols=self.shared)
            if kind == "gate_up_proj":
                s0, s1 = self.shared
                return TensorShard(rows=((s0, s1), (self.total_shared + s0, self.total_shared + s1)))
        q = (self.q_heads[0] * d * self.q_rows_per_head, self.q_heads[1] * d * self.q_rows_per_head)
        kv = (self.kv_heads[0] * d, self.kv_heads[1] * d)
        if kind == "qkv_proj":   # stacked in the checkpoint: each part's rows of this rank
            nq, nkv = self.total_heads * d, self.total_kv_heads * d
            return TensorShard(rows=(q, (nq + kv[0], nq + kv[1]), (nq + nkv + kv[0], nq + nkv + kv[1])))
        if kind == "gate_up_proj":
            i0, i1 = self.intermediate
            return TensorShard(rows=((i0, i1), (self.total_intermediate + i0, self.total_intermediate + i1)))
        if kind == "q_norm" and shape[0] == self.total_heads * d:     # whole-width (OLMo 2)
            return TensorShard(rows=(q,))
        if kind == "k_norm" and shape[0] == self.total_kv_heads * d:
            return TensorShard(rows=(kv,))
        if kind == "q_proj":
            return TensorShard(rows=(q,))
        if name.endswith("self_attn.sinks"):
            return TensorShard(rows=(self.q_heads,))
        if kind in ("k_proj", "v_proj"):
            return TensorShard(rows=(kv,))
        if kind in ("gate_proj", "up_proj"):
            return TensorShard(rows=(self.intermediate,))
        if kind == "o_proj" and name.endswith("weight"):
            return TensorShard(cols=(self.q_heads[0] * d, self.q_heads[1] * d))
        if kind == "down_proj" and name.endswith("weight"):
            return TensorShard(cols=self.intermediate)
        if kind in ("embed_tokens", "lm_head"):
            return TensorShard(rows=(self.vocab,), pad_rows=self.vocab_per_rank)
        return None

    def narrow(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (HF naming)."""
        shard = self.shard(name, tuple(t.shape))
        return t if shard is None else shard.apply(t)

    def narrow_blocks(self, name: str, w: BlockWeight) -> BlockWeight:
        """This rank's part of checkpoint weight ``name`` kept as blocks."""
        shard = self.shard(name, (w.out_features, w.in_features))
        return w if shard is None else shard.apply_blocks(w, name)

    def _expert_rows(self, name: str) -> TensorShard:
        """This rank's rows of an expert's tensor (experts split by rows)."""
        kind = name.split(".")[-2]
        if kind in ("gate_proj", "up_proj"):
            return TensorShard(rows=(self.expert_rows,))
        if kind == "down_proj" and name.endswith("weight"):
            return TensorShard(cols=self.expert_rows)
        if kind == "down_proj":   # a bias: added once, by rank 0
            return TensorShard() if self.rank == 0 else TensorShard(zero=True)
        raise ValueError(f"cannot split expert tensor {name} by rows")


def _linear_heads_of(arch: ModelArchConfig, world_size: int, rank: int,
                     out_unit: int) -> tuple[tuple[int, int], tuple[tuple[str, int], ...]]:
    """[start, end) of the Gated DeltaNet key heads of ``rank`` (each with the value heads
    that read it), and the layers' geometry; every rank's share of out_proj's input (its
    value heads) whole blocks of ``out_unit`` weights."""
    g = arch.linear_attn
    k_heads, v_heads, v_dim = g["k_heads"], g["v_heads"], g["v_dim"]
    if g.get("v_order", "grouped") != "grouped":
        raise ValueError("tensor parallelism splits Gated DeltaNet layers by key head with their value heads "
                         "next to each other (transformers' order); this file tiles its value heads (llama.cpp's "
                         "qwen35 / qwen35moe files): serve its HF checkpoint, or one process")
    if k_heads < world_size:
        raise ValueError(f"tensor_parallel_size={world_size} exceeds the model's {k_heads} Gated DeltaNet key heads")
    per_key = v_heads // k_heads
    for r in range(world_size):
        k0, k1 = split_range(k_heads, world_size, r)
        if (k1 - k0) * per_key * v_dim % out_unit:
            raise ValueError(f"tensor_parallel_size={world_size} gives rank {r} {k1 - k0} of the {k_heads} Gated "
                             f"DeltaNet key heads: {(k1 - k0) * per_key * v_dim} of out_proj's input columns, not "
                             f"whole blocks of {out_unit} weights, the blocks its weights are kept in")
    return split_range(k_heads, world_size, rank), tuple(sorted(g.items()))


def _heads_of(heads: int, kv: int, world_size: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """([start, end) of the query heads, of the KV heads) of ``rank``: whole GQA groups,
    or a KV head replicated on world_size // kv ranks that split its query heads."""
    group = heads // kv
    if heads < world_size:
        raise ValueError(f"tensor_parallel_size={world_size} exceeds the model's {heads} attention heads")
    if kv >= world_size:
        kv_range = split_range(kv, world_size, rank)
        return (kv_range[0] * group, kv_range[1] * group), kv_range
    if world_size % kv:
        raise ValueError(
            f"the model has {kv} KV heads: tensor_parallel_size={world_size} must be at most "
            f"{kv} or a multiple of it (each KV head is then replicated on the same number of ranks)")
    copies = world_size // kv
    if group < copies:
        raise ValueError(f"tensor_parallel_size={world_size} leaves ranks without query heads")
    head = rank // copies
    sub = split_range(group, copies, rank % copies)
    return (head * group + sub[0], head * group + sub[1]), (head, head + 1)


def checkpoint_name(name: str) -> str:
    """A parameter or module name as checkpoints spell it: a parallel layer's ``local``
    layer is the layer itself (``model.layers.0.self_attn.o_proj.local.weight`` ->
    ``model.layers.0.self_attn.o_proj.weight``)."""
    parts = name.split(".")
    return ".".join(p for p in parts if p != LOCAL)


LOCAL = "local"   # the attribute of a parallel layer that holds its local layer


class _LocalWeight(nn.Module):
    """A parallel layer whose ``weight`` is its local layer's (so the model's
    ``tie_weights``, lm_head.weight = embed_tokens.weight, reaches the local layers)."""

    def __getattr__(self, name: str):
        if name == "weight":
            return getattr(self.local, "weight")
        return super().__getattr__(name)

    def __setattr__(self, name: str, value) -> None:
        if name == "weight":
            setattr(self.local, "weight", value)
        else:
            super().__setattr__(name, value)


class RowParallelLinear(nn.Module):
    """y = all_reduce(local(x_shard)) (+ the whole bias, added once after the sum): the
    input is split over ranks, this rank holding input columns ``columns`` = (start, end,
    total). ``reduce=False``: the caller sums the ranks' outputs (an expert split by rows,
    whose MoE block all-reduces once; its bias is rank 0's alone). ``output_dtype``: the
    dtype one process's layer rounds its output to (the bf16 mode's bfloat16): the sum is
    rounded to it, the local layer returning unrounded float32 sums."""

    def __init__(self, local: nn.Module, comm: Collectives, columns: tuple[int, int, int], bias: bool = False,
                 reduce: bool = True) -> None:
        super().__init__()
        self.local = local
        self.out_features = local.out_features
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        self.comm = comm
        self.columns = columns
        self.reduce = reduce
        self.output_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        if self.reduce:
            y = self.comm.all_reduce(y)
        if self.output_dtype is not None:
            y = y.to(self.output_dtype).to(x.dtype)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(_LocalWeight):
    """Rows [start, end) of the embedding (``local``, padded to the same rows on every
    rank); the rank that holds a token's row contributes it, the others zeros, and
    all-reduce sums them."""

    def __init__(self, vocab: tuple[int, int], local: nn.Module, comm: Collectives) -> None:
        super().__init__()
        self.start, self.end = vocab
        self.local = local
        self.embedding_dim = local.embedding_dim
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = self.local(local)
        out = out * mine[:, None].to(out.dtype)
        return self.comm.all_reduce(out)


class ParallelLMHead(_LocalWeight):
    """Each rank's logits for its vocab rows (``local``), all-gathered, padding cut off."""

    def __init__(self, local: nn.Module, vocab_size: int, comm: Collectives) -> None:
        super().__init__()
        self.local = local
        self.vocab_size = vocab_size
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(self.local(x), dim=-1)[..., : self.vocab_size]
