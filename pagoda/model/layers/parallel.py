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
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.arch import ModelArchConfig


# An expert's tensor or module in a checkpoint name: ``...mlp.experts.{index}.gate_proj...``.
EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.")


class Collectives(Protocol):
    world_size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """Contiguous near-equal split, larger shares first: split_range(5, 2, 1) -> (3, 5)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


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

    @classmethod
    def build(cls, arch: ModelArchConfig, rank: int, world_size: int, expert_parallel: bool = False) -> ShardPlan:
        heads, kv = arch.num_attention_heads, arch.num_key_value_heads
        group = heads // kv
        if heads < world_size:
            raise ValueError(f"tensor_parallel_size={world_size} exceeds the model's {heads} attention heads")
        if kv >= world_size:
            kv_range = split_range(kv, world_size, rank)
            q_range = (kv_range[0] * group, kv_range[1] * group)
        else:
            if world_size % kv:
                raise ValueError(
                    f"the model has {kv} KV heads: tensor_parallel_size={world_size} must be at most "
                    f"{kv} or a multiple of it (each KV head is then replicated on the same number of ranks)")
            copies = world_size // kv
            if group < copies:
                raise ValueError(f"tensor_parallel_size={world_size} leaves ranks without query heads")
            head = rank // copies
            sub = split_range(group, copies, rank % copies)
            kv_range = (head, head + 1)
            q_range = (head * group + sub[0], head * group + sub[1])
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
            expert_rows = split_range(arch.moe_intermediate_size, world_size, rank)
        return cls(rank, world_size, q_range, kv_range, split_range(arch.intermediate_size, world_size, rank),
                   vocab, per, arch.head_dim, arch.vocab_size, experts, expert_rows, heads, kv,
                   arch.intermediate_size)

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
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.num_heads, attn.num_kv_heads = self.num_heads, self.num_kv_heads
            attn.q_size, attn.kv_size = self.num_heads * d, self.num_kv_heads * d
            bias = attn.qkv_proj.bias is not None
            attn.qkv_proj = nn.Linear(attn.qkv_proj.in_features, attn.q_size + 2 * attn.kv_size, bias=bias)
            attn.o_proj = RowParallelLinear(attn.q_size, attn.o_proj.out_features, comm,
                                            bias=attn.o_proj.bias is not None)
            if getattr(attn, "sinks", None) is not None:   # GPT-OSS: this rank's heads' sinks
                attn.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
            if getattr(attn, "qk_norm", None) == "full":   # OLMo 2: each rank's rows of the norms
                attn.q_norm = type(attn.q_norm)(attn.q_size, attn.q_norm.eps)
                attn.k_norm = type(attn.k_norm)(attn.kv_size, attn.k_norm.eps)
                attn.qk_comm = comm
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
                    expert.intermediate_size = r1 - r0
                    expert.gate_up_proj = nn.Linear(expert.gate_up_proj.in_features, 2 * (r1 - r0), bias=bias)
                    expert.down_proj = nn.Linear(r1 - r0, expert.down_proj.out_features, bias=bias)
                mlp.comm = comm
                continue
            mlp.intermediate_size = i1 - i0
            mlp.gate_up_proj = nn.Linear(mlp.gate_up_proj.in_features, 2 * (i1 - i0), bias=False)
            mlp.down_proj = RowParallelLinear(i1 - i0, mlp.down_proj.out_features, comm)
        hidden = model.model.embed_tokens.embedding_dim
        model.model.embed_tokens = VocabParallelEmbedding(self.vocab, self.vocab_per_rank, hidden, comm)
        model.lm_head = ParallelLMHead(self.vocab_per_rank, hidden, self.vocab_size, comm)

    # ---- sharding the checkpoint's tensors as they are read ---------------------------

    def holds(self, name: str) -> bool:
        """Whether this rank holds (a part of) checkpoint tensor ``name``: all but other
        ranks' experts."""
        expert = EXPERT_NAME.search(name)
        return expert is None or self.experts[0] <= int(expert[1]) < self.experts[1]

    def narrow(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (HF naming)."""
        if EXPERT_NAME.search(name):
            return t if self.expert_rows is None else self._expert_rows(name, t)
        d = self.head_dim
        kind = name.split(".")[-2] if "." in name else name
        if kind == "qkv_proj":   # stacked in the checkpoint: each part's rows of this rank
            q, k, v = t.split([self.total_heads * d, self.total_kv_heads * d, self.total_kv_heads * d])
            kv = slice(self.kv_heads[0] * d, self.kv_heads[1] * d)
            return torch.cat([q[self.q_heads[0] * d:self.q_heads[1] * d], k[kv], v[kv]])
        if kind == "gate_up_proj":
            gate, up = t.split([self.total_intermediate] * 2)
            rows = slice(*self.intermediate)
            return torch.cat([gate[rows], up[rows]])
        if kind == "q_norm" and t.shape[0] == self.total_heads * d:     # whole-width (OLMo 2)
            return t[self.q_heads[0] * d:self.q_heads[1] * d]
        if kind == "k_norm" and t.shape[0] == self.total_kv_heads * d:
            return t[self.kv_heads[0] * d:self.kv_heads[1] * d]
        if kind == "q_proj":
            return t[self.q_heads[0] * d:self.q_heads[1] * d]
        if name.endswith("self_attn.sinks"):
            return t[self.q_heads[0]:self.q_heads[1]]
        if kind in ("k_proj", "v_proj"):
            return t[self.kv_heads[0] * d:self.kv_heads[1] * d]
        if kind in ("gate_proj", "up_proj"):
            return t[self.intermediate[0]:self.intermediate[1]]
        if kind == "o_proj" and name.endswith("weight"):
            return t[:, self.q_heads[0] * d:self.q_heads[1] * d]
        if kind == "down_proj" and name.endswith("weight"):
            return t[:, self.intermediate[0]:self.intermediate[1]]
        if kind in ("embed_tokens", "lm_head"):
            rows = t[self.vocab[0]:self.vocab[1]]
            pad = self.vocab_per_rank - rows.shape[0]
            return F.pad(rows, (0, 0, 0, pad)) if pad else rows
        return t


    def _expert_rows(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of an expert's tensor (experts split by rows)."""
        kind = name.split(".")[-2]
        rows = slice(*self.expert_rows)
        if kind in ("gate_proj", "up_proj"):
            return t[rows]
        if kind == "down_proj" and name.endswith("weight"):
            return t[:, rows]
        if kind == "down_proj":   # a bias: added once, by rank 0
            return t if self.rank == 0 else torch.zeros_like(t)
        raise ValueError(f"cannot split expert tensor {name} by rows")


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) (+ the whole bias, added once after the sum):
    the input is split over ranks."""

    def __init__(self, in_features_per_rank: int, out_features: int, comm: Collectives, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features_per_rank))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding (padded to ``rows`` rows); the rank that
    holds a token's row contributes it, the others zeros, and all-reduce sums them."""

    def __init__(self, vocab: tuple[int, int], rows: int, hidden: int, comm: Collectives) -> None:
        super().__init__()
        self.start, self.end = vocab
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mine[:, None].to(self.weight.dtype)
        return self.comm.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Each rank's logits for its vocab rows, all-gathered, padding cut off."""

    def __init__(self, rows: int, hidden: int, vocab_size: int, comm: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.vocab_size = vocab_size
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(F.linear(x, self.weight), dim=-1)[..., : self.vocab_size]
