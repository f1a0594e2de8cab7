"""How a model's layers share KV block tables and cache memory (vLLM's hybrid allocator).

Layers of one attention type (the same sliding window, or none) can share one block table:
a request's block i holds positions [i * block_size, (i + 1) * block_size) of every layer
in the group. A model whose layers all attend alike (Llama, Qwen3; Mistral, all windowed)
has one group over all its layers. A model that mixes types (Gemma 2: windowed and global
layers alternate; Gemma 3: five windowed to one global) splits them into *groups of equal
size*, each with its own block table per request, all drawing blocks from one pool:

- a global group keeps every block of a request; a windowed group gives back the blocks
  that slide out of its window, so a long request holds few blocks in it;
- the cache memory is ``group_size`` buffers of ``num_blocks`` blocks each, and layer j of
  every group lives in buffer j: block b of buffer j belongs to whichever group's table
  holds b, so one pool of equal-size blocks serves every group.

E.g. Gemma 3 1B, 26 layers, global every sixth (4 global, 22 windowed): groups of 4 layers,
one global group and six windowed ones (the last holds 2 layers; its blocks carry 2 unused
layer slots), 4 buffers. A 4096-token request with a 512-token window holds 256 blocks in
the global group and about 33 in each windowed one: ~456 blocks of 4 layers, against 256
blocks of 26 layers with one table for all (a quarter of the memory).

Layers whose caches differ in shape (Gemma 4: global layers with fewer, wider KV heads than
the windowed ones) never share a buffer: buffer j of each shape class is its own, still
indexed by the one pool's block ids (a block a group of one shape holds leaves its page of
the other shapes' buffers unused: the price of one pool without padded pages).

Chunked local attention (Llama 4: a query sees only the keys of its own chunk of positions)
is a group of its own, windowed by its chunk for the KV manager (no query reads further
back); its attention metadata splits each request's queries at chunk boundaries
(``pagoda.attention.metadata.chunk_requests``), so every backend runs it as causal attention over shorter sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVLayout:
    group_windows: tuple[int | None, ...]   # per group: its window (None = global), globals first
    layer_group: tuple[int, ...]            # per layer: its group
    layer_buffer: tuple[int, ...]           # per layer: its cache buffer
    group_chunks: tuple[int | None, ...] = ()   # per group: its attention chunk (None: not chunked)

    def chunk_of(self, group: int) -> int | None:
        return self.group_chunks[group] if self.group_chunks else None

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_buffers(self) -> int:
        return max(self.layer_buffer) + 1

    @classmethod
    def plan(cls, layer_windows: Sequence[int | None], layer_chunks: Sequence[int | None] | None = None,
             layer_shapes: Sequence[Hashable] | None = None,
             layer_sources: Sequence[int | None] | None = None) -> KVLayout:
        """The groups of layers with per-layer windows ``layer_windows`` (None = global),
        attention chunks ``layer_chunks`` (None: no chunked layer) and cache shapes
        ``layer_shapes`` (None: all alike; layers of different shapes share no buffer). A
        layer with a source in ``layer_sources`` reads that earlier layer's cache (Gemma 4's
        shared KV): it takes its group and buffer and adds none.

        E.g. [None, 8, 8, None, 8, 8] -> groups of 2: (None: layers 0, 3), (8: 1, 2),
        (8: 4, 5); layers 0, 1, 4 in buffer 0 and 3, 2, 5 in buffer 1.
        """
        if not layer_windows:
            raise ValueError("a model without layers has no KV cache")
        if layer_sources is not None and any(src is not None for src in layer_sources):
            own = [i for i, src in enumerate(layer_sources) if src is None]
            pick = (lambda seq: None if seq is None else [seq[i] for i in own])
            base = cls.plan(pick(layer_windows), pick(layer_chunks), pick(layer_shapes))
            group, buffer = dict(zip(own, base.layer_group)), dict(zip(own, base.layer_buffer))
            for i, src in enumerate(layer_sources):
                if src is not None:
                    group[i], buffer[i] = group[src], buffer[src]
            n = len(layer_windows)
            return cls(base.group_windows, tuple(group[i] for i in range(n)), tuple(buffer[i] for i in range(n)),
                       base.group_chunks)
        n = len(layer_windows)
        chunks = list(layer_chunks) if layer_chunks is not None else [None] * n
        shapes = list(layer_shapes) if layer_shapes is not None else [None] * n
        if len(chunks) != n or len(shapes) != n:
            raise ValueError(f"{len(chunks)} chunks and {len(shapes)} shapes for {n} layers")
        # A chunked layer's group: windowed by its chunk (no key further back is read).
        types: dict[tuple[int | None, int | None, Hashable], list[int]] = {}
        for i, (w, c, shape) in enumerate(zip(layer_windows, chunks, shapes)):
            if w is not None and c is not None:
                raise ValueError(f"layer {i} has both a window and an attention chunk")
            types.setdefault((w if c is None else c, c, shape), []).append(i)
        if len(types) == 1:
            ((window, chunk, _), layers), = types.items()
            return cls((window,), (0,) * len(layers), tuple(range(len(layers))),
                       (chunk,) if chunk is not None else ())
        size = min(len(layers) for layers in types.values())
        windows: list[int | None] = []
        group_chunks: list[int | None] = []
        layer_group = [0] * n
        layer_buffer = [0] * n
        buffers: dict[tuple[Hashable, int], int] = {}   # (shape, index in its group) -> buffer
        for window, chunk, shape in sorted(types, key=lambda k: (k[0] is not None, k[0] or 0, k[1] or 0, str(k[2]))):
            layers = types[window, chunk, shape]
            for start in range(0, len(layers), size):
                for j, layer in enumerate(layers[start:start + size]):
                    layer_group[layer] = len(windows)
                    layer_buffer[layer] = buffers.setdefault((shape, j), len(buffers))
                windows.append(window)
                group_chunks.append(chunk)
        return cls(tuple(windows), tuple(layer_group), tuple(layer_buffer),
                   tuple(group_chunks) if any(c is not None for c in group_chunks) else ())

    def blocks_for(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once, when a step
        computes at most ``max_step_tokens`` of its tokens: every block in a global group;
        in a windowed group, those of its window and of the step's tokens."""
        full = cdiv(num_tokens, block_size)
        total = 0
        for w in self.group_windows:
            total += full if w is None else min(full, cdiv(w - 1 + max_step_tokens, block_size) + 1)
        return total

    def max_tokens(self, num_blocks: int, block_size: int, max_step_tokens: int) -> int:
        """The longest request ``num_blocks`` blocks hold (0 if none)."""
        per_block = sum(1 for w in self.group_windows if w is None)
        if per_block == 0:
            # Every group windowed: past the window a request holds a bounded number of blocks.
            bound = self.blocks_for(1 << 62, block_size, max_step_tokens)
            if bound <= num_blocks:
                return 1 << 62
        lo, hi = 0, num_blocks * block_size
        while lo < hi:   # the largest n with blocks_for(n) <= num_blocks
            mid = (lo + hi + 1) // 2
            if self.blocks_for(mid, block_size, max_step_tokens) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

