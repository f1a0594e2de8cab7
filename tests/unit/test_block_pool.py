"""BlockPool / FreeBlockQueue: ref counts, LRU free queue, prefix map, integrity checks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.core.block_hash import BlockHash, hash_block
from pagoda.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def h(*tokens: int) -> BlockHash:
    return hash_block(None, list(tokens))


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


# ---------------------------------------------------------------- free queue


def test_free_queue_order_and_o1_removal() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4]
    assert q.num_free_blocks == 5

    # Removal from the middle, the head and the tail unlinks only that block.
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert not q.contains(blocks[2])
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert [b.block_id for b in q] == [1, 3]
    assert q.num_free_blocks == 2

    # Appending goes to the tail; popleft takes the head.
    q.append(blocks[0])
    assert [b.block_id for b in q] == [1, 3, 0]
    assert q.popleft() is blocks[1]
    assert [b.block_id for b in q] == [3, 0]
    assert q.contains(blocks[3]) and q.contains(blocks[0])


def test_free_queue_errors() -> None:
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[0])
    with pytest.raises(RuntimeError):
        q.remove(blocks[0])
    assert q.popleft() is blocks[1]
    with pytest.raises(RuntimeError):
        q.popleft()
    assert q.num_free_blocks == 0
    assert list(q) == []


# ---------------------------------------------------------------- pool basics


def test_fresh_pool() -> None:
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0
    assert free_ids(pool) == [0, 1, 2, 3]
    pool.check_integrity()
    with pytest.raises(ValueError):
        BlockPool(0)


def test_get_new_blocks_in_order_and_too_many() -> None:
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)
    # The failed call changed nothing.
    assert pool.num_free_blocks == 1
    assert free_ids(pool) == [3]
    pool.check_integrity({0: 1, 1: 1, 2: 1})


def test_lru_blocks_freed_later_are_evicted_later() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)   # 0, 1
    b = pool.get_new_blocks(2)   # 2, 3
    pool.free_blocks([b[1]])     # 3
    pool.free_blocks([a[0]])     # 0
    pool.free_blocks([b[0]])     # 2
    pool.free_blocks([a[1]])     # 1
    # Never-used blocks first, then in the order freed.
    assert free_ids(pool) == [4, 5, 3, 0, 2, 1]
    got = pool.get_new_blocks(6)
    assert [x.block_id for x in got] == [4, 5, 3, 0, 2, 1]
    pool.check_integrity()


def test_request_blocks_freed_tail_first() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)  # a request's table: 0, 1, 2, 3
    for i, blk in enumerate(blocks):
        pool.cache_block(blk, h(i))
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 3, 2, 1, 0]
    # Eviction takes the unused block, then the tail, keeping the prefix longest.
    first = pool.get_new_blocks(2)
    assert [x.block_id for x in first] == [4, 3]
    assert pool.get_cached_block(h(3)) is None
    for i in range(3):
        assert pool.get_cached_block(h(i)) is blocks[i]
    pool.check_integrity()


def test_touch_revives_cached_free_block_without_eviction() -> None:
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    key = h(7, 7)
    pool.cache_block(blk, key)
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and blk.block_hash == key
    assert pool.get_cached_block(key) is blk
    assert free_ids(pool) == [1, 2, 0]

    pool.touch([pool.get_cached_block(key)])
    assert blk.ref_cnt == 1
    assert blk.block_hash == key
    assert pool.get_cached_block(key) is blk
    assert pool.num_evictions == 0
    assert free_ids(pool) == [1, 2]
    pool.check_integrity({0: 1})

    # Touching an in-use block only adds a reference.
    pool.touch([blk])
    assert blk.ref_cnt == 2
    assert pool.num_free_blocks == 2
    pool.check_integrity({0: 2})

    # The revived block is never handed out while in use.
    others = pool.get_new_blocks(2)
    assert blk not in others
    assert pool.get_cached_block(key) is blk
    pool.free_blocks([blk, blk])
    pool.free_blocks(others)
    pool.check_integrity()


def test_eviction_drops_hash_from_prefix_map() -> None:
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    k0, k1 = h(1), h(2)
    pool.cache_block(blocks[0], k0)
    pool.cache_block(blocks[1], k1)
    pool.free_blocks(reversed(blocks))  # queue: 1, 0
    assert pool.num_evictions == 0

    (got,) = pool.get_new_blocks(1)
    assert got is blocks[1]
    assert got.block_hash is None
    assert pool.get_cached_block(k1) is None
    assert pool.get_cached_block(k0) is blocks[0]
    assert k1 not in pool.cached_blocks
    assert pool.num_evictions == 1
    pool.check_integrity({1: 1})

    # Reusing an unhashed block is not an eviction.
    pool.free_blocks([got])
    pool.get_new_blocks(1)  # block 0 (hashed) goes first: LRU
    assert pool.num_evictions == 2
    assert pool.cached_blocks == {}
    pool.get_new_blocks(1)
    assert pool.num_evictions == 2
    pool.check_integrity({0: 1, 1: 1})


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([blk])
    with pytest.raises(RuntimeError):
        pool.free_blocks([pool.blocks[1]])  # never allocated
    pool.check_integrity()


def test_cache_block_first_copy_stays_canonical() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    key = h(4, 5)
    pool.cache_block(a, key)
    pool.cache_block(b, key)
    assert pool.get_cached_block(key) is a
    assert b.block_hash is None
    # A block with a hash keeps it.
    pool.cache_block(a, h(9))
    assert a.block_hash == key
    assert h(9) not in pool.cached_blocks
    pool.check_integrity({0: 1, 1: 1})


def test_block_hash_compares_tokens() -> None:
    k = h(1, 2)
    forged = BlockHash(k.value, (3, 4))
    assert k != forged
    assert hash_block(k, [5]) == hash_block(h(1, 2), [5])
    assert hash_block(k, [5]) != hash_block(h(1, 3), [5])
    assert hash_block(None, [1], ("salt",)) != hash_block(None, [1])


def test_caching_disabled() -> None:
    pool = BlockPool(2, enable_caching=False)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_block(blk, h(1))
    assert blk.block_hash is None
    assert pool.cached_blocks == {}
    pool.free_blocks([blk])
    pool.check_integrity()


def test_reset_prefix_cache() -> None:
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_block(blk, h(1))
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(1)) is blk
    pool.free_blocks([blk])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {}
    assert blk.block_hash is None
    pool.check_integrity()


# ---------------------------------------------------------------- check_integrity


def _pool_in_use() -> tuple[BlockPool, list[KVCacheBlock]]:
    """5 blocks: 0, 1 held (0 hashed), 2 free and hashed, 3, 4 free."""
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    pool.cache_block(blocks[0], h(0))
    pool.cache_block(blocks[2], h(2))
    pool.free_blocks([blocks[2]])
    pool.check_integrity({0: 1, 1: 1})
    return pool, blocks


def test_integrity_free_block_with_ref() -> None:
    pool, _ = _pool_in_use()
    pool.blocks[3].ref_cnt = 1
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_used_block_with_zero_ref() -> None:
    pool, _ = _pool_in_use()
    pool.blocks[1].ref_cnt = 0
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_negative_ref() -> None:
    pool, _ = _pool_in_use()
    pool.blocks[1].ref_cnt = -1
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_ref_count_vs_owners() -> None:
    pool, _ = _pool_in_use()
    with pytest.raises(AssertionError):
        pool.check_integrity({0: 1})          # block 1 has no owner
    with pytest.raises(AssertionError):
        pool.check_integrity({0: 2, 1: 1})    # block 0 claimed twice
    pool.blocks[0].ref_cnt = 2
    with pytest.raises(AssertionError):
        pool.check_integrity({0: 1, 1: 1})


def test_integrity_block_missing_from_queue() -> None:
    pool, _ = _pool_in_use()
    pool.free_queue.remove(pool.blocks[4])  # free (ref 0) but unlinked
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_used_block_in_queue() -> None:
    pool, _ = _pool_in_use()
    pool.free_queue.append(pool.blocks[1])  # ref 1 but linked
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_queue_counter() -> None:
    pool, _ = _pool_in_use()
    pool.free_queue.num_free_blocks += 1
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_queue_link_skips_block() -> None:
    pool, _ = _pool_in_use()
    # Queue is 3, 4, 2: make 3 point past 4 (4 becomes unreachable).
    assert free_ids(pool) == [3, 4, 2]
    pool.blocks[3].next_free = pool.blocks[2]
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_hashed_block_missing_from_map() -> None:
    pool, _ = _pool_in_use()
    del pool.cached_blocks[h(2)]
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_map_points_at_wrong_block() -> None:
    pool, _ = _pool_in_use()
    pool.cached_blocks[h(2)] = pool.blocks[0]
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_map_entry_for_unhashed_block() -> None:
    pool, _ = _pool_in_use()
    pool.cached_blocks[h(9)] = pool.blocks[4]
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_block_hash_changed() -> None:
    pool, _ = _pool_in_use()
    pool.blocks[0].block_hash = h(42)
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_integrity_map_not_empty_with_caching_disabled() -> None:
    pool = BlockPool(2, enable_caching=False)
    pool.blocks[0].block_hash = h(1)
    pool.cached_blocks[h(1)] = pool.blocks[0]
    with pytest.raises(AssertionError):
        pool.check_integrity()


# ---------------------------------------------------------------- model-based property


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(1, 8),
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "free", "cache", "touch"]), st.integers(0, 7), st.integers(0, 3)),
        max_size=60,
    ),
)
def test_pool_matches_reference_model(num_blocks: int, ops: list[tuple[str, int, int]]) -> None:
    """Against a plain-list model: exact LRU order, ref counts, prefix map."""
    pool = BlockPool(num_blocks)
    free: list[int] = list(range(num_blocks))  # head first
    ref = [0] * num_blocks
    key_of: dict[int, BlockHash] = {}
    owner: dict[BlockHash, int] = {}
    evictions = 0

    for op, x, y in ops:
        if op == "alloc":
            n = x % (num_blocks + 1)
            if n > len(free):
                with pytest.raises(RuntimeError):
                    pool.get_new_blocks(n)
            else:
                got = [b.block_id for b in pool.get_new_blocks(n)]
                expect = free[:n]
                del free[:n]
                assert got == expect
                for b in expect:
                    ref[b] = 1
                    if b in key_of:
                        del owner[key_of.pop(b)]
                        evictions += 1
        elif op == "free":
            b = x % num_blocks
            if ref[b] == 0:
                with pytest.raises(RuntimeError):
                    pool.free_blocks([pool.blocks[b]])
            else:
                pool.free_blocks([pool.blocks[b]])
                ref[b] -= 1
                if ref[b] == 0:
                    free.append(b)
        elif op == "cache":
            b = x % num_blocks
            key = h(y)
            pool.cache_block(pool.blocks[b], key)
            if b not in key_of and key not in owner:
                key_of[b] = key
                owner[key] = b
        else:  # touch a block found through the map, like a prefix hit
            key = h(y)
            blk = pool.get_cached_block(key)
            assert (blk.block_id if blk else None) == owner.get(key)
            if blk is not None:
                pool.touch([blk])
                if ref[blk.block_id] == 0:
                    free.remove(blk.block_id)
                ref[blk.block_id] += 1

        pool.check_integrity({i: r for i, r in enumerate(ref) if r})
        assert free_ids(pool) == free
        assert pool.num_free_blocks == len(free)
        assert [b.ref_cnt for b in pool.blocks] == ref
        assert {k: b.block_id for k, b in pool.cached_blocks.items()} == owner
        assert pool.num_evictions == evictions
