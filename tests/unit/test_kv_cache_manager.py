"""KVCacheManager: block tables, prefix hits, and a model-based stateful test."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagoda.core.kv_cache_manager import KVCacheManager, cdiv
from pagoda.core.request import Request
from pagoda.sampling_params import SamplingParams

BS = 16


def make_req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(temperature=0, max_tokens=1000), cache_salt=salt)


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None):
    """What the scheduler does on admission. Returns (hit ids, hit tokens, new ids) or None."""
    hits, num_hit = kv.get_computed_blocks(req)
    if num_new is None:
        num_new = req.num_tokens - num_hit
    new = kv.allocate_slots(req, num_new, hits, num_hit)
    if new is None:
        return None
    req.num_computed_tokens = num_hit + num_new
    return [b.block_id for b in hits[0]], num_hit, [b.block_id for b in new[0]]


def decode(kv: KVCacheManager, req: Request, token: int):
    """One decode step: the token sampled last step is computed now."""
    assert req.num_computed_tokens == req.num_tokens
    req.append_output_token(token)
    new = kv.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    return new


def ref_counts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.free_queue]


A_TOKENS = list(range(100, 140))  # 40 tokens: 2 full blocks + 8


def test_cdiv() -> None:
    assert [cdiv(n, 4) for n in range(0, 10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_exact_block_ids_and_prefix_hit() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_req("a", A_TOKENS)
    assert admit(kv, a) == ([], 0, [0, 1, 2])
    assert kv.get_block_ids("a")[0] == [0, 1, 2]
    assert a.num_computed_tokens == 40
    # The two full blocks are registered, the partial third is not.
    assert kv.pool.blocks[0].block_hash is not None
    assert kv.pool.blocks[1].block_hash is not None
    assert kv.pool.blocks[2].block_hash is None
    kv.check_integrity()

    b = make_req("b", A_TOKENS[:32] + [7] * 8)
    hits, num_hit = kv.get_computed_blocks(b)
    assert [x.block_id for x in hits[0]] == [0, 1]
    assert num_hit == 32
    new = kv.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit)
    assert [x.block_id for x in new[0]] == [3]
    assert kv.get_block_ids("b")[0] == [0, 1, 3]
    assert ref_counts(kv)[:4] == [2, 2, 1, 1]
    assert kv.num_free_blocks == 6
    kv.check_integrity()

    # Only FULL blocks hit: sharing 40 tokens with A still hits 2 blocks,
    # since A's third block holds only 8 tokens.
    c = make_req("c", A_TOKENS + [1] * 8)
    assert [x.block_id for x in kv.get_computed_blocks(c)[0][0]] == [0, 1]

    # Sharing only 20 tokens: one block.
    d = make_req("d", A_TOKENS[:20] + [5] * 20)
    hits, num_hit = kv.get_computed_blocks(d)
    assert [x.block_id for x in hits[0]] == [0] and num_hit == 16

    # A difference in the first block: nothing, even though block 2 matches.
    e = make_req("e", [0] + A_TOKENS[1:])
    assert kv.get_computed_blocks(e) == ([[]], 0)

    for r in (a, b):
        kv.free(r)
    kv.check_integrity()
    assert kv.num_free_blocks == 10


def test_at_least_one_token_left_to_compute() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_req("a", A_TOKENS[:32])
    assert admit(kv, a) == ([], 0, [0, 1])

    same = make_req("same", A_TOKENS[:32])
    hits, num_hit = kv.get_computed_blocks(same)
    assert [x.block_id for x in hits[0]] == [0]
    assert num_hit == 16
    assert admit(kv, same) == ([0], 16, [2])

    # One more token: both blocks hit.
    longer = make_req("longer", A_TOKENS[:33])
    assert admit(kv, longer) == ([0, 1], 32, [3])

    # A one-block prompt never hits.
    tiny = make_req("tiny", A_TOKENS[:16])
    assert kv.get_computed_blocks(tiny) == ([[]], 0)
    kv.check_integrity()


def test_cache_salt_isolates() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    admit(kv, make_req("a", A_TOKENS))
    salted = make_req("s1", A_TOKENS, salt="tenant-1")
    assert kv.get_computed_blocks(salted) == ([[]], 0)
    assert admit(kv, salted) == ([], 0, [3, 4, 5])
    # Same salt hits the salted copy, another salt does not.
    assert [x.block_id for x in kv.get_computed_blocks(make_req("s2", A_TOKENS, salt="tenant-1"))[0][0]] == [3, 4]
    assert kv.get_computed_blocks(make_req("s3", A_TOKENS, salt="tenant-2")) == ([[]], 0)
    kv.check_integrity()


def test_decode_fills_and_registers_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_req("a", A_TOKENS)
    admit(kv, a)
    outs = list(range(900, 909))
    for i, t in enumerate(outs):
        new = decode(kv, a, t)
        # Token 48 (the 9th output, at position 48) needs a 4th block.
        assert [x.block_id for x in new[0]] == ([3] if i == 8 else [])
    assert a.num_computed_tokens == 49
    assert kv.get_block_ids("a")[0] == [0, 1, 2, 3]
    assert kv.pool.blocks[2].block_hash is not None
    # A request continuing A's generated text hits all three full blocks.
    f = make_req("f", a.all_token_ids + [1])
    assert admit(kv, f) == ([0, 1, 2], 48, [4])
    kv.check_integrity()


def test_freed_blocks_stay_reusable_until_evicted_lru() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_req("a", A_TOKENS + list(range(200, 208)))  # 48 tokens, 3 full blocks
    admit(kv, a)
    b = make_req("b", [1] * 17)
    assert admit(kv, b) == ([], 0, [3, 4])
    kv.free(a)  # tail first
    assert free_ids(kv) == [5, 2, 1, 0]
    assert kv.num_free_blocks == 4
    kv.check_integrity()

    # Freed but still cached: a later request with A's prompt revives them.
    probe = make_req("probe", A_TOKENS + list(range(200, 208)) + [3])
    assert [x.block_id for x in kv.get_computed_blocks(probe)[0][0]] == [0, 1, 2]

    # New allocations evict in LRU order: the unused block 5, then A's tail.
    c = make_req("c", [2] * 16)
    assert admit(kv, c) == ([], 0, [5])
    assert [x.block_id for x in kv.get_computed_blocks(probe)[0][0]] == [0, 1, 2]
    d = make_req("d", [3] * 16)
    assert admit(kv, d) == ([], 0, [2])
    assert [x.block_id for x in kv.get_computed_blocks(probe)[0][0]] == [0, 1]
    assert kv.pool.num_evictions == 1
    e = make_req("e", [4] * 16)
    assert admit(kv, e) == ([], 0, [1])
    assert [x.block_id for x in kv.get_computed_blocks(probe)[0][0]] == [0]
    kv.check_integrity()

    # Only block 0 is free: it is the hit, so nothing is left for the new token.
    g = make_req("g", A_TOKENS[:16] + [9])
    assert admit(kv, g) is None
    assert free_ids(kv) == [0]
    kv.check_integrity()
    # With one more free block, reviving block 0 takes it off the free queue.
    kv.free(e)
    assert free_ids(kv) == [0, 1]
    assert admit(kv, g) == ([0], 16, [1])
    assert kv.num_free_blocks == 0
    assert ref_counts(kv) == [1] * 6
    assert kv.pool.num_evictions == 3
    kv.check_integrity()


def test_revived_hits_count_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_req("a", A_TOKENS)
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 3

    # 2 hit blocks (both free) + 2 new would need 4 blocks: fails, changing nothing.
    big = make_req("big", A_TOKENS[:32] + [1] * 24)
    before = (free_ids(kv), ref_counts(kv), dict(kv.pool.cached_blocks))
    hits, num_hit = kv.get_computed_blocks(big)
    assert num_hit == 32
    assert kv.allocate_slots(big, big.num_tokens - num_hit, hits, num_hit) is None
    assert (free_ids(kv), ref_counts(kv), dict(kv.pool.cached_blocks)) == before
    assert "big" not in kv.req_to_blocks
    assert kv.pool.num_evictions == 0
    kv.check_integrity()

    # 2 hit blocks + 1 new fits exactly, and the new one is not a hit block.
    ok = make_req("ok", A_TOKENS[:32] + [1] * 8)
    assert admit(kv, ok) == ([0, 1], 32, [2])
    assert kv.num_free_blocks == 0
    kv.free(ok)
    assert kv.num_free_blocks == 3
    kv.check_integrity()


def test_allocation_failure_keeps_existing_table() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8])
    admit(kv, a)
    assert kv.num_free_blocks == 0
    assert decode(kv, a, 9) is None
    assert kv.get_block_ids("a")[0] == [0, 1]
    assert a.num_computed_tokens == 8
    kv.check_integrity()
    kv.free(a)
    assert kv.num_free_blocks == 2


def test_allocate_slots_argument_errors() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_req("a", [1, 2, 3, 4, 5])
    with pytest.raises(ValueError):
        kv.allocate_slots(a, 0)
    admit(kv, a)
    b = make_req("b", [1, 2, 3, 4, 5])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    kv.allocate_slots(b, 1)
    with pytest.raises(RuntimeError):
        kv.allocate_slots(b, 1, hits, n)
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=4, block_size=0)


def test_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    admit(kv, make_req("a", A_TOKENS))
    assert kv.get_computed_blocks(make_req("b", A_TOKENS)) == ([[]], 0)
    assert kv.pool.cached_blocks == {}
    kv.check_integrity()


def test_free_unknown_request_is_noop() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.free(make_req("ghost", [1]))
    assert kv.num_free_blocks == 4
    kv.check_integrity()


def test_prefix_counters() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    admit(kv, make_req("a", A_TOKENS))
    # A lookup alone counts nothing: the scheduler records admitted requests only.
    hits, n = kv.get_computed_blocks(make_req("probe", A_TOKENS))
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)
    kv.record_prefix_lookup(40, 0)
    admit(kv, make_req("b", A_TOKENS))
    kv.record_prefix_lookup(40, 32)
    assert kv.prefix_queries == 80
    assert kv.prefix_hits == 32


def test_check_integrity_catches_table_corruption() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_req("a", list(range(10)))
    admit(kv, a)
    kv.check_integrity()
    kv.req_to_blocks["a"][0].append(kv.req_to_blocks["a"][0][0])
    with pytest.raises(AssertionError):
        kv.check_integrity()
    kv.req_to_blocks["a"][0].pop()
    kv.check_integrity()
    kv.req_to_blocks["a"][0].append(kv.pool.blocks[5])  # held but ref 0 and free
    with pytest.raises(AssertionError):
        kv.check_integrity()
    kv.req_to_blocks["a"][0].pop()
    kv.num_cached_blocks["a"] = 9
    with pytest.raises(AssertionError):
        kv.check_integrity()


# ---------------------------------------------------------------- stateful model


class KVModel:
    """A plain reference model: list free queue, dict prefix map, per-block owners."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.free = list(range(num_blocks))
        self.ref = [0] * num_blocks
        self.key_of: dict[int, tuple] = {}
        self.owner: dict[tuple, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.offered: dict[str, int] = {}

    def key(self, req: Request, i: int) -> tuple:
        return (req.cache_salt or None, tuple(req.all_token_ids[: (i + 1) * self.bs]))

    def hits(self, req: Request) -> list[int]:
        out = []
        for i in range((req.num_tokens - 1) // self.bs):
            b = self.owner.get(self.key(req, i))
            if b is None:
                break
            out.append(b)
        return out

    def allocate(self, req: Request, num_new: int, hits: list[int], num_hit: int) -> list[int] | None:
        rid = req.request_id
        table = self.tables.get(rid, [])
        total = req.num_computed_tokens + num_hit + num_new
        needed = cdiv(total, self.bs) - len(table) - len(hits)
        revived = sum(1 for b in hits if self.ref[b] == 0)
        if needed > len(self.free) - revived:
            return None
        table = self.tables.setdefault(rid, [])
        for b in hits:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
        table.extend(hits)
        new = self.free[: max(needed, 0)]
        del self.free[: len(new)]
        for b in new:
            self.ref[b] = 1
            if b in self.key_of:
                del self.owner[self.key_of.pop(b)]
        table.extend(new)
        num_full = total // self.bs
        for i in range(self.offered.get(rid, 0), num_full):
            b = table[i]
            k = self.key(req, i)
            if b not in self.key_of and k not in self.owner:
                self.key_of[b] = k
                self.owner[k] = b
        self.offered[rid] = max(self.offered.get(rid, 0), num_full)
        return new

    def release(self, rid: str) -> None:
        for b in reversed(self.tables.pop(rid, [])):
            self.ref[b] -= 1
            assert self.ref[b] >= 0
            if self.ref[b] == 0:
                self.free.append(b)
        self.offered.pop(rid, None)


class KVStateMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 16), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.kv = KVCacheManager(num_blocks, block_size)
        self.model = KVModel(num_blocks, block_size)
        self.bs = block_size
        self.live: dict[str, Request] = {}
        self.ids = itertools.count()

    # -- helpers

    def _snapshot(self):
        return (
            [b.block_id for b in self.kv.pool.free_queue],
            [b.ref_cnt for b in self.kv.pool.blocks],
            {k: b.block_id for k, b in self.kv.pool.cached_blocks.items()},
            {rid: list(self.kv.get_block_ids(rid)[0]) for rid in self.kv.req_to_blocks},
            dict(self.kv.num_cached_blocks),
        )

    def _admit(self, req: Request, chunk: int) -> None:
        hits, num_hit = self.kv.get_computed_blocks(req)
        expect_hits = self.model.hits(req)
        assert [b.block_id for b in hits[0]] == expect_hits
        assert num_hit == len(expect_hits) * self.bs
        assert num_hit < req.num_tokens
        num_new = 1 + chunk % (req.num_tokens - num_hit)
        before = self._snapshot()
        new = self.kv.allocate_slots(req, num_new, hits, num_hit)
        expect_new = self.model.allocate(req, num_new, expect_hits, num_hit)
        if expect_new is None:
            assert new is None
            assert self._snapshot() == before
            return
        assert new is not None
        assert [b.block_id for b in new[0]] == expect_new
        req.num_computed_tokens = num_hit + num_new
        self.live[req.request_id] = req

    # -- rules

    @rule(
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=24),
        salt=st.sampled_from([None, None, "x"]),
        chunk=st.integers(0, 30),
    )
    def allocate(self, prompt: list[int], salt: str | None, chunk: int) -> None:
        req = Request(f"r{next(self.ids)}", prompt, SamplingParams(max_tokens=100), cache_salt=salt)
        self._admit(req, chunk)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2), chunk=st.integers(0, 30))
    def step(self, data, token: int, chunk: int) -> None:
        """Next prompt chunk, or one decode token once the prompt is done."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[rid]
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(token)
        num_new = 1 + chunk % (req.num_tokens - req.num_computed_tokens)
        before = self._snapshot()
        new = self.kv.allocate_slots(req, num_new)
        expect_new = self.model.allocate(req, num_new, [], 0)
        if expect_new is None:
            assert new is None
            assert self._snapshot() == before
            return
        assert new is not None
        assert [b.block_id for b in new[0]] == expect_new
        req.num_computed_tokens += num_new

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=8), chunk=st.integers(0, 30))
    def fork(self, data, extra: list[int], chunk: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        parent = self.live[rid]
        child = Request(
            f"r{next(self.ids)}", parent.all_token_ids + extra, SamplingParams(max_tokens=100),
            cache_salt=parent.cache_salt,
        )
        # The parent's leading computed full blocks that carry a hash must hit.
        parent_blocks = self.kv.req_to_blocks[rid][0]
        k = 0
        limit = min(parent.num_computed_tokens // self.bs, (child.num_tokens - 1) // self.bs)
        while k < limit and parent_blocks[k].block_hash is not None:
            k += 1
        hits = self.kv.get_computed_blocks(child)[0][0]
        assert len(hits) >= k
        assert hits[:k] == parent_blocks[:k]
        self._admit(child, chunk)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live.pop(rid)
        self.kv.free(req)
        self.model.release(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort_and_requeue(self, data) -> None:
        """Abort (or preempt): free everything, recompute from scratch later."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live.pop(rid)
        self.kv.free(req)
        self.model.release(rid)
        req.num_computed_tokens = 0
        self._admit(req, 10**6)

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=8))
    def abort_waiting(self, prompt: list[int]) -> None:
        """A request that never got blocks is freed: nothing changes."""
        before = self._snapshot()
        self.kv.free(Request(f"r{next(self.ids)}", prompt, SamplingParams(max_tokens=1)))
        assert self._snapshot() == before

    # -- checks after every rule

    @invariant()
    def consistent(self) -> None:
        self.kv.check_integrity()
        m = self.model
        assert [b.block_id for b in self.kv.pool.free_queue] == m.free
        assert self.kv.num_free_blocks == len(m.free)
        assert [b.ref_cnt for b in self.kv.pool.blocks] == m.ref
        assert {rid: self.kv.get_block_ids(rid)[0] for rid in self.kv.req_to_blocks} == m.tables
        assert set(self.kv.req_to_blocks) == set(self.live)
        assert {b.block_id for b in self.kv.pool.cached_blocks.values()} == set(m.key_of)
        for b, key in m.key_of.items():
            blk = self.kv.pool.blocks[b]
            assert blk.block_hash is not None
            assert blk.block_hash.token_ids == key[1][-self.bs:]
        for rid, req in self.live.items():
            assert len(self.kv.get_block_ids(rid)[0]) == cdiv(req.num_computed_tokens, self.bs)

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for rid in list(self.live):
            self.kv.free(self.live.pop(rid))
            self.kv.check_integrity()
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)
        assert self.kv.req_to_blocks == {}
        self.kv.check_integrity()


KVStateMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVStateMachine = KVStateMachine.TestCase


def test_sliding_window_releases_blocks_behind_the_window() -> None:
    """Window 20, blocks of 16: computing position p needs keys from p - 19 on, so block
    b goes back once p - 19 >= 16 (b + 1). Released blocks keep their hash (another
    request's prefix hit revives them), the table shows them as None, and freeing the
    request returns the rest."""
    kv = KVCacheManager(num_blocks=10, block_size=BS, sliding_window=20)
    req = make_req("a", list(range(40)))
    admit(kv, req, 40)                      # positions 0-39: the first query is 0, nothing released
    assert kv.num_free_blocks == 10 - 3 and kv.req_to_blocks["a"][0][0] is not None
    first_block = kv.req_to_blocks["a"][0][0]
    for token in range(100, 131):           # decode positions 40-70
        decode(kv, req, token)
        kv.check_integrity()
        first_needed = req.num_computed_tokens - 1 - 20 + 1
        blocks = kv.req_to_blocks["a"][0]
        assert all(b is None for b in blocks[: first_needed // BS])
        assert all(b is not None for b in blocks[first_needed // BS:])
    # Position 70 needs keys from 51: blocks 0-2 (positions 0-47) released, 3-4 held.
    assert [b is None for b in kv.req_to_blocks["a"][0]] == [True, True, True, False, False]
    assert kv.num_free_blocks == 10 - 2
    assert kv.get_block_ids("a")[0][:3] == [0, 0, 0]
    # A new request with the same first 16 tokens revives the released first block.
    other = make_req("b", list(range(20)))
    hits, num_hit, _ = admit(kv, other)
    assert hits == [first_block.block_id] and num_hit == BS
    kv.check_integrity()
    kv.free(req)
    kv.free(other)
    kv.check_integrity()
    assert kv.num_free_blocks == 10 and not kv.num_released


def test_sliding_window_prompt_chunks_release_as_they_advance() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, sliding_window=16)
    req = make_req("a", list(range(100)))
    for _ in range(4):                      # chunks of 25 tokens
        assert kv.allocate_slots(req, 25) is not None
        first = req.num_computed_tokens       # this chunk's first query
        req.num_computed_tokens += 25
        assert kv.num_released.get("a", [0])[0] == max(0, first - 16 + 1) // BS
        kv.check_integrity()
    assert sum(b is not None for b in kv.req_to_blocks["a"][0]) <= cdiv(16 + 25, BS) + 1
    kv.free(req)
    assert kv.num_free_blocks == 8
