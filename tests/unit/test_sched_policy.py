"""Scheduling policies (priority, fair share across tenants) and the long-prefill cap,
driven by a fake model runner; every step checks the scheduler's invariants."""

from __future__ import annotations

import zlib
from collections import deque

import pytest

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, RequestStatus
from pagoda.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagoda.core.sched_policy import POLICIES, FairShare, make_policy, weighted_shares
from pagoda.core.scheduler import Scheduler, SchedulerConfig
from pagoda.sampling_params import SamplingParams
from pagoda.tenants import TenantSpec


def make_sched(policy: str = "priority", num_blocks: int = 256, block_size: int = 4, budget: int = 32,
               max_seqs: int = 16, **kw) -> Scheduler:  # fmt: skip
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=512,
                          policy=policy, **kw)  # fmt: skip
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size))


_arrival = iter(range(1, 10**9))


def add(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int = 4, priority: int = 0,
        tenant: str | None = None, background: bool = False) -> Request:  # fmt: skip
    base = 1000 * (zlib.crc32(rid.encode()) % 100_000 + 1)
    req = Request(rid, list(range(base, base + prompt_len)), SamplingParams(temperature=0, max_tokens=max_tokens),
                  max_model_len=512, arrival_time=float(next(_arrival)), priority=priority, tenant=tenant,
                  background=background)
    sched.add_request(req)
    return req


def step(sched: Scheduler) -> tuple[SchedulerOutput, dict[str, int]]:
    """Schedule, fake a forward (token 7 for every request that reached its end), update.
    Returns the output and the number of tokens each request sampled."""
    sched.check_integrity()
    so = sched.schedule()
    sched.check_integrity()
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    assert len(sched.running) <= sched.config.max_num_seqs
    assert all(n >= 1 for n in so.num_scheduled_tokens.values())
    assert not set(so.num_scheduled_tokens) & so.preempted_req_ids
    for rid in so.num_scheduled_tokens:
        req = sched.requests[rid]
        assert len(sched.kv.get_block_ids(rid)[0]) * sched.kv.block_size >= req.num_computed_tokens
    tokens = [[7] if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens else []
              for r in so.num_scheduled_tokens]  # fmt: skip
    sched.update_from_output(so, ModelRunnerOutput(list(so.num_scheduled_tokens), tokens))
    sched.check_integrity()
    return so, {r: len(t) for r, t in zip(so.num_scheduled_tokens, tokens) if t}


