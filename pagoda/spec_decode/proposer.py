"""The proposer interface, and the draft that is a language model.

A proposer turns each speculating request's known tokens into at most ``num_drafts``
draft tokens, at the start of a step, inside the model runner. The scheduler has
already reserved budget and KV slots for 1 + num_drafts tokens: the last known token
(not computed yet) followed by the drafts. Fewer drafts than asked (an ngram miss) is
fine; the runner computes only what it got.

Drafts are proposed greedily (argmax), so the proposal distribution q is one-hot at
the draft token; the verifier's rejection sampling is exact for that q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from pagoda.attention import AttentionMetadata
from pagoda.attention.metadata import chunk_requests


@dataclass
class DraftRequest:
    token_ids: list[int]    # prompt + output; the last one is not computed yet
    num_drafts: int         # propose at most this many
    block_ids: list[list[int]]  # per KV group, the request's block table (slots for all 1 + num_drafts positions)
    req_id: str | None = None   # (the MTP proposer keeps the target's hidden states per request)


class HiddenRows:
    """The target's hidden rows of each request's last step (the MTP head's and the Gemma 4
    assistant's input): kept at every step, read back at the next step's proposal."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[int, torch.Tensor]] = {}   # request -> (first position, rows)

    def keep(self, order: list[str], query_lens: list[int], positions: torch.Tensor, hidden: torch.Tensor) -> None:
        start, first = 0, positions.tolist()
        for rid, n in zip(order, query_lens):
            self.rows[rid] = (first[start], hidden[start:start + n])
            start += n
        for rid in [r for r in self.rows if r not in set(order)]:
            del self.rows[rid]   # not in this step: preempted, finished or waiting

    def at(self, req_id: str | None, position: int) -> torch.Tensor | None:
        """The request's hidden row at ``position``, or None where its last step had none."""
        kept = self.rows.get(req_id) if req_id is not None else None
        if kept is None or not kept[0] <= position < kept[0] + kept[1].shape[0]:
            return None
        return kept[1][position - kept[0]]


class Proposer(Protocol):
    # True: the proposer keeps a KV cache of its own that must see every token the
    # target computes (``sync`` runs on each step's batch).
    needs_sync: bool

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]: ...

    def sync(self, input_ids: torch.Tensor, positions: torch.Tensor, metas: Sequence[AttentionMetadata]) -> None:
        """See the step's batch; ``metas``: its attention metadata per KV group."""


class ModelDraftProposer:
    """A draft model decodes greedily, one batched forward per draft position.

    layer_skip: ``model`` is the target itself, run through its first ``num_layers``
    layers (then the final norm and the LM head), and ``kv_caches`` are the target's
    caches of those layers. Those layers' K/V at a position depend only on the tokens up
    to it, so for every computed position the target already wrote exactly the K/V the
    draft needs: nothing to keep in sync. The draft writes K/V only at the request's
    uncomputed positions (its last known token and its drafts), into slots the scheduler
    allocated for this step; the target's verification forward then rewrites every one
    of them (all layers write a step's new K/V before attention reads), and slots of
    rejected drafts are rewritten when real tokens reach those positions.

    ``layer_group``: the KV group of each of those layers (their block tables);
    ``group_chunks``: per group its attention chunk (None: not chunked; none if empty).

    draft_model: a separate model with caches of its own over the same block ids;
    ``sync`` runs it on every step's batch so its cache holds every computed position,
    prefix-cache hits included (a cached block was computed, and synced, by some step).
    It reads the target's first KV group's tables (a global group, if the target has one).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        num_layers: int | None = None,
        needs_sync: bool = False,
        layer_group: Sequence[int] | None = None,
        group_chunks: Sequence[int | None] = (),
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.num_layers = num_layers
        self.needs_sync = needs_sync
        self.layer_group = tuple(layer_group) if layer_group is not None else None
        self.group_chunks = tuple(group_chunks)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metas: Sequence[AttentionMetadata]) -> torch.Tensor:  # fmt: skip
        meta = metas[0] if self.layer_group is None else [metas[g] for g in self.layer_group]
        return self.model(input_ids, positions, self.kv_caches, meta, num_layers=self.num_layers)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        last = [r.token_ids[-1] for r in requests]
        for j in range(max((r.num_drafts for r in requests), default=0)):
            active = [i for i, r in enumerate(requests) if r.num_drafts > j]
            # Request i's input at step j sits at position len(tokens) - 1 + j.
            ctx = [len(requests[i].token_ids) - 1 + j for i in active]
            groups = range(max(self.layer_group or (0,)) + 1)
            metas = []
            for g in groups:
                lens = ([1] * len(active), ctx, [requests[i].block_ids[g] for i in active])
                if self.group_chunks and self.group_chunks[g] is not None:
                    lens = chunk_requests(*lens, self.group_chunks[g], self.block_size)
                metas.append(AttentionMetadata.build(*lens, self.block_size, self.device))
            hidden = self._forward(
                torch.tensor([last[i] for i in active], dtype=torch.long, device=self.device),
                torch.tensor(ctx, dtype=torch.long, device=self.device),
                metas,
            )
            next_ids = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for i, token in zip(active, next_ids):
                drafts[i].append(token)
                last[i] = token
        return drafts

    @torch.inference_mode()
    def sync(self, input_ids: torch.Tensor, positions: torch.Tensor, metas: Sequence[AttentionMetadata]) -> None:
        if self.needs_sync:
            self._forward(input_ids, positions, metas)
