"""The host-side pool of KV blocks that swap preemption copies requests into.

Bookkeeping only (the runner owns the tensors): a free list of host block ids. A swapped
out request holds its host blocks while it waits; they go back when it is swapped in
(one step later, so that a host block read by this step's swap-in is never the target
of this step's swap-out) or when it ends.
"""

from __future__ import annotations

from collections import deque


class HostBlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Counters for metrics.
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)

    def check_integrity(self, held: list[list[int]]) -> None:
        """``held``: the host blocks of every request (or pending release)."""
        owned = [b for ids in held for b in ids]
        every = owned + list(self._free)
        if len(every) != len(set(every)):
            raise AssertionError("a host block is free and held, or held twice")
        if set(every) != set(range(self.num_blocks)):
            raise AssertionError("host blocks lost or invented")