def drain(sched: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        outs.append(step(sched)[0])
    raise AssertionError("did not finish")


# ---------------------------------------------------------------- building blocks
def test_weighted_shares_sum_to_budget_in_proportion() -> None:
    assert weighted_shares(10, {"a": 1, "b": 2}) == {"a": 3, "b": 7}
    assert weighted_shares(32, {"a": 1, "b": 3}) == {"a": 8, "b": 24}
    assert weighted_shares(5, {"a": 1}) == {"a": 5}
    shares = weighted_shares(7, {"a": 1, "b": 1, "c": 1})
    assert sum(shares.values()) == 7 and sorted(shares.values()) == [2, 2, 3]
    assert weighted_shares(10, {}) == {}
    # With demands: nobody gets more than it asks for; the rest goes by weight.
    assert weighted_shares(10, {"a": 1, "b": 2}, {"a": 1, "b": 20}) == {"a": 1, "b": 9}
    assert weighted_shares(32, {"a": 1, "b": 1, "c": 2}, {"a": 2, "b": 100, "c": 100}) == {"a": 2, "b": 10, "c": 20}
    assert weighted_shares(32, {"a": 1, "b": 1}, {"a": 3, "b": 4}) == {"a": 3, "b": 4}


def test_priority_queue_orders_by_priority_then_arrival() -> None:
    q: deque[Request] = deque()
    params = SamplingParams(max_tokens=1)
    reqs = [Request(f"r{i}", [1], params, arrival_time=float(t), priority=p)
            for i, (p, t) in enumerate([(5, 1), (0, 2), (5, 0.5), (0, 3), (-1, 9)])]  # fmt: skip
    for r in reqs:
        make_policy("priority").enqueue(q, r)
    assert [r.request_id for r in q] == ["r4", "r1", "r3", "r2", "r0"]
    assert make_policy("priority").victim(list(reqs)).request_id == "r0"   # lowest priority, latest arrival
    assert make_policy("fcfs").victim(list(reqs)).request_id == "r4"       # the last admitted
    fcfs: deque[Request] = deque()
    for r in reqs:
        make_policy("fcfs").enqueue(fcfs, r)
    make_policy("fcfs").enqueue(fcfs, reqs[3], front=True)
    assert [r.request_id for r in fcfs][:2] == ["r3", "r0"]


def test_the_policies_are_the_options_choices() -> None:
    from pagoda.config import SCHEDULING_POLICIES

    assert tuple(POLICIES) == SCHEDULING_POLICIES
    with pytest.raises(ValueError, match="must be one of fcfs, priority, fair"):
        make_policy("lottery")


def test_fcfs_rejects_nonzero_priority_and_config_validates() -> None:
    sched = make_sched("fcfs")
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        add(sched, "a", 4, priority=1)
    assert not sched.has_unfinished_requests() and "a" not in sched.requests
    add(sched, "b", 4, priority=0)
    with pytest.raises(ValueError, match="scheduling policy"):
        SchedulerConfig(policy="lottery")
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        SchedulerConfig(max_long_partial_prefills=0)


def test_virtual_time_lift_on_activation() -> None:
    fair = FairShare([TenantSpec("heavy", weight=2.0)])
    fair.on_add("heavy")
    fair.charge("heavy", 100)
    assert fair.vtime["heavy"] == 50.0
    # A tenant arriving later starts at the smallest active counter, not at 0.
    fair.on_add("light")
    assert fair.vtime["light"] == 50.0
    fair.charge("light", 10)
    assert fair.order(["heavy", "light"]) == ["heavy", "light"]
    # An unknown tenant's counter is forgotten when it goes idle; a known one's is kept.
    fair.on_finish("light")
    fair.on_finish("heavy")
    assert "light" not in fair.vtime and fair.vtime["heavy"] == 50.0


# ---------------------------------------------------------------- background requests
@pytest.mark.parametrize("policy", POLICIES)
def test_background_requests_wait_behind_every_other(policy: str) -> None:
    sched = make_sched(policy, max_seqs=1)
    add(sched, "run", 4, max_tokens=3)
    step(sched)
    add(sched, "bg0", 4, background=True)
    add(sched, "live0", 4)
    add(sched, "bg1", 4, background=True)
    add(sched, "live1", 4)
    assert [r.request_id for r in sched.waiting] == ["live0", "live1", "bg0", "bg1"]
    finished = []
    for _ in range(60):
        if not sched.has_unfinished_requests():
            break
        step(sched)
        finished += [r for r in ("run", "live0", "live1", "bg0", "bg1")
                     if r not in finished and r not in sched.requests]  # fmt: skip
    assert finished == ["run", "live0", "live1", "bg0", "bg1"]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_live_request_preempts_a_background_one_for_a_seat(policy: str) -> None:
    sched = make_sched(policy, max_seqs=2)
    live = add(sched, "live", 8, max_tokens=8)
    bg = add(sched, "bg", 8, max_tokens=8, background=True)
    step(sched)
    step(sched)
    assert {r.request_id for r in sched.running} == {"live", "bg"}
    add(sched, "bg2", 8, background=True)   # background never preempts (not even background)
    so, _ = step(sched)
    assert not so.preempted_req_ids
    add(sched, "new", 8, max_tokens=2)
    so, _ = step(sched)
    assert so.preempted_req_ids == {"bg"}
    assert [n.req_id for n in so.scheduled_new_reqs] == ["new"] and "live" in so.num_scheduled_tokens
    # Back at the front of the background requests, ahead of bg2.
    assert [r.request_id for r in sched.waiting] == ["bg", "bg2"]
    drain(sched)
    assert live.is_finished and bg.is_finished and bg.num_preemptions == 1 and len(bg.output_token_ids) == 8
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_live_request_preempts_a_background_one_for_blocks_under_fcfs() -> None:
    sched = make_sched("fcfs", num_blocks=8, max_seqs=8)
    bg = add(sched, "bg", 12, max_tokens=8, background=True)
    add(sched, "live", 12, max_tokens=8)
    step(sched)
    assert bg.status == RequestStatus.RUNNING
    add(sched, "late", 12, max_tokens=2)
    so, _ = step(sched)
    assert so.preempted_req_ids == {"bg"} and "late" in so.num_scheduled_tokens
    drain(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_blocks_running_out_take_a_background_victim_first() -> None:
    sched = make_sched("fcfs", num_blocks=6, budget=64)
    add(sched, "bg", 8, max_tokens=12, background=True)   # admitted first
    add(sched, "live", 8, max_tokens=12)
    preempted = set()
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        so, _ = step(sched)
        preempted |= so.preempted_req_ids
    assert preempted == {"bg"}
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("policy", POLICIES)
def test_a_step_admitting_live_prompts_runs_no_background_work(policy: str) -> None:
    sched = make_sched(policy, budget=32)
    bg = add(sched, "bg", 60, max_tokens=4, background=True)
    bg_decoding = add(sched, "bg-dec", 4, max_tokens=20, background=True)
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"bg": 32}   # alone, it takes the whole budget
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"bg": 28, "bg-dec": 4}
    add(sched, "live", 20, max_tokens=3)
    so, _ = step(sched)
    # The live prompt's step: no background prompt chunk, no background decode.
    assert so.num_scheduled_tokens == {"live": 20}
    so, _ = step(sched)
    # Nobody waits: the background work goes on beside the live decode.
    assert so.num_scheduled_tokens == {"bg": 1, "bg-dec": 1, "live": 1}
    drain(sched)
    assert bg.is_finished and bg_decoding.is_finished and sched.kv.num_free_blocks == sched.kv.num_blocks


