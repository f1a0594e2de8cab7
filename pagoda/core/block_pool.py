"""The pool of physical KV blocks: ref counts, an LRU free queue, the prefix map.

Every block is in exactly one of two states:
- in use: ref_cnt > 0, held by one or more requests' block tables;
- free: ref_cnt == 0, linked into the free queue. A free block may still
  carry a hash (its KV is still valid and can be revived by a prefix hit);
  it loses the hash only when it is handed out again (eviction).

The free queue is an intrusive doubly linked list, so a prefix hit on a free
block removes it from the queue in O(1), and the head is always the least
recently freed block: eviction is LRU for free.
"""

from __future__ import annotations

from typing import Iterable

from pagoda.core.block_hash import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise RuntimeError("no free blocks")
        self.remove(first)
        return first

    def __iter__(self):
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def contains(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # Counters for metrics.
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found by a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full, computed block under its prefix hash.

        If another block already holds this hash (two requests computed the
        same prefix at once), the first one stays the canonical copy; this one
        is simply not registered.
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block. Pass a request's blocks in
        reverse order, so that its tail is evicted before its prefix, which
        other requests are more likely to share."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    block.block_hash = None
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def check_integrity(self, ref_counts: dict[int, int] | None = None) -> None:
        """Assert the pool's invariants; ``ref_counts`` (block id -> number of
        block tables holding it) lets the KV manager check ownership too."""
        in_queue = list(self.free_queue)
        ids = [b.block_id for b in in_queue]
        if len(ids) != len(set(ids)):
            raise AssertionError("a block appears twice in the free queue")
        if len(in_queue) != self.free_queue.num_free_blocks:
            raise AssertionError("free queue length does not match its counter")
        free_ids = set(ids)
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise AssertionError(f"negative ref count: {block}")
            if (block.ref_cnt == 0) != (block.block_id in free_ids):
                raise AssertionError(f"ref count and free queue disagree: {block}")
            if ref_counts is not None and ref_counts.get(block.block_id, 0) != block.ref_cnt:
                raise AssertionError(
                    f"{block} is held by {ref_counts.get(block.block_id, 0)} block tables"
                )
            if block.block_hash is not None:
                if self.cached_blocks.get(block.block_hash) is not block:
                    raise AssertionError(f"hashed block missing from the prefix map: {block}")
        for block_hash, block in self.cached_blocks.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"prefix map entry points at a block with another hash: {block}")
        if not self.enable_caching and self.cached_blocks:
            raise AssertionError("prefix map not empty with caching disabled")
