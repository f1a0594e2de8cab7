"""Decode-only steps replayed from graphs captured at start-up, one per padded batch size.

A decode step of the eager model is hundreds of small kernel launches, each paid for in
Python and in the driver; a captured CUDA graph replays them all in one call. Every graph
reads the same static buffers (token ids, positions, and per KV group the slot mapping,
block tables and sequence lengths), so a replay is: copy the step's inputs into those
buffers, pad the rest of the bucket, replay the bucket's graph, read the hidden states.

Padding: a step of 3 decodes replays the graph of 4; row 3 gets token 0 at position 0, slot
-1 (the store kernel skips it: no cache block is touched) and sequence length 0 (the decode
kernel writes zeros for it), and its hidden state is never read.

Nothing in the captured region may allocate from outside the graph's pool, synchronise
with the host or branch on data: the Triton backend's metadata is built over the static
buffers with a fixed split-KV count per bucket, and its split-KV scratch is reserved
before the first capture. Steps with prompt tokens, steps larger than the largest bucket
and models whose forward cannot be captured run eagerly.

``capture`` is pluggable: ``CudaGraphCapture`` on a GPU; on the CPU, tests use
``RecordingCapture``, which records the callable and re-runs it on the static buffers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:   # (imported when graphs are made: it imports triton)
    from pagoda.attention.triton import TritonBackend, TritonMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """vLLM's buckets: 1, 2, 4, then every multiple of 8 up to ``max_batch`` (and
    ``max_batch`` itself). E.g. 20 -> [1, 2, 4, 8, 16, 20]."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch] + list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class GraphCapture(Protocol):
    def capture(self, fn: Callable[[], None]) -> object: ...
    def replay(self, graph: object) -> None: ...


class CudaGraphCapture:
    """torch.cuda graphs sharing one memory pool (captured largest first, so the smaller
    ones reuse the larger's memory)."""

    def __init__(self) -> None:
        self.pool = None

    def capture(self, fn: Callable[[], None]) -> object:
        # Warm-up outside the graph: Triton compiles its kernels, cuBLAS picks its plans.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph

    def replay(self, graph: object) -> None:
        graph.replay()


class RecordingCapture:
    """The CPU stand-in: capture runs the callable once (as the warm-up does) and records
    it; replay runs it again over the same static buffers."""

    def __init__(self) -> None:
        self.captured: list[Callable[[], None]] = []
        self.replays = 0

    def capture(self, fn: Callable[[], None]) -> object:
        fn()
        self.captured.append(fn)
        return fn

    def replay(self, graph: object) -> None:
        self.replays += 1
        graph()


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list, backend: TritonBackend, layer_group: Sequence[int],
                 num_groups: int, max_batch: int, max_blocks: int, block_size: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, device: torch.device, capture: GraphCapture) -> None:  # fmt: skip
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.layer_group = list(layer_group)
        self.num_groups = num_groups
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks = max_blocks
        self.capturer = capture
        self.device = device
        b = self.max_batch
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slots = [torch.full((b,), -1, dtype=torch.long, device=device) for _ in range(num_groups)]
        self.tables = [torch.zeros(b, max_blocks, dtype=torch.int32, device=device) for _ in range(num_groups)]
        self.seq_lens = [torch.zeros(b, dtype=torch.int32, device=device) for _ in range(num_groups)]
        self.output: torch.Tensor | None = None
        from pagoda.attention.triton import num_splits

        # Each bucket's split-KV count, fixed at capture: enough for the longest context.
        self.max_len = max_blocks * block_size
        self.splits = {s: num_splits(s, num_kv_heads, self.max_len, backend.num_sms) for s in self.sizes}
        # Their scratch, allocated once for the largest (the graphs hold its address).
        self.workspace = torch.empty(max(s * num_heads * self.splits[s] * (head_dim + 2) for s in self.sizes),
                                     dtype=torch.float32, device=device)
        self.graphs: dict[int, object] = {}

    def _metas(self, size: int) -> list[TritonMetadata]:
        from pagoda.attention.triton import TritonMetadata

        metas = []
        for g in range(self.num_groups):
            metas.append(TritonMetadata(
                slot_mapping=self.slots[g][:size], num_decodes=size, decode_gather_slots=None, decode_mask=None,
                prefills=[], backend=self.backend, block_tables=self.tables[g][:size],
                seq_lens=self.seq_lens[g][:size], num_prefills=0, max_decode_len=self.max_len,
                num_splits=self.splits[size], workspace=self.workspace,
            ))
        return metas

    def _forward(self, size: int, metas: list[TritonMetadata]) -> torch.Tensor:
        meta = metas[0] if self.num_groups == 1 else [metas[g] for g in self.layer_group]
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)

    def capture_all(self) -> None:
        """Capture every bucket, largest first; logs the time taken and the memory held."""
        start = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        for size in reversed(self.sizes):
            metas = self._metas(size)

            def step(size: int = size, metas: list[TritonMetadata] = metas) -> None:
                hidden = self._forward(size, metas)
                if self.output is None:
                    self.output = torch.empty(self.max_batch, hidden.shape[-1], dtype=hidden.dtype,
                                              device=hidden.device)
                self.output[:size].copy_(hidden)

            self.graphs[size] = self.capturer.capture(step)
        held = (torch.cuda.memory_allocated(self.device) - before) / 2**20 if self.device.type == "cuda" else 0.0
        logger.info("decode graphs: %d batch sizes (%s) captured in %.1f s, %.0f MiB", len(self.sizes),
                    ", ".join(map(str, self.sizes)), time.perf_counter() - start, held)

    def bucket(self, num_decodes: int) -> int | None:
        """The smallest captured size holding ``num_decodes`` rows (None: larger than all)."""
        for size in self.sizes:
            if size >= num_decodes:
                return size
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metas: Sequence[TritonMetadata]) -> torch.Tensor | None:  # fmt: skip
        """The hidden states of a decode-only step ([n, hidden]) from its bucket's graph, or
        None when the step is not one a graph runs (the caller runs it eagerly)."""
        n = input_ids.shape[0]
        size = self.bucket(n)
        if (size is None or size not in self.graphs or any(m.num_decodes != n for m in metas)
                or any(m.block_tables.shape[1] > self.max_blocks for m in metas)):
            return None
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        for g, meta in enumerate(metas):
            width = meta.block_tables.shape[1]
            self.slots[g][:n].copy_(meta.slot_mapping, non_blocking=True)
            self.slots[g][n:size].fill_(-1)
            self.tables[g][:n, :width].copy_(meta.block_tables, non_blocking=True)
            self.seq_lens[g][:n].copy_(meta.seq_lens, non_blocking=True)
            self.seq_lens[g][n:size].zero_()
        self.capturer.replay(self.graphs[size])
        return self.output[:n]