# ---------------------------------------------------------------- priority
def test_high_priority_waits_ahead_of_earlier_low_priority() -> None:
    sched = make_sched(max_seqs=1)
    add(sched, "run", 4, max_tokens=2, priority=0)
    step(sched)
    for i in range(3):
        add(sched, f"low{i}", 4, priority=5)
    add(sched, "high", 4, priority=1)
    assert [r.request_id for r in sched.waiting] == ["high", "low0", "low1", "low2"]
    # "run" (priority 0) is not preempted by anybody; "high" is next once it finishes.
    so, _ = step(sched)
    assert not so.preempted_req_ids and list(so.num_scheduled_tokens) == ["run"]
    so, _ = step(sched)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["high"]


def test_waiting_high_priority_preempts_lowest_priority_for_a_seat() -> None:
    sched = make_sched(max_seqs=2)
    a = add(sched, "a", 8, max_tokens=6, priority=3)
    b = add(sched, "b", 8, max_tokens=6, priority=3)
    step(sched)
    step(sched)
    assert {r.request_id for r in sched.running} == {"a", "b"}
    add(sched, "c", 8, max_tokens=6, priority=9)  # lower priority: must not preempt
    so, _ = step(sched)
    assert not so.preempted_req_ids
    add(sched, "hi", 8, max_tokens=2, priority=0)
    so, _ = step(sched)
    # The victim is the lowest priority, latest arrival among equals: b. "a" keeps decoding.
    assert so.preempted_req_ids == {"b"}
    assert [n.req_id for n in so.scheduled_new_reqs] == ["hi"]
    assert "a" in so.num_scheduled_tokens
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.kv.get_block_ids("b")[0] == []
    # b goes back ahead of c (priority 3 before 9).
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    out_b = list(b.output_token_ids)
    drain(sched)
    assert a.is_finished and b.is_finished and b.num_preemptions == 1
    assert b.output_token_ids[: len(out_b)] == out_b and len(b.output_token_ids) == 6
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_waiting_high_priority_preempts_for_blocks_and_undoes_the_victims_step() -> None:
    # 8 blocks of 4 tokens: two 12-token prompts take 3 blocks each (+1 for decoding).
    sched = make_sched(num_blocks=8, max_seqs=8)
    low1 = add(sched, "low1", 12, max_tokens=8, priority=5)
    add(sched, "low2", 12, max_tokens=8, priority=4)
    step(sched)
    add(sched, "hi", 12, max_tokens=2, priority=0)
    so, _ = step(sched)
    # low1 is the lowest priority: it was scheduled for a decode earlier in this step,
    # then preempted for "hi"; its decode token is undone and not in the batch.
    assert so.preempted_req_ids == {"low1"}
    assert "low1" not in so.num_scheduled_tokens
    assert "hi" in so.num_scheduled_tokens and "low2" in so.num_scheduled_tokens
    assert low1.num_computed_tokens == 0 and low1.status == RequestStatus.PREEMPTED
    drain(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_running_preemption_victim_is_lowest_priority() -> None:
    # Blocks run out while running requests decode: the victim is the lowest
    # priority one even though it was admitted first.
    sched = make_sched(num_blocks=6, budget=64)
    low = add(sched, "low", 8, max_tokens=12, priority=9)
    add(sched, "mid", 8, max_tokens=12, priority=1)
    add(sched, "top", 4, max_tokens=12, priority=0)
    outs = drain(sched)
    victims = [rid for so in outs for rid in sorted(so.preempted_req_ids)]
    # fcfs would evict "top", admitted last; here the lowest priority goes first, and
    # the highest priority is never a victim.
    assert victims and victims[0] == "low" and "top" not in victims
    assert low.is_finished and low.num_output_tokens == 12


# ---------------------------------------------------------------- long prefills
def _short_ttft_behind_longs(**knobs) -> tuple[list[int], Scheduler, SchedulerOutput]:
    """Three 100-token prompts, then three 8-token ones, budget 32. Returns the short
    requests' TTFT in steps, the scheduler (drained) and the first step's output."""
    sched = make_sched("fcfs", budget=32, **knobs)
    longs = [add(sched, f"long{i}", 100, max_tokens=2) for i in range(3)]
    shorts = [add(sched, f"short{i}", 8, max_tokens=2) for i in range(3)]
    first_token_step: dict[str, int] = {}
    first_out = None
    n = 0
    while sched.has_unfinished_requests():
        so, sampled = step(sched)
        first_out = first_out or so
        n += 1
        if knobs:
            in_progress = [r for r in sched.running if r.long_prefill_end > r.num_computed_tokens]
            assert len(in_progress) <= knobs["max_long_partial_prefills"]
        for rid in sampled:
            first_token_step.setdefault(rid, n)
    assert all(r.is_finished for r in longs + shorts)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    return sorted(first_token_step[s.request_id] for s in shorts), sched, first_out


def test_long_prefill_cap_lets_short_prompts_pass() -> None:
    capped, _, first = _short_ttft_behind_longs(max_long_partial_prefills=1, long_prefill_token_threshold=16)
    # One long prefill at a time, its chunk held to the threshold; the shorts fill the rest.
    assert first.num_scheduled_tokens == {"long0": 16, "short0": 8, "short1": 8}
    assert capped == [1, 1, 2]
    # Without the knobs the three long prompts go first (300 tokens at 32 a step).
    plain, _, first = _short_ttft_behind_longs()
    assert first.num_scheduled_tokens == {"long0": 32}
    assert min(plain) >= 9


def test_long_prefill_alone_uses_the_whole_budget() -> None:
    sched = make_sched("fcfs", budget=32, max_long_partial_prefills=1, long_prefill_token_threshold=16)
    add(sched, "long", 100, max_tokens=2)
    so, _ = step(sched)
    # Held to 16 first, then topped up with what nobody else wanted.
    assert so.num_scheduled_tokens == {"long": 32}
    assert len(sched.kv.get_block_ids("long")[0]) == 8
    drain(sched)


def test_long_prefill_threshold_default_is_4_percent_of_context() -> None:
    assert SchedulerConfig(max_model_len=1000, max_long_partial_prefills=1).long_prefill_threshold == 40
    assert SchedulerConfig(max_model_len=1000).long_prefill_threshold is None


# ---------------------------------------------------------------- fair share
def test_fair_shares_budget_by_weight_and_is_work_conserving() -> None:
    tenants = (TenantSpec("a", weight=1), TenantSpec("b", weight=3))
    sched = make_sched("fair", budget=32, tenants=tenants)
    add(sched, "a1", 100, tenant="a")
    add(sched, "b1", 100, tenant="b")
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a1": 8, "b1": 24}
    sched2 = make_sched("fair", budget=32, tenants=tenants)
    add(sched2, "a1", 100, tenant="a")
    so, _ = step(sched2)
    assert so.num_scheduled_tokens == {"a1": 32}
    # A tenant that needs little (one decode) leaves the rest of its share to the other.
    sched3 = make_sched("fair", budget=32, max_seqs=64, tenants=tenants)
    for i in range(40):
        add(sched3, f"a{i}", 1, max_tokens=3, tenant="a")
    add(sched3, "b1", 1, max_tokens=3, tenant="b")
    for _ in range(2):
        so, _ = step(sched3)
        assert so.num_scheduled_tokens.get("b1") == 1 and so.total_num_scheduled_tokens == 32


def test_fair_max_running_per_tenant() -> None:
    tenants = (TenantSpec("a", max_running=1),)
    sched = make_sched("fair", budget=64, tenants=tenants)
    for i in range(3):
        add(sched, f"a{i}", 4, max_tokens=3, tenant="a")
    add(sched, "b0", 4, max_tokens=3, tenant="b")
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"a0", "b0"}
    while sched.has_unfinished_requests():
        step(sched)
        assert sum(1 for r in sched.running if r.tenant == "a") <= 1


