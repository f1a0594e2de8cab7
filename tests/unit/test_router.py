"""PrefixRouter: prefix-aware choice of a data-parallel replica, least-loaded fallback."""

from __future__ import annotations

import pytest

from pagoda.engine.router import PrefixRouter

BS = 4
ALIVE2 = [True, True]


def test_first_request_goes_to_least_loaded():
    r = PrefixRouter(2, BS)
    assert r.choose(list(range(12)), loads=[3, 1], alive=ALIVE2).replica == 1
    assert r.choose(list(range(100, 112)), loads=[0, 0], alive=ALIVE2).replica == 0   # tie -> lowest index


def test_repeated_prefix_follows_the_replica_that_cached_it():
    r = PrefixRouter(2, BS)
    prefix = list(range(8))
    first = r.choose(prefix + [50, 51, 52], loads=[0, 0], alive=ALIVE2)
    assert first.replica == 0 and first.matched_blocks == 0
    # Replica 0 is now busier, but holds the 2-block prefix.
    again = r.choose(prefix + [60, 61, 62, 63], loads=[2, 0], alive=ALIVE2)
    assert again.replica == 0 and again.matched_blocks == 2
    # Only the first block shared: still replica 0, matched 1.
    part = r.choose(prefix[:4] + [9, 9, 9, 9], loads=[2, 0], alive=ALIVE2)
    assert (part.replica, part.matched_blocks) == (0, 1)
    # A different first block matches nothing: least loaded.
    assert r.choose([7] + prefix[1:], loads=[2, 0], alive=ALIVE2).replica == 1


def test_longest_prefix_wins_between_replicas():
    r = PrefixRouter(2, BS)
    a = list(range(16))
    r.choose(a[:4], loads=[0, 0], alive=ALIVE2)            # replica 0 holds 1 block of a
    r.choose(a[:12], loads=[1, 0], alive=[False, True])    # replica 1 holds 3 blocks (0 was down)
    route = r.choose(a, loads=[0, 0], alive=ALIVE2)
    assert (route.replica, route.matched_blocks) == (1, 3)


def test_overloaded_prefix_holder_falls_back_to_least_loaded():
    r = PrefixRouter(2, BS, imbalance_limit=2)
    p = list(range(8))
    r.choose(p, loads=[0, 0], alive=ALIVE2)
    assert r.choose(p, loads=[2, 0], alive=ALIVE2).replica == 0
    assert r.choose(p, loads=[3, 0], alive=ALIVE2).replica == 1


def test_dead_replicas_are_skipped_and_forgotten():
    r = PrefixRouter(3, BS)
    p = list(range(8))
    r.choose(p, loads=[0, 0, 0], alive=[True] * 3)
    route = r.choose(p, loads=[0, 5, 1], alive=[False, True, True])
    assert route.replica == 2 and route.matched_blocks == 0
    assert [r.held_blocks(p, i) for i in range(3)] == [2, 0, 2]
    r.forget_replica(2)
    # Replica 2's blocks are forgotten; replica 0 still holds the same ones.
    assert [r.held_blocks(p, i) for i in range(3)] == [2, 0, 0]
    assert r.num_remembered_blocks == 2
    r.forget_replica(0)
    assert r.num_remembered_blocks == 0
    with pytest.raises(RuntimeError, match="no live replica"):
        r.choose(p, loads=[0, 0, 0], alive=[False] * 3)


def test_cache_salt_isolates_prefixes():
    r = PrefixRouter(2, BS)
    p = list(range(8))
    r.choose(p, loads=[0, 0], alive=ALIVE2, cache_salt="tenant-a")
    assert r.choose(p, loads=[1, 0], alive=ALIVE2, cache_salt="tenant-b").matched_blocks == 0
    assert r.choose(p, loads=[1, 1], alive=ALIVE2, cache_salt="tenant-a").matched_blocks == 2


def test_capacity_bounds_the_map():
    r = PrefixRouter(2, BS, capacity=5)
    for i in range(10):
        r.choose([i] * 8, loads=[0, 0], alive=ALIVE2)
    assert r.num_remembered_blocks == 5
    # The least recently used go first: of the 20 blocks (all on replica 0) the last 5
    # remain, both of [8] * 8 and of [9] * 8 and the second of [7] * 8 (which matches
    # nothing without its first).
    assert [r.held_blocks([i] * 8, 0) for i in range(10)] == [0] * 8 + [2, 2]
    assert all(r.held_blocks([i] * 8, 1) == 0 for i in range(10))
