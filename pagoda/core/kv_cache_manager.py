"""Per-request block tables on top of the block pool, with prefix lookup."""

from __future__ import annotations

from typing import Callable, Sequence

from pagoda.core.block_hash import BlockHash, hash_request_blocks, request_extra_keys
from pagoda.core.block_pool import BlockPool, KVCacheBlock
from pagoda.core.kv_layout import cdiv
from pagoda.core.request import Request

__all__ = ["KVCacheManager", "RELEASED_BLOCK_ID", "block_ids_of", "cdiv"]

# The block id a request's table shows for a block released outside its sliding window:
# any valid id (the window's attention never reads it, nothing writes it).
RELEASED_BLOCK_ID = 0

# One group's entries of a request's table: None where a block was released (or never
# needed) behind the group's window.
Table = list[KVCacheBlock | None]


def block_ids_of(tables: Sequence[Table]) -> list[list[int]]:
    """Per group, table entries as block ids (RELEASED_BLOCK_ID for released ones)."""
    return [[RELEASED_BLOCK_ID if b is None else b.block_id for b in t] for t in tables]


class KVCacheManager:
    """Owns every request's block tables.

    The scheduler asks three things of it: which prefix of a new request is
    already cached (``get_computed_blocks``), room for the tokens a step will
    compute (``allocate_slots``, None when the pool is full) and to give a
    request's blocks back (``free``).

    ``group_windows``: one block table per KV group (``pagoda/core/kv_layout.py``), each
    with its window (None: global attention), all over one pool; the default is one group
    with ``sliding_window``. A request's tables are index-aligned (entry i of every group
    covers the same positions). In a windowed group, once a request's next position is
    past a block's last key any query can see, the block goes back to the pool (keeping
    its prefix-cache hash) and the table holds None there. E.g. window 4, blocks of 2,
    computing position 9: keys from 6 on are needed, so blocks 0-2 (positions 0-5) are
    released, and a step that starts past a block's keys never allocates it at all.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None,
                 group_windows: Sequence[int | None] | None = None) -> None:  # fmt: skip
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if group_windows is None:
            group_windows = (sliding_window,)
        elif sliding_window is not None:
            raise ValueError("pass sliding_window or group_windows, not both")
        if not group_windows:
            raise ValueError("at least one KV group is needed")
        for w in group_windows:
            if w is not None and w < 1:
                raise ValueError(f"sliding_window must be >= 1, got {w}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self.pool = BlockPool(num_blocks, enable_caching)
        # Per request, per group: its table.
        self.req_to_blocks: dict[str, list[Table]] = {}
        # Per request, per group: how many leading entries are released (None).
        self.num_released: dict[str, list[int]] = {}
        # How many leading blocks of each request were offered to the prefix map.
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache counters in tokens, for metrics.
        self.prefix_queries = 0
        self.prefix_hits = 0
        # A hybrid model's: whether a hit may end at the block of this hash (a saved state
        # there, pagoda/core/state_pool.py's StateCheckpoints); None: at any block.
        self.hit_filter: Callable[[BlockHash], bool] | None = None

    @property
    def sliding_window(self) -> int | None:
        """The window of a one-group manager (None: global, or several groups)."""
        return self.group_windows[0] if self.num_groups == 1 else None

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
            request.all_token_ids, self.block_size, request.block_hashes, extra, salt_at,
            [(m.offset, m.end, m.hash) for m in request.mm_inputs],
        )

    @staticmethod
    def _key(group: int, block_hash: BlockHash):
        """A block's key in the prefix map: its hash, told apart per group (group 0's
        blocks, the only group of most models, are keyed by the hash itself)."""
        return block_hash if group == 0 else (group, block_hash)

    def _first_needed(self, group: int, first_query: int) -> int:
        """The first block of ``group`` a step whose first query is at ``first_query``
        reads: 0 for a global group, the block of position first_query - window + 1."""
        w = self.group_windows[group]
        return 0 if w is None else max(0, first_query - w + 1) // self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[Table], int]:
        """The longest cached prefix of a request that holds no blocks yet: per group, the
        hit blocks (None for blocks a windowed group does not need), and the tokens hit.

        At least one token is always left to compute, because the step must
        produce logits at the last position: a 32-token prompt fully cached in
        blocks of 16 hits only its first block, and recomputes tokens 16..31.
        A global group needs every block of the prefix cached; a windowed group only
        those the first query past the prefix sees.
        """
        none: tuple[list[Table], int] = ([[] for _ in self.group_windows], 0)
        if not self.enable_caching:
            return none
        hashes = self.block_hashes(request)
        limit = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        get = self.pool.get_cached_block
        cached: dict[int, Table] = {}
        for g, w in enumerate(self.group_windows):
            if w is None:   # global groups first: the prefix they all hold bounds the hit
                row: Table = []
                for h in hashes[:limit]:
                    if (b := get(self._key(g, h))) is None:
                        break
                    row.append(b)
                cached[g] = row
                limit = len(row)
        for g, w in enumerate(self.group_windows):
            if w is not None:
                cached[g] = [get(self._key(g, h)) for h in hashes[:limit]]
        # The longest hit n whose every windowed group holds blocks [first needed, n):
        # runs[g][i] = how many blocks up to i are cached in a row.
        runs = {}
        for g, w in enumerate(self.group_windows):
            if w is not None:
                run, runs[g] = 0, []
                for b in cached[g]:
                    run = run + 1 if b is not None else 0
                    runs[g].append(run)
        n = limit
        while n and not all(r[n - 1] >= n - self._first_needed(g, n * self.block_size) for g, r in runs.items()):
            n -= 1
        if self.hit_filter is not None:
            while n and not self.hit_filter(hashes[n - 1]):
                n -= 1
        if n == 0:
            return none
        hits = [cached[g][:n] if w is None else
                [None] * (k := self._first_needed(g, n * self.block_size)) + cached[g][k:n]
                for g, w in enumerate(self.group_windows)]  # fmt: skip
        return hits, n * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not every retry of a blocked one)."""
        if self.enable_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock | None]] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[Table] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request`` (after adopting
        ``new_computed_blocks``, per group, from a prefix hit). Returns per group the new
        table entries (None where a windowed group skips a block the step never reads),
        or None, changing nothing, if the pool is too small.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        rid = request.request_id
        hits = list(new_computed_blocks) or [() for _ in self.group_windows]
        if len(hits) != self.num_groups:
            raise ValueError(f"prefix hits for {len(hits)} KV groups, the cache has {self.num_groups}")
        tables = self.req_to_blocks.get(rid)
        if tables is None:
            tables = [[] for _ in self.group_windows]
        elif any(hits):
            raise RuntimeError("prefix hits can only be adopted by a request without blocks")
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total = num_computed + num_new_tokens
        num_table = cdiv(num_total, self.block_size)
        # Per group: the entries to add, and how many of them are skipped behind the window.
        adds = [max(0, num_table - len(t) - len(h)) for t, h in zip(tables, hits)]
        skips = [min(a, max(0, self._first_needed(g, num_computed) - len(t) - len(h)))
                 for g, (a, t, h) in enumerate(zip(adds, tables, hits))]  # fmt: skip
        num_needed = sum(adds) - sum(skips)
        # Hit blocks that sit in the free queue stop being allocatable.
        num_revived = sum(1 for h in hits for b in h if b is not None and b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_revived:
            return None
        self.req_to_blocks[rid] = tables
        released = self.num_released.setdefault(rid, [0] * self.num_groups)
        # Every group's hits leave the free queue before any group takes new blocks from it.
        for hit in hits:
            self.pool.touch(b for b in hit if b is not None)
        new: list[Table] = []
        for g, (table, hit, add, skip) in enumerate(zip(tables, hits, adds, skips)):
            table.extend(hit)
            entries: Table = [None] * skip
            entries.extend(self.pool.get_new_blocks(add - skip))
            table.extend(entries)
            new.append(entries)
            while released[g] < len(table) and table[released[g]] is None:
                released[g] += 1
        if self.enable_caching:
            # Blocks become valid during this step's forward, which writes each
            # layer's new K/V before any attention reads, so another request
            # scheduled in the same step may already share them. Only known
            # tokens count: slots for speculative drafts beyond num_tokens are
            # unverified and never registered.
            self._cache_full_blocks(request, min(num_total, request.num_tokens))
        for g, w in enumerate(self.group_windows):
            if w is not None:
                self._release_outside_window(rid, g, num_computed)
        return new

    def _release_outside_window(self, rid: str, group: int, first_query: int) -> None:
        """Blocks wholly before the first key the step's first query sees (position
        first_query - window + 1) go back to the pool; they are full, so already cached."""
        table = self.req_to_blocks[rid][group]
        released = self.num_released[rid]
        start, end = released[group], min(self._first_needed(group, first_query), len(table))
        if end <= start:
            return
        self.pool.free_blocks(reversed([b for b in table[start:end] if b is not None]))
        table[start:end] = [None] * (end - start)
        released[group] = end

    def trim(self, request: Request) -> int:
        """Free the blocks past the request's computed tokens (slots of rejected
        speculative drafts). They hold no registered hash: only blocks full of
        known tokens are registered. Returns how many were freed.

        E.g. block_size 4, 4 blocks held, 9 tokens computed -> 3 kept, 1 freed.
        """
        tables = self.req_to_blocks.get(request.request_id)
        if not tables:
            return 0
        keep = cdiv(request.num_computed_tokens, self.block_size)
        freed = 0
        for table in tables:
            tail = [b for b in table[keep:] if b is not None]
            del table[keep:]
            self.pool.free_blocks(reversed(tail))
            freed += len(tail)
        return freed

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        num_full = num_tokens // self.block_size
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request)
        for g, table in enumerate(self.req_to_blocks[rid]):
            for i in range(start, num_full):
                if table[i] is not None:
                    self.pool.cache_block(table[i], self._key(g, hashes[i]))
        self.num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        for table in reversed(self.req_to_blocks.pop(request.request_id, [])):
            self.pool.free_blocks(reversed([b for b in table if b is not None]))
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_released.pop(request.request_id, None)

    def num_table_blocks(self, request_id: str) -> int:
        """The length of the request's tables (released entries included)."""
        tables = self.req_to_blocks.get(request_id)
        return len(tables[0]) if tables else 0

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """Per group, the request's table as block ids (released entries show RELEASED_BLOCK_ID)."""
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return [[] for _ in self.group_windows]
        return block_ids_of(tables)

    def live_blocks(self, request_id: str, num_entries: int) -> list[tuple[int, int, int]]:
        """(group, table index, block id) of the request's held blocks among its first
        ``num_entries`` table entries: what swap preemption copies out."""
        return [(g, i, b.block_id)
                for g, table in enumerate(self.req_to_blocks.get(request_id, []))
                for i, b in enumerate(table[:num_entries]) if b is not None]  # fmt: skip

    def block_at(self, request_id: str, group: int, index: int) -> int | None:
        """The block id at ``index`` of a group's table, None if released or absent."""
        table = self.req_to_blocks[request_id][group]
        b = table[index] if index < len(table) else None
        return None if b is None else b.block_id

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        ref_counts: dict[int, int] = {}
        for rid, tables in self.req_to_blocks.items():
            if len(tables) != self.num_groups or len({len(t) for t in tables}) != 1:
                raise AssertionError(f"request {rid}: tables of {[len(t) for t in tables]} entries")
            released = self.num_released.get(rid, [0] * self.num_groups)
            held: list[int] = []
            for g, (table, r) in enumerate(zip(tables, released)):
                if any(b is None for b in table[r:]) or any(b is not None for b in table[:r]):
                    raise AssertionError(f"request {rid}: released blocks of group {g} are not its first {r}")
                if r and self.group_windows[g] is None:
                    raise AssertionError(f"request {rid}: a global group released blocks")
                held.extend(b.block_id for b in table[r:])
            if len(held) != len(set(held)):
                raise AssertionError(f"request {rid} holds a block twice")
            for block_id in held:
                ref_counts[block_id] = ref_counts.get(block_id, 0) + 1
        self.pool.check_integrity(ref_counts)
        for rid, n in self.num_cached_blocks.items():
            if n > self.num_table_blocks(rid):
                raise AssertionError(f"request {rid} cached more blocks than it holds")
        if set(self.num_released) - set(self.req_to_blocks):
            raise AssertionError("released-block counts of requests without blocks")