def _ttft_steps(policy: str, with_heavy: bool) -> list[int]:
    """Light tenant: one 16-token prompt every 5 steps. Heavy tenant (with_heavy): two
    24-token prompts every step, 10x the light tenant's requests and more than the
    32-token budget can serve. Returns the light requests' TTFT in steps."""
    sched = make_sched(policy, budget=32, max_seqs=16, num_blocks=4096)
    arrived: dict[str, int] = {}
    first: dict[str, int] = {}
    for n in range(200):
        if n < 60:
            if n % 5 == 0:
                add(sched, f"light{n}", 16, max_tokens=4, tenant="light")
                arrived[f"light{n}"] = n
            if with_heavy:
                for k in range(2):
                    add(sched, f"heavy{n}-{k}", 24, max_tokens=8, tenant="heavy")
        if not sched.has_unfinished_requests():
            break
        _, sampled = step(sched)
        for rid in sampled:
            if rid in arrived:
                first.setdefault(rid, n - arrived[rid] + 1)
    assert set(first) == set(arrived)
    return sorted(first.values())


def p90(values: list[int]) -> int:
    return values[int(0.9 * (len(values) - 1))]


def test_fair_keeps_light_tenant_ttft_under_a_heavy_flood() -> None:
    alone = p90(_ttft_steps("fair", with_heavy=False))
    fair = p90(_ttft_steps("fair", with_heavy=True))
    fcfs = p90(_ttft_steps("fcfs", with_heavy=True))
    print(f"light tenant TTFT p90 in steps: alone {alone}, fair {fair}, fcfs {fcfs}")
    assert alone == 1
    assert fair <= 2 * alone
    assert fcfs >= 10 * alone  # behind the heavy tenant's ever longer queue


