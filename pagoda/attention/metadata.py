"""The attention metadata of one step: what every layer's attention reads, built once.

The model runner puts the batch in order: all decode requests (one new token
each) first, then requests computing a chunk of prompt. Per layer, the new
K/V of every token are written into their cache slots first, then
attention reads each request's whole context from the cache. Writing first is
what lets a request reuse prefix blocks that another request in the same
step is computing.

``AttentionMetadata.build`` makes the metadata of the torch and CPU backends
(``pagoda/attention/torch_ref.py``, ``cpu.py``): the gather index (slot of every
context position) and masks, or, for the CPU's in-place decode kernel, the decodes'
block tables and lengths. Other backends subclass it with their own fields
(``pagoda/attention/triton.py``); ``backend`` names the one that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch


@dataclass
class PrefillChunk:
    token_start: int            # offset of this request's tokens in the flat batch
    query_len: int
    context_len: int            # tokens before this chunk (prefix hit + earlier chunks)
    gather_slots: torch.Tensor  # [context_len + query_len] slot of every position
    mask: torch.Tensor | None   # [query_len, seq_len] bool, None = plain causal
    # window -> (first key position read, mask over keys from there), built on first use
    windows: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # Position spans [start, end) attended in both directions (``open_spans``).
    spans: list[tuple[int, int]] = field(default_factory=list)

    def _mask(self, first: int, window: int | None = None) -> torch.Tensor:
        """[query_len, keys from position ``first``]: causal, within ``window``, and open
        within each of ``spans``."""
        seq = self.context_len + self.query_len
        keys = torch.arange(first, seq)[None, :]
        queries = torch.arange(self.context_len, seq)[:, None]
        mask = keys <= queries
        for s, e in self.spans:
            mask |= (queries >= s) & (queries < e) & (keys >= s) & (keys < e)
        if window is not None:
            mask &= keys > queries - window
        return mask.to(self.gather_slots.device)

    def open_spans(self, spans: Sequence[tuple[int, int]]) -> None:
        """Bidirectional attention within each span of positions [start, end) (Gemma 3's
        images): a query inside one also sees the span's later keys; causal elsewhere. A
        span must end within this chunk (the scheduler never ends a chunk inside one); it
        may begin before it (its earlier part cached)."""
        seq = self.context_len + self.query_len
        mine = [(s, e) for s, e in spans if s < seq and e > self.context_len]
        for s, e in mine:
            if e > seq:
                raise ValueError(f"a bidirectional span [{s}, {e}) ends past the chunk's last position {seq - 1}")
        if not mine:
            return
        self.spans = mine
        self.mask = self._mask(0)
        self.windows.clear()

    def window_view(self, window: int) -> tuple[int, torch.Tensor] | None:
        """For a windowed layer: (first key position any query sees, [query_len, keys]
        mask), or None when the window covers the whole context."""
        seq = self.context_len + self.query_len
        if seq <= window:
            return None
        if window not in self.windows:
            start = max(0, self.context_len - window + 1)
            self.windows[window] = (start, self._mask(start, window))
        return self.windows[window]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor             # [T] slot each new token's K/V goes to
    num_decodes: int                       # the first num_decodes tokens are decodes
    decode_gather_slots: torch.Tensor | None  # [D, L] slots of each decode's context, padded
    decode_mask: torch.Tensor | None       # [D, 1, 1, L] True where a position is valid
    prefills: list[PrefillChunk]
    # For the in-place decode kernel (None when the gather path is used):
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] int32
    decode_seq_lens: torch.Tensor | None = None      # [D] int32, context + 1
    decode_windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # The backend whose forward reads this metadata; None: the torch path (the CPU kernel
    # for decodes where decode_block_tables is set), as ``build`` alone makes it.
    backend: Any = None   # an AttentionBackend (pagoda/attention/backend.py, which imports this module)
    # Hybrid models: the step's plan for their state layers (pagoda/attention/state.py); None
    # for models without state layers.
    states: Any = None

    def open_spans(self, spans: dict[int, list[tuple[int, int]]]) -> None:
        """Bidirectional spans of positions per request (its index in the step, decodes
        first): each prefill chunk's mask opened over them (``PrefillChunk.open_spans``); a
        decode, the span's last position, already sees all of it."""
        for i, request_spans in spans.items():
            if i >= self.num_decodes:
                self.prefills[i - self.num_decodes].open_spans(request_spans)

    def decode_view(self, window: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The gather path's decode (slots, mask), narrowed to a window: positions before
        it re-read the last position (a written slot, as padding does: their blocks may
        have been released and reused) and are masked out."""
        if window is None or self.decode_mask is None:
            return self.decode_gather_slots, self.decode_mask
        if window not in self.decode_windows:
            slots = self.decode_gather_slots
            seq = self.decode_mask[:, 0, 0, :].sum(-1, keepdim=True)
            p = torch.arange(slots.shape[1], device=slots.device)[None, :]
            inside = p >= seq - window
            last = slots.gather(1, seq - 1)
            self.decode_windows[window] = (torch.where(inside, slots, last),
                                           self.decode_mask & inside[:, None, None, :])
        return self.decode_windows[window]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
        decode_kernel: bool = False,
    ) -> AttentionMetadata:
        """Per request (decodes first): tokens this step, tokens already in
        the cache, and its block table. Vectorised: Python work is per
        request, never per token.

        E.g. block_size=4, block table [7, 2], context 5, query 1: the new token
        sits at position 5 -> slot 2*4 + 1 = 9; its context positions 0..5 map
        to slots [28, 29, 30, 31, 8, 9].
        """
        n = len(query_lens)
        num_decodes = 0
        while num_decodes < n and query_lens[num_decodes] == 1:
            num_decodes += 1
        max_blocks = max(len(t) for t in block_tables)
        if num_decodes == n and decode_kernel:
            # A decode-only step for the kernel (the common one): a few integers per request,
            # without the tensor arithmetic below (the same values).
            slots = [t[c // block_size] * block_size + c % block_size for t, c in zip(block_tables, context_lens)]
            return cls(
                slot_mapping=torch.tensor(slots, dtype=torch.long).to(device),
                num_decodes=n, decode_gather_slots=None, decode_mask=None, prefills=[],
                decode_block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables],
                                                 dtype=torch.int32),
                decode_seq_lens=torch.tensor([c + 1 for c in context_lens], dtype=torch.int32),
            )
        table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.long)
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        ctx = torch.tensor(context_lens, dtype=torch.long)
        # Each new token's request and position: [2, 1] with ctx [5, 0] -> positions [5, 6, 0].
        owner = torch.repeat_interleave(torch.arange(n), q_lens)
        first = torch.cumsum(q_lens, 0) - q_lens
        pos = torch.arange(int(q_lens.sum())) - first[owner] + ctx[owner]
        slot_mapping = table[owner, pos // block_size] * block_size + pos % block_size

        decode_gather = decode_mask = decode_tables = decode_lens = None
        if num_decodes and decode_kernel:
            decode_tables = table[:num_decodes].to(torch.int32)
            decode_lens = (ctx[:num_decodes] + 1).to(torch.int32)
        elif num_decodes:
            seq = ctx[:num_decodes] + 1
            p = torch.arange(int(seq.max()))
            # Padded positions re-read the request's own last position and are masked
            # out. They must read a written slot: the tail of a block (or the cache's
            # uninitialised memory) may hold NaN, and a masked NaN still poisons SDPA
            # (its weight is 0, but 0 * NaN = NaN).
            padded = torch.minimum(p[None, :], seq[:, None] - 1)
            rows = torch.arange(num_decodes)[:, None]
            decode_gather = table[rows, padded // block_size] * block_size + padded % block_size
            decode_mask = (p[None, :] < seq[:, None])[:, None, None, :].to(device)
            decode_gather = decode_gather.to(device)
        prefills: list[PrefillChunk] = []
        for i in range(num_decodes, n):
            q_len, ctx_len = query_lens[i], context_lens[i]
            seq_len = ctx_len + q_len
            p = torch.arange(seq_len)
            slots = table[i, p // block_size] * block_size + p % block_size
            mask = None
            if ctx_len > 0:
                # Query j sits at position ctx_len + j and sees keys 0..ctx_len + j.
                mask = (p[None, :] <= p[ctx_len:, None]).to(device)
            prefills.append(PrefillChunk(int(first[i]), q_len, ctx_len, slots.to(device), mask))
        return cls(
            slot_mapping=slot_mapping.to(device),
            num_decodes=num_decodes,
            decode_gather_slots=decode_gather,
            decode_mask=decode_mask,
            prefills=prefills,
            decode_block_tables=decode_tables,
            decode_seq_lens=decode_lens,
        )


def chunk_requests(query_lens: Sequence[int], context_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                   chunk: int, block_size: int) -> tuple[list[int], list[int], list[list[int]]]:
    """A chunked-attention group's step as causal attention over shorter sequences: each
    request's queries split where a chunk of positions ends, each piece a sequence of its
    own whose context starts at its chunk (its block table from the chunk's first block:
    ``chunk`` is a multiple of ``block_size``). The pieces keep the requests' order, so
    their tokens stay where they are in the batch; a decode stays one decode.

    E.g. chunk 16, blocks of 8: a request with 12 cached tokens and 10 new ones, table
    [a, b, c]: pieces (query 4, context 12, [a, b, c]) and (query 6, context 0, [c])."""
    if chunk % block_size:
        raise ValueError(f"attention chunk {chunk} is not a multiple of the block size {block_size}")
    q_out: list[int] = []
    c_out: list[int] = []
    t_out: list[list[int]] = []
    for q, c, table in zip(query_lens, context_lens, block_tables):
        pos, end = c, c + q
        while pos < end:
            start = pos // chunk * chunk
            stop = min(end, start + chunk)
            q_out.append(stop - pos)
            c_out.append(pos - start)
            t_out.append(list(table[start // block_size:]) if start else list(table))
            pos = stop
    return q_out, c_out, t_out


def layer_metadata(build: Callable[..., AttentionMetadata], query_lens: list[int], context_lens: list[int],
                   block_tables: list[list[int]], block_size: int, device: torch.device,
                   layer_chunks: Sequence[int | None]) -> AttentionMetadata | list[AttentionMetadata]:
    """A step over one block table per request shared by every layer (a calibration pass,
    a test's forward): one metadata, or where some layers attend in chunks, one per layer
    (those layers' over the requests split at chunk boundaries). ``build``: a backend's,
    or ``AttentionMetadata.build``."""
    if all(c is None for c in layer_chunks):
        return build(query_lens, context_lens, block_tables, block_size, device)
    metas: dict[int | None, AttentionMetadata] = {}
    for c in set(layer_chunks):
        lens = (query_lens, context_lens, block_tables)
        if c is not None:
            lens = chunk_requests(query_lens, context_lens, block_tables, c, block_size)
        metas[c] = build(*lens, block_size, device)
    return [metas[c] for c in layer_chunks]
