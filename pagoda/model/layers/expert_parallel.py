"""Expert parallelism across data-parallel replicas (docs/parallel.md).

With ``--data-parallel-size N --enable-expert-parallel`` the N replicas' engine cores form
one expert-parallel (EP) group: attention, norms, embeddings, routers and dense layers are
replicated, and each replica (EP rank r) holds only the experts ``split_range(E, N, r)`` of
every MoE layer. Each rank routes its own tokens (the router's top-k unchanged) and
``dispatch_combine`` sends every (token, expert) pair to the rank that holds the expert,
which computes it and sends the result back; the token's owner adds its experts' weighted
outputs in expert order, as ``SparseMoeBlock._experts_sum`` does in one process.

Three collectives per MoE layer, all ``all_to_all`` with split sizes: the pair counts per
expert, the rows out, the results back. They are collectives: every rank must take part
in every layer's exchanges, in layer order, also with no tokens (``dummy_pass``).

The ``group`` is duck-typed (``pagoda.distributed.group.EPGroup``): ``rank``,
``world_size``, ``rounds`` (exchanges so far, for the engine's lockstep check) and
``all_to_all(t, out_splits, in_splits)``.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch
from torch import nn

from pagoda.model.layers.parallel import split_range


class ExpertExchange(Protocol):
    rank: int
    world_size: int
    rounds: int

    def all_to_all(self, t: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        """Rows ``t`` split along dim 0 (``in_splits[r]`` rows to rank r); returns the
        ``out_splits[r]`` rows received from each rank r, in rank order."""
        ...


def dispatch_combine(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList,
                     num_experts: int, group: ExpertExchange) -> torch.Tensor:
    """The routed experts' weighted sum for this rank's tokens ``x`` [T, H] (T may be 0),
    given the router's ``weights`` [T, k] (in x's dtype) and expert ``ids`` [T, k].
    ``experts[e]`` must be a real module for this rank's experts ``split_range(num_experts,
    world_size, rank)``; the others are never called.

    Bits: each token's result is (0 + y_a * w_a) + y_b * w_b ... over its experts in
    ascending id, as the one-process block adds them. An expert's rows are computed in one
    product over the rows every rank sent (rank order, then token order); whether its
    result is bitwise the one-process result then depends on the matmul giving each row
    the same bits whatever rows share the product (true of the tests' float32 GEMMs when
    the row sets match; not promised by BLAS in general, see docs/parallel.md)."""
    world, rank = group.world_size, group.rank
    num_tokens, top_k = ids.shape
    bounds = [split_range(num_experts, world, r) for r in range(world)]
    # Each token's picks in ascending expert id (the one-process order of addition).
    ids_sorted, perm = torch.sort(ids, dim=1, stable=True)
    w_sorted = weights.gather(1, perm)
    flat = ids_sorted.reshape(-1)
    # The (token, slot) pairs grouped by expert, tokens in order within an expert; the
    # experts' ranges are contiguous and ascending by rank, so this is by owner rank too.
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    # 1. Every rank learns how many rows each rank sends to each expert.
    all_counts = group.all_to_all(counts.repeat(world), [num_experts] * world, [num_experts] * world)
    all_counts = all_counts.view(world, num_experts).tolist()
    send_splits = [int(counts[a:b].sum()) for a, b in bounds]
    e0, e1 = bounds[rank]
    recv_splits = [sum(row[e0:e1]) for row in all_counts]
    # 2. The rows out to their experts' ranks.
    recv = group.all_to_all(x[order // top_k], recv_splits, send_splits)
    # 3. This rank's experts, each over its rows from every rank at once.
    results = torch.zeros_like(recv)   # (every row is written below)
    starts, pos = {}, 0
    for src in range(world):
        for e in range(e0, e1):
            starts[src, e] = pos
            pos += all_counts[src][e]
    for e in range(e0, e1):
        segments = [torch.arange(starts[src, e], starts[src, e] + all_counts[src][e])
                    for src in range(world) if all_counts[src][e]]
        if segments:
            rows = torch.cat(segments).to(recv.device)
            results[rows] = experts[e](recv[rows])
    # 4. The results back to the tokens' ranks, in the order their rows were sent.
    back = group.all_to_all(results, send_splits, recv_splits)
    group.rounds += 1
    per_pair = torch.empty_like(back)
    per_pair[order] = back
    per_pair = per_pair.view(num_tokens, top_k, x.shape[1])
    out = torch.zeros_like(x)
    for j in range(top_k):
        out += per_pair[:, j] * w_sorted[:, j, None]
    return out


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's MoE blocks (decoder.SparseMoeBlock, found by their ``ep`` slot), in layer order."""
    return [layer.mlp for layer in model.model.layers if hasattr(getattr(layer, "mlp", None), "ep")]


def shard_experts(model: nn.Module, group: ExpertExchange) -> tuple[int, int]:
    """Keep only this rank's experts of every MoE layer (the others become nn.Identity, their
    weights freed) and route the blocks through ``group``. Returns the [start, end) kept."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError("--enable-expert-parallel with --data-parallel-size needs a mixture-of-experts model")
    num_experts = blocks[0].num_experts
    if num_experts < group.world_size:
        raise ValueError(f"data_parallel_size={group.world_size} exceeds the model's {num_experts} experts "
                         "(expert parallelism gives every replica at least one)")
    e0, e1 = split_range(num_experts, group.world_size, group.rank)
    for block in blocks:
        for e in range(len(block.experts)):
            if not e0 <= e < e1:
                block.experts[e] = nn.Identity()   # held by another replica
        block.local_experts = range(e0, e1)
        block.ep = group
        block._fused = False   # the one-call kernel takes every expert's weights
    return e0, e1


@torch.inference_mode()
def dummy_pass(model: nn.Module) -> None:
    """Take part in every MoE layer's exchanges, in layer order, with no tokens: what a
    replica with nothing scheduled runs while another replica steps (no router, no
    attention, no KV, no sampling: only the exchanges, with zero rows of its own)."""
    dtype = model.activation_dtype
    for block in moe_blocks(model):
        # The router's device (a router kept as blocks has buffers, not parameters).
        device = next(itertools.chain(block.gate.parameters(), block.gate.buffers())).device
        x = torch.empty(0, model.config.hidden_size, dtype=dtype, device=device)
        ids = torch.empty(0, block.top_k, dtype=torch.long, device=device)
        dispatch_combine(x, x.new_empty(0, block.top_k), ids, block.experts, block.num_experts, block.ep)