# ---------------------------------------------------------------- everything at once
@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
@pytest.mark.parametrize("knobs", [{}, {"max_long_partial_prefills": 1, "long_prefill_token_threshold": 12},
                                   {"preemption_mode": "swap", "num_host_blocks": 6}])
def test_random_load_keeps_invariants_and_frees_every_block(policy: str, knobs: dict) -> None:
    import random

    rng = random.Random(zlib.crc32(repr((policy, sorted(knobs.items()))).encode()))
    tenants = (TenantSpec("t0", weight=3, max_running=3), TenantSpec("t1"))
    sched = make_sched(policy, num_blocks=24, block_size=4, budget=24, max_seqs=5, tenants=tenants, **knobs)
    reqs: list[Request] = []
    for n in range(300):
        if n < 200 and rng.random() < 0.5:
            prio = rng.randint(0, 3) if policy != "fcfs" else 0
            reqs.append(add(sched, f"r{n}", rng.randint(1, 40), max_tokens=rng.randint(1, 10), priority=prio,
                            tenant=rng.choice(["t0", "t1", "t2", None])))  # fmt: skip
        if rng.random() < 0.05 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        if sched.has_unfinished_requests():
            step(sched)
    drain(sched, max_steps=2000)
    assert all(r.is_finished for r in reqs)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert not sched.fair.num_running and not sched.fair.num_unfinished
    sched.schedule()  # releases host blocks of the last swap-in
    assert sched.host.num_free_blocks == sched.host.num_blocks
    if knobs.get("preemption_mode") == "swap":
        assert sched.num_swap_preemptions > 0
    for r in reqs:
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.max_output_tokens


