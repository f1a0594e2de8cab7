"""Per-request block tables on top of the block pool, with prefix lookup."""

from __future__ import annotations

from typing import Sequence

from pagoda.core.block_hash import BlockHash, hash_request_blocks, request_extra_keys
from pagoda.core.block_pool import BlockPool, KVCacheBlock
from pagoda.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The block id a request's table shows for a block released outside its sliding window:
# any valid id (the window's attention never reads it, nothing writes it).
RELEASED_BLOCK_ID = 0


class KVCacheManager:
    """Owns every request's block table.

    The scheduler asks three things of it: which prefix of a new request is
    already cached (``get_computed_blocks``), room for the tokens a step will
    compute (``allocate_slots``, None when the pool is full) and to give a
    request's blocks back (``free``).

    ``sliding_window`` (a model whose every layer attends to at most that many
    positions): once a request's next position is past a block's last key any query
    can see, the block goes back to the pool (keeping its prefix-cache hash) and the
    table holds None there. E.g. window 4, blocks of 2, computing position 9: keys
    from 6 on are needed, so blocks 0-2 (positions 0-5) are released.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        # Leading blocks of each request released outside the window (None in its table).
        self.num_released: dict[str, int] = {}
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request were offered to the prefix map.
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache counters in tokens, for metrics.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_hashes(self, request: Request) -> list[BlockHash]:
        extra = request_extra_keys(request.cache_salt, request.lora_int_id)
        # The blocks of a declared shared prefix stay unsalted (pagoda/shared_prefix.py),
        # but never across LoRA adapters: an adapter changes K/V from the first token.
        salt_at = 0 if request.lora_int_id else request.num_shared_prefix_tokens // self.block_size
        return hash_request_blocks(
            request.all_token_ids, self.block_size, request.block_hashes, extra, salt_at
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request that holds no blocks yet.

        At least one token is always left to compute, because the step must
        produce logits at the last position: a 32-token prompt fully cached in
        blocks of 16 hits only its first block, and recomputes tokens 16..31.
        """
        if not self.enable_caching:
            return [], 0
        hashes = self.block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not every retry of a blocked one)."""
        if self.enable_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request`` (after
        adopting ``new_computed_blocks`` from a prefix hit). Returns the newly
        allocated blocks, or None, changing nothing, if the pool is too small.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks and blocks:
            raise RuntimeError("prefix hits can only be adopted by a request without blocks")
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total = num_computed + num_new_tokens
        num_needed = cdiv(num_total, self.block_size) - len(blocks) - len(new_computed_blocks)
        # Hit blocks that sit in the free queue stop being allocatable.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_revived:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(new_blocks)
        if self.enable_caching:
            # Blocks become valid during this step's forward, which writes each
            # layer's new K/V before any attention reads, so another request
            # scheduled in the same step may already share them. Only known
            # tokens count: slots for speculative drafts beyond num_tokens are
            # unverified and never registered.
            self._cache_full_blocks(request, min(num_total, request.num_tokens))
        if self.sliding_window is not None:
            self._release_outside_window(request.request_id, num_computed)
        return new_blocks

    def _release_outside_window(self, rid: str, first_query: int) -> None:
        """Blocks wholly before the first key the step's first query sees (position
        first_query - window + 1) go back to the pool; they are full, so already cached."""
        blocks = self.req_to_blocks[rid]
        start = self.num_released.get(rid, 0)
        end = min(max(0, first_query - self.sliding_window + 1) // self.block_size, len(blocks))
        if end <= start:
            return
        self.pool.free_blocks(reversed(blocks[start:end]))
        blocks[start:end] = [None] * (end - start)
        self.num_released[rid] = end

    def trim(self, request: Request) -> int:
        """Free the blocks past the request's computed tokens (slots of rejected
        speculative drafts). They hold no registered hash: only blocks full of
        known tokens are registered. Returns how many were freed.

        E.g. block_size 4, 4 blocks held, 9 tokens computed -> 3 kept, 1 freed.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return 0
        keep = cdiv(request.num_computed_tokens, self.block_size)
        tail = blocks[keep:]
        if not tail:
            return 0
        del blocks[keep:]
        self.pool.free_blocks(reversed(tail))
        return len(tail)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        num_full = num_tokens // self.block_size
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request)
        blocks = self.req_to_blocks[rid]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free_blocks(reversed([b for b in blocks if b is not None]))
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_released.pop(request.request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [RELEASED_BLOCK_ID if b is None else b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        ref_counts: dict[int, int] = {}
        for rid, blocks in self.req_to_blocks.items():
            released = self.num_released.get(rid, 0)
            if any(b is None for b in blocks[released:]) or any(b is not None for b in blocks[:released]):
                raise AssertionError(f"request {rid}: released blocks are not its first {released}")
            ids = [b.block_id for b in blocks[released:]]
            if len(ids) != len(set(ids)):
                raise AssertionError(f"request {rid} holds a block twice")
            for block_id in ids:
                ref_counts[block_id] = ref_counts.get(block_id, 0) + 1
        self.pool.check_integrity(ref_counts)
        for rid, n in self.num_cached_blocks.items():
            if n > len(self.req_to_blocks.get(rid, [])):
                raise AssertionError(f"request {rid} cached more blocks than it holds")
        if set(self.num_released) - set(self.req_to_blocks):
            raise AssertionError("released-block counts of requests without blocks")
