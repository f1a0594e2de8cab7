"""KV groups (the hybrid allocator): layers of mixed attention types keep one block table
per group over one pool; windowed groups give back what slides out of their window."""

from __future__ import annotations

import random

import pytest

from pagoda.core.kv_cache_manager import RELEASED_BLOCK_ID, KVCacheManager, cdiv
from pagoda.core.kv_layout import KVLayout
from pagoda.core.request import Request
from pagoda.core.sched_output import ModelRunnerOutput
from pagoda.core.scheduler import Scheduler, SchedulerConfig
from pagoda.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(temperature=0, max_tokens=1000))


def computed(kv: KVCacheManager, rid: str, n: int) -> Request:
    """A request whose n prompt tokens were computed in one step."""
    r = req(rid, list(range(n)))
    assert kv.allocate_slots(r, n) is not None
    r.num_computed_tokens = n
    return r


def test_layout_of_gemma3_1b_and_gemma2():
    # Gemma 3 1B: 26 layers, every sixth global -> 4 global, 22 windowed: groups of 4.
    windows = [None if i % 6 == 5 else 512 for i in range(26)]
    layout = KVLayout.plan(windows)
    assert layout.group_windows == (None, 512, 512, 512, 512, 512, 512)
    assert layout.num_buffers == 4
    assert [i for i in range(26) if layout.layer_group[i] == 0] == [5, 11, 17, 23]
    assert [layout.layer_buffer[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    # The last windowed group holds the last 2 windowed layers.
    assert [i for i in range(26) if layout.layer_group[i] == 6] == [24, 25]
    # No two layers of one group share a buffer, and every buffer serves each group at most once.
    for g in range(layout.num_groups):
        buffers = [layout.layer_buffer[i] for i in range(26) if layout.layer_group[i] == g]
        assert len(buffers) == len(set(buffers))
    # A 4096-token request, 512-token window, chunks of 512: all 256 global blocks, and a
    # window plus a chunk (65 blocks) in each windowed group.
    assert layout.blocks_for(4096, 16, 512) == 256 + 6 * 65
    # Gemma 2: alternating -> two groups of 13, 13 buffers.
    g2 = KVLayout.plan([4096 if i % 2 == 0 else None for i in range(26)])
    assert g2.group_windows == (None, 4096) and g2.num_buffers == 13
    # One attention type: one group, a buffer per layer (the plain layout).
    plain = KVLayout.plan([None] * 3)
    assert plain.group_windows == (None,) and plain.layer_buffer == (0, 1, 2)
    with pytest.raises(ValueError):
        KVLayout.plan([])


def test_layout_max_tokens():
    hybrid = KVLayout.plan([None, 8])
    # 20 blocks of 4: global holds n/4, windowed at most cdiv(7 + 4, 4) + 1 = 4.
    n = hybrid.max_tokens(20, BS, 4)
    assert hybrid.blocks_for(n, BS, 4) <= 20 < hybrid.blocks_for(n + 1, BS, 4)
    assert n == 16 * BS
    assert KVLayout.plan([None]).max_tokens(20, BS, 4) == 20 * BS
    # All windowed: a bounded number of blocks holds any length.
    assert KVLayout.plan([8, 8]).max_tokens(20, BS, 4) > 10**9
    assert KVLayout.plan([8, 8]).max_tokens(3, BS, 4) == 3 * BS


def test_global_group_keeps_every_block_windowed_groups_release():
    kv = KVCacheManager(num_blocks=40, block_size=BS, group_windows=(None, 8, 8))
    a = req("a", list(range(10)))
    new = kv.allocate_slots(a, 10)
    assert [len(t) for t in new] == [3, 3, 3] and kv.num_free_blocks == 40 - 9
    a.num_computed_tokens = 10
    for t in range(30):   # decode positions 10..39
        a.append_output_token(100 + t)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
        kv.check_integrity()
        ids = kv.get_block_ids("a")
        assert len(ids[0]) == cdiv(a.num_computed_tokens, BS) and RELEASED_BLOCK_ID not in ids[0][1:]
        # Position p needs keys from p - 7: blocks before (p - 7) // 4 are released.
        first = max(0, a.num_computed_tokens - 1 - 8 + 1) // BS
        for g in (1, 2):
            assert all(b is None for b in kv.req_to_blocks["a"][g][:first])
            assert all(b is not None for b in kv.req_to_blocks["a"][g][first:])
    # 10 global blocks; position 39 needs keys from 32: blocks 8-9 in each windowed group.
    assert 40 - kv.num_free_blocks == 10 + 2 * 2
    kv.free(a)
    assert kv.num_free_blocks == 40
    kv.check_integrity()


def test_prefix_hit_needs_only_the_window_in_windowed_groups():
    kv = KVCacheManager(num_blocks=40, block_size=BS, group_windows=(None, 8))
    kv.free(computed(kv, "a", 33))
    # All 8 full blocks of both groups stay cached (free, hashed).
    b = req("b", list(range(33)) + [7, 7])
    hits, n = kv.get_computed_blocks(b)
    assert n == 32
    assert all(x is not None for x in hits[0]) and len(hits[0]) == 8
    # Position 32 sees keys from 25: the windowed group needs blocks 6 and 7 only.
    assert hits[1][:6] == [None] * 6 and all(x is not None for x in hits[1][6:])
    new = kv.allocate_slots(b, 3, hits, n)
    assert [len(t) for t in new] == [1, 1]
    kv.check_integrity()
    assert kv.num_released["b"] == [0, 6]
    # The windowed group's early blocks (revived by nobody) are still free and cached.
    assert kv.num_free_blocks == 40 - 9 - 3
    kv.free(b)
    kv.check_integrity()


def test_prefix_hit_shrinks_to_what_every_group_holds():
    kv = KVCacheManager(num_blocks=40, block_size=BS, group_windows=(None, 8))
    a = computed(kv, "a", 33)
    # Evict the windowed group's block 7 from the prefix map by hand (as eviction would).
    block7 = kv.req_to_blocks["a"][1][7]
    kv.free(a)
    kv.pool.free_queue.remove(block7)
    kv.pool._evict(block7)
    kv.pool.free_queue.append(block7)
    b = req("b", list(range(33)))
    hits, n = kv.get_computed_blocks(b)
    # A hit of 7 blocks needs windowed blocks 5-6 (position 28 sees keys from 21): cached.
    assert n == 28 and len(hits[0]) == 7 and hits[1][:5] == [None] * 5
    kv.check_integrity()


def test_a_step_past_the_window_never_allocates_the_blocks_behind_it():
    kv = KVCacheManager(num_blocks=40, block_size=BS, group_windows=(None, 8))
    a = req("a", list(range(40)))
    assert kv.allocate_slots(a, 8) is not None
    a.num_computed_tokens = 8
    kv.free(a)
    kv.pool.reset_prefix_cache()
    # Computed 24 tokens without blocks (as after a hit in the global group only): the
    # windowed group skips blocks 0-3 (positions 0-15; position 24 needs keys from 17).
    a = req("b", list(range(40)))
    a.num_computed_tokens = 24
    new = kv.allocate_slots(a, 8)
    assert new[1][:4] == [None] * 4 and all(b is not None for b in new[1][4:])
    assert len(new[0]) == 8 and kv.num_free_blocks == 40 - 8 - 4
    assert kv.num_released["b"] == [0, 4]
    kv.check_integrity()


def test_full_pool_changes_nothing_and_counts_every_group():
    kv = KVCacheManager(num_blocks=5, block_size=BS, group_windows=(None, 8))
    a = req("a", list(range(12)))   # 3 blocks in each group: 6 > 5
    assert kv.allocate_slots(a, 12) is None
    assert kv.num_free_blocks == 5 and "a" not in kv.req_to_blocks and not kv.num_released
    with pytest.raises(ValueError, match="KV groups"):
        kv.allocate_slots(a, 4, [[]], 0)
    kv.check_integrity()


def test_random_workload_keeps_every_invariant():
    """Admissions with prefix hits, chunks, decodes, speculative rollbacks and frees over
    three groups: after each, the integrity check holds, and at the end the pool is whole."""
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=60, block_size=BS, group_windows=(None, 6, 11))
    live: dict[str, Request] = {}
    for step in range(600):
        op = rng.random()
        if op < 0.25 or not live:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
            r = req(f"r{step}", tokens)
            hits, n = kv.get_computed_blocks(r)
            assert n % BS == 0 and n < r.num_tokens
            chunk = rng.randrange(1, r.num_tokens - n + 1)
            if kv.allocate_slots(r, chunk, hits, n) is not None:
                r.num_computed_tokens = n + chunk
                live[r.request_id] = r
        elif op < 0.85:
            r = live[rng.choice(sorted(live))]
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token(rng.randrange(3))
            want = r.num_tokens - r.num_computed_tokens
            chunk = rng.randrange(1, want + 1)
            drafts = rng.randrange(3) if want == 1 else 0
            if kv.allocate_slots(r, chunk + drafts) is not None:
                r.num_computed_tokens += chunk
                if drafts:
                    kv.trim(r)
        else:
            kv.free(live.pop(rng.choice(sorted(live))))
        kv.check_integrity()
        for r in live.values():
            tables = kv.req_to_blocks[r.request_id]
            assert all(len(t) >= cdiv(r.num_computed_tokens, BS) for t in tables)
            assert None not in tables[0]
    for r in list(live.values()):
        kv.free(r)
    kv.check_integrity()
    assert kv.num_free_blocks == 60


def test_swap_preemption_with_windowed_groups_restores_only_held_blocks():
    """A swapped-out request copies out the blocks its groups still hold (not the released
    ones), and comes back into blocks its own tables hold: never into another's."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128, preemption_mode="swap",
                          num_host_blocks=64)  # fmt: skip
    kv = KVCacheManager(num_blocks=24, block_size=BS, group_windows=(None, 8))
    sched = Scheduler(cfg, kv)
    rng = random.Random(1)
    reqs = [Request(f"r{i}", [rng.randrange(50) for _ in range(10)],
                    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), max_model_len=128)
            for i in range(3)]  # fmt: skip
    for r in reqs:
        sched.add_request(r)
    swapped_out = swapped_in = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        sched.check_integrity()
        held = {b.block_id: rid for rid in so.num_scheduled_tokens
                for t in kv.req_to_blocks[rid] for b in t if b is not None}  # fmt: skip
        resumed = {n.req_id for n in so.scheduled_new_reqs}
        for _, dev in so.swap_in:
            assert held.get(dev) in resumed
        swapped_out += len(so.swap_out)
        swapped_in += len(so.swap_in)
        tokens = [[7] if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens else []
                  for r in so.num_scheduled_tokens]  # fmt: skip
        sched.update_from_output(so, ModelRunnerOutput(list(so.num_scheduled_tokens), tokens))
        sched.check_integrity()
    assert sched.num_swap_preemptions > 0
    # Windowed blocks released before the swap-out are neither copied out nor back.
    assert 0 < swapped_in <= swapped_out < sum(cdiv(r.num_tokens, BS) for r in reqs) * 2
    assert all(r.num_output_tokens == 40 for r in reqs)
    sched.schedule()   # releases the last host blocks
    assert sched.host.num_free_blocks == sched.host.num_blocks and kv.num_free_blocks == kv.num_blocks