# ---------------------------------------------------------------- swap preemption
def test_swap_preemption_keeps_progress_and_moves_blocks_both_ways() -> None:
    # 6 device blocks of 4; a (8 prompt) and b (8 prompt) each need 3 blocks to decode 4 tokens.
    sched = make_sched("fcfs", num_blocks=5, budget=32, preemption_mode="swap", num_host_blocks=8)
    a = add(sched, "a", 8, max_tokens=6)
    b = add(sched, "b", 8, max_tokens=6)
    swaps_out: list[tuple[int, int]] = []
    swaps_in: list[tuple[int, int]] = []
    swapped_progress = None
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        swaps_out += so.swap_out
        swaps_in += so.swap_in
        if so.swap_out and swapped_progress is None:
            assert so.preempted_req_ids == {"b"}
            # b keeps what it computed, holds host blocks and no device blocks.
            assert b.num_computed_tokens > 0 and len(b.host_block_ids) == -(-b.num_computed_tokens // 4)
            assert sched.kv.get_block_ids("b")[0] == []
            swapped_progress = b.num_computed_tokens
        if so.swap_in:
            new = {n.req_id: n for n in so.scheduled_new_reqs}
            # Resumed where it stopped, not recomputed from scratch.
            assert new["b"].num_computed_tokens == swapped_progress
            assert [d for _, d in so.swap_in] == new["b"].block_ids[0][: len(so.swap_in)]
    assert swaps_out and len(swaps_in) == len(swaps_out)
    assert sorted(h for h, _ in swaps_in) == sorted(h for _, h in swaps_out)
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6 and b.num_preemptions >= 1
    assert sched.num_swap_preemptions >= 1
    step(sched) if sched.has_unfinished_requests() else sched.schedule()  # releases the last host blocks
    assert sched.host.num_free_blocks == sched.host.num_blocks
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    stats = sched.make_stats()
    assert stats.num_swapped_out_blocks == stats.num_swapped_in_blocks == len(swaps_out)


def test_swap_falls_back_to_recompute_when_host_pool_is_full_and_auto_swaps_long_ones() -> None:
    sched = make_sched("fcfs", num_blocks=5, budget=32, preemption_mode="swap", num_host_blocks=1)
    add(sched, "a", 8, max_tokens=6)
    b = add(sched, "b", 8, max_tokens=6)
    drain(sched)
    assert b.num_preemptions >= 1 and sched.num_swap_preemptions == 0  # 2+ blocks do not fit in 1
    auto = make_sched("fcfs", num_blocks=5, budget=32, preemption_mode="auto", num_host_blocks=8,
                      auto_swap_min_tokens=100)  # fmt: skip
    add(auto, "a", 8, max_tokens=6)
    add(auto, "b", 8, max_tokens=6)
    drain(auto)
    assert auto.num_preemptions >= 1 and auto.num_swap_preemptions == 0  # short: recomputed
    with pytest.raises(ValueError, match="host pool"):
        SchedulerConfig(preemption_mode="swap")


def test_aborting_a_swapped_request_frees_its_host_blocks() -> None:
    sched = make_sched("fcfs", num_blocks=5, budget=32, preemption_mode="swap", num_host_blocks=8)
    add(sched, "a", 8, max_tokens=6)
    b = add(sched, "b", 8, max_tokens=6)
    while not b.host_block_ids:
        step(sched)
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    assert sched.host.num_free_blocks == sched.host.num_blocks
    drain(sched)
