"""Scheduler scenarios driven by a fake model runner."""

from __future__ import annotations

import itertools
import zlib
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import EngineCoreOutput
from pagoda.core.request import Request, RequestStatus
from pagoda.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagoda.core.scheduler import Scheduler, SchedulerConfig
from pagoda.sampling_params import SamplingParams


def make_sched(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 32,
    max_seqs: int = 16,
    max_model_len: int = 256,
    caching: bool = True,
) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_model_len)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, caching))


def make_req(
    sched: Scheduler,
    rid: str,
    prompt: list[int] | int,
    max_tokens: int | None = 4,
    eos: frozenset[int] = frozenset(),
    **params,
) -> Request:
    if isinstance(prompt, int):
        # Distinct token ids per request, so no accidental prefix hits.
        base = 1000 * (zlib.crc32(rid.encode()) % 100_000 + 1)
        prompt = list(range(base, base + prompt))
    req = Request(
        rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **params),
        eos_token_ids=eos, max_model_len=sched.config.max_model_len,
    )
    sched.add_request(req)
    return req


def default_token(req: Request) -> int:
    return 10 + req.num_output_tokens


def step(
    sched: Scheduler, token_fn: Callable[[Request], int] = default_token
) -> tuple[SchedulerOutput, list[EngineCoreOutput], dict[str, list[int]]]:
    """One engine step: schedule, fake forward, update. Checks integrity and basic invariants."""
    sched.check_integrity()
    running_before = list(sched.running)
    so = sched.schedule()
    sched.check_integrity()
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    assert all(n >= 1 for n in so.num_scheduled_tokens.values())
    assert len(sched.running) <= sched.config.max_num_seqs
    assert len(so.num_scheduled_tokens) <= sched.config.max_num_seqs
    # Victims are the most recently admitted running requests, now at the front of waiting.
    if so.preempted_req_ids:
        k = len(so.preempted_req_ids)
        victims = [r.request_id for r in running_before[-k:]]
        assert set(victims) == so.preempted_req_ids
        assert [r.request_id for r in list(sched.waiting)[:k]] == victims
        assert not so.scheduled_new_reqs
        for rid in victims:
            victim = next(r for r in running_before if r.request_id == rid)
            assert victim.status == RequestStatus.PREEMPTED
            assert victim.num_computed_tokens == 0
            assert rid not in so.num_scheduled_tokens
            assert sched.kv.get_block_ids(rid)[0] == []
    # Running requests are served oldest first; one is skipped only when the
    # budget ran out or it was preempted.
    kept = [r.request_id for r in running_before if r.request_id not in so.preempted_req_ids]
    cached = [c.req_id for c in so.scheduled_cached_reqs]
    assert cached == kept[: len(cached)]
    if len(cached) < len(kept):
        assert so.total_num_scheduled_tokens == sched.config.max_num_batched_tokens
    assert list(so.num_scheduled_tokens) == cached + [n.req_id for n in so.scheduled_new_reqs]
    sampled: dict[str, list[int]] = {}
    tokens = []
    for rid in so.num_scheduled_tokens:
        req = sched.requests[rid]
        assert req.num_computed_tokens <= req.num_tokens
        assert len(sched.kv.get_block_ids(rid)[0]) * sched.kv.block_size >= req.num_computed_tokens
        if req.num_computed_tokens == req.num_tokens:
            t = token_fn(req)
            sampled[rid] = [t]
            tokens.append([t])
        else:
            tokens.append([])
    out = sched.update_from_output(
        so, ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens), sampled_token_ids=tokens)
    )
    sched.check_integrity()
    return so, out, sampled


def run_to_completion(sched: Scheduler, token_fn=default_token, max_steps: int = 2000):
    outputs: dict[str, list[EngineCoreOutput]] = {}
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so, out, _ = step(sched, token_fn)
        steps.append(so)
        for o in out:
            outputs.setdefault(o.request_id, []).append(o)
    else:
        raise AssertionError("scheduler did not finish")
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.check_integrity()
    return outputs, steps


def tokens_of(outs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


# ---------------------------------------------------------------- admission errors


def test_prompt_too_long_raises() -> None:
    sched = make_sched(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        make_req(sched, "eq", 16, max_tokens=None)
    with pytest.raises(ValueError):
        sched.add_request(Request("gt", list(range(20)), SamplingParams(max_tokens=1)))
    assert not sched.has_unfinished_requests()
    make_req(sched, "ok", 15, max_tokens=None)
    assert sched.num_unfinished_requests == 1
    sched.check_integrity()


def test_duplicate_id_raises() -> None:
    sched = make_sched()
    make_req(sched, "a", 4)
    with pytest.raises(ValueError, match="duplicate"):
        make_req(sched, "a", 5)
    assert sched.num_unfinished_requests == 1
    step(sched)
    with pytest.raises(ValueError, match="duplicate"):
        make_req(sched, "a", 5)  # still running
    run_to_completion(sched)
    make_req(sched, "a", 5)  # a finished id may be reused
    run_to_completion(sched)


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=-1)


# ---------------------------------------------------------------- budget, chunking


def test_simple_request_lifecycle() -> None:
    sched = make_sched(budget=32)
    req = make_req(sched, "a", 10, max_tokens=3)
    so, out, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 10}
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a"]
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 0 and new.output_token_ids == []
    assert new.block_ids[0] == [0, 1, 2]
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in out] == [("a", [10], None)]
    so, out, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.scheduled_cached_reqs[0].num_computed_tokens == 10
    so, out, _ = step(sched)
    assert out[0].new_token_ids == [12]
    assert out[0].finish_reason == "length"
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == [10, 11, 12]
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    so = sched.schedule()
    assert so.is_empty
    assert so.finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == set()


def test_chunked_prefill_does_not_starve_decode() -> None:
    sched = make_sched(budget=16, num_blocks=64)
    d = make_req(sched, "d", 4, max_tokens=20)
    step(sched)  # d's prompt
    long = make_req(sched, "long", 100, max_tokens=2)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        chunk = min(15, 100 - long.num_computed_tokens)  # the budget less d's decode token
        so, out, sampled = step(sched)
        assert so.num_scheduled_tokens["d"] == 1  # the decode runs every step
        assert so.num_scheduled_tokens["long"] == chunk and so.total_num_scheduled_tokens == 1 + chunk
        chunks.append(so.num_scheduled_tokens["long"])
        if long.num_computed_tokens < 100:
            assert "long" not in sampled  # a prompt chunk samples nothing
            assert all(o.request_id != "long" for o in out)
        else:
            assert sampled["long"] == [10]
    assert chunks == [15] * 6 + [10]
    assert long.output_token_ids == [10]
    assert d.num_output_tokens == 1 + len(chunks)
    outputs, _ = run_to_completion(sched)
    assert d.num_output_tokens == 20 and long.num_output_tokens == 2


def test_long_prompt_first_then_short_requests() -> None:
    sched = make_sched(budget=8, num_blocks=64)
    make_req(sched, "long", 20, max_tokens=2)
    make_req(sched, "s1", 3, max_tokens=2)
    so, _, _ = step(sched)
    assert so.num_scheduled_tokens == {"long": 8}
    so, _, _ = step(sched)
    assert so.num_scheduled_tokens == {"long": 8}
    so, _, _ = step(sched)
    # The rest of the prompt (4) plus the waiting request fills the budget.
    assert so.num_scheduled_tokens == {"long": 4, "s1": 3}
    so, _, _ = step(sched)
    assert so.num_scheduled_tokens == {"long": 1, "s1": 1}


@settings(max_examples=60, deadline=None)
@given(
    budget=st.integers(1, 40),
    reqs=st.lists(st.tuples(st.integers(1, 50), st.integers(1, 6), st.integers(0, 5)), min_size=1, max_size=8),
)
def test_budget_never_exceeded_and_used_fully(budget: int, reqs) -> None:
    """With ample KV blocks and seats, every step computes min(budget, available work)."""
    sched = make_sched(num_blocks=512, block_size=4, budget=budget, max_seqs=64, max_model_len=128)
    pending = sorted(enumerate(reqs), key=lambda x: x[1][2])  # by arrival step
    all_reqs: list[tuple[Request, int]] = []
    for n in itertools.count():
        while pending and pending[0][1][2] <= n:
            i, (plen, max_tokens, _) = pending.pop(0)
            all_reqs.append((make_req(sched, f"r{i}", plen, max_tokens=max_tokens), max_tokens))
        if not sched.has_unfinished_requests():
            if not pending:
                break
            continue
        available = sum(r.num_tokens - r.num_computed_tokens for r in sched.requests.values())
        so, _, _ = step(sched)
        assert so.total_num_scheduled_tokens == min(budget, available)
        # Running requests come first in the batch, in admission order.
        assert list(so.num_scheduled_tokens)[: len(so.scheduled_cached_reqs)] == [
            c.req_id for c in so.scheduled_cached_reqs
        ]
        assert n < 2000
    assert len(all_reqs) == len(reqs)
    for r, max_tokens in all_reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == max_tokens
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_max_num_seqs() -> None:
    sched = make_sched(budget=64, max_seqs=2)
    reqs = [make_req(sched, f"r{i}", 5, max_tokens=3 + i) for i in range(5)]
    so, _, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    so, _, _ = step(sched)
    so, out, _ = step(sched)
    assert [o.request_id for o in out if o.finished] == ["r0"]
    # The freed seat goes to the next waiting request.
    so, _, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"r1", "r2"}
    assert [n.req_id for n in so.scheduled_new_reqs] == ["r2"]
    run_to_completion(sched)
    assert [r.num_output_tokens for r in reqs] == [3, 4, 5, 6, 7]


# ---------------------------------------------------------------- stopping


def test_stop_on_max_tokens() -> None:
    sched = make_sched()
    req = make_req(sched, "a", 6, max_tokens=5, eos=frozenset({99}))
    outputs, _ = run_to_completion(sched)
    outs = outputs["a"]
    assert tokens_of(outs) == [10, 11, 12, 13, 14]
    assert [o.finish_reason for o in outs] == [None] * 4 + ["length"]
    assert outs[-1].stop_reason is None
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_stop_at_context_length() -> None:
    sched = make_sched(max_model_len=12, num_blocks=8)
    req = make_req(sched, "a", 9, max_tokens=None)
    outputs, _ = run_to_completion(sched)
    assert req.num_output_tokens == 3 and req.num_tokens == 12
    assert outputs["a"][-1].finish_reason == "length"


def test_stop_on_eos() -> None:
    sched = make_sched()
    seq = {0: 5, 1: 6, 2: 2, 3: 7}
    req = make_req(sched, "a", 6, max_tokens=10, eos=frozenset({2, 3}))
    outputs, _ = run_to_completion(sched, lambda r: seq[r.num_output_tokens])
    outs = outputs["a"]
    assert tokens_of(outs) == [5, 6, 2]  # the EOS token is part of the output
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].stop_reason is None
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos() -> None:
    sched = make_sched()
    req = make_req(sched, "a", 6, max_tokens=4, eos=frozenset({2}), ignore_eos=True)
    outputs, _ = run_to_completion(sched, lambda r: 2)
    assert tokens_of(outputs["a"]) == [2, 2, 2, 2]
    assert outputs["a"][-1].finish_reason == "length"
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_stop_token_ids() -> None:
    sched = make_sched()
    seq = [4, 8, 7, 1]
    make_req(sched, "a", 6, max_tokens=10, stop_token_ids=[7, 9])
    # ignore_eos does not disable stop_token_ids.
    make_req(sched, "b", 6, max_tokens=10, stop_token_ids=[8], ignore_eos=True)
    outputs, _ = run_to_completion(sched, lambda r: seq[r.num_output_tokens])
    assert tokens_of(outputs["a"]) == [4, 8, 7]
    assert outputs["a"][-1].finish_reason == "stop"
    assert outputs["a"][-1].stop_reason == 7
    assert tokens_of(outputs["b"]) == [4, 8]
    assert outputs["b"][-1].stop_reason == 8


def test_min_tokens_delays_eos() -> None:
    sched = make_sched()
    make_req(sched, "a", 6, max_tokens=10, eos=frozenset({2}), min_tokens=3)
    make_req(sched, "b", 6, max_tokens=10, stop_token_ids=[2], min_tokens=4)
    make_req(sched, "c", 6, max_tokens=10, eos=frozenset({2}))
    outputs, _ = run_to_completion(sched, lambda r: 2)
    assert tokens_of(outputs["a"]) == [2, 2, 2]
    assert outputs["a"][-1].finish_reason == "stop"
    assert tokens_of(outputs["b"]) == [2, 2, 2, 2]
    assert outputs["b"][-1].stop_reason == 2
    assert tokens_of(outputs["c"]) == [2]


def test_min_tokens_equal_max_tokens() -> None:
    sched = make_sched()
    make_req(sched, "a", 6, max_tokens=3, eos=frozenset({2}), min_tokens=3)
    outputs, _ = run_to_completion(sched, lambda r: 2)
    assert tokens_of(outputs["a"]) == [2, 2, 2]
    assert outputs["a"][-1].finish_reason == "stop"  # EOS at the last allowed token


def test_logprobs_passed_through() -> None:
    sched = make_sched()
    make_req(sched, "a", 3, max_tokens=1)
    so = sched.schedule()
    out = sched.update_from_output(
        so, ModelRunnerOutput(["a"], [[5]], logprobs=[[(-0.5, [5, 6], [-0.5, -1.0])]])
    )
    assert out[0].new_logprobs is not None
    lp = out[0].new_logprobs[0]
    assert (lp.logprob, lp.top_token_ids, lp.top_logprobs) == (-0.5, [5, 6], [-0.5, -1.0])
    sched.check_integrity()


# ---------------------------------------------------------------- preemption


def test_preemption_most_recent_first() -> None:
    # 4 blocks of 4 tokens; A and B each take 2 blocks for a 7-token prompt.
    sched = make_sched(num_blocks=4, block_size=4, budget=64)
    a = make_req(sched, "a", 7, max_tokens=4)
    b = make_req(sched, "b", 7, max_tokens=4)
    so, _, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 7, "b": 7}
    so, _, _ = step(sched)  # both decode into position 7: still 2 blocks each
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert sched.kv.num_free_blocks == 0
    assert a.output_token_ids == b.output_token_ids == [10, 11]

    # A needs a third block: B (admitted last) is preempted.
    so, out, _ = step(sched)
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED
    assert list(sched.waiting) == [b]
    assert b.output_token_ids == [10, 11]  # kept
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert [o.request_id for o in out] == ["a"]
    assert sched.make_stats().num_preemptions == 1

    outputs, steps = run_to_completion(sched)
    assert a.num_output_tokens == 4 and a.status == RequestStatus.FINISHED_LENGTH
    # B resumes with its prompt and kept outputs sent whole, and still
    # ends with exactly max_tokens outputs: 7 + 4 tokens in all.
    resumed = [n for s in steps for n in s.scheduled_new_reqs if n.req_id == "b"]
    assert len(resumed) == 1
    assert resumed[0].output_token_ids == [10, 11]
    assert b.output_token_ids == [10, 11, 12, 13]
    assert b.num_tokens == 11
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert tokens_of(outputs["b"]) == [12, 13]


def test_preemption_order_three_requests() -> None:
    # 6 blocks of 2 tokens; three 3-token prompts take 2 blocks each.
    sched = make_sched(num_blocks=6, block_size=2, budget=64, caching=False)
    reqs = [make_req(sched, n, 3, max_tokens=6) for n in ("a", "b", "c")]
    step(sched)
    so, _, _ = step(sched)  # decode into position 3: still 2 blocks each
    assert sched.kv.num_free_blocks == 0
    so, _, _ = step(sched)
    # a needs a third block: c (admitted last) goes, and its 2 blocks cover a and b.
    assert so.preempted_req_ids == {"c"}
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    so, _, _ = step(sched)
    assert so.preempted_req_ids == set()
    so, _, _ = step(sched)
    # Both need a block again: b (the most recent running) goes, then a fits.
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # front, in admission order
    run_to_completion(sched)
    for r in reqs:
        assert r.num_output_tokens == 6
        assert r.output_token_ids == [10, 11, 12, 13, 14, 15]
        assert r.num_tokens == 9


def test_last_running_request_preempts_itself() -> None:
    # 5 blocks of 2: a and b take 2 each; at position 4 a takes the last free
    # block, and b, the most recent, has nobody to evict but itself.
    sched = make_sched(num_blocks=5, block_size=2, budget=64, caching=False)
    a = make_req(sched, "a", 3, max_tokens=4)
    b = make_req(sched, "b", 3, max_tokens=4)
    step(sched)
    step(sched)
    so, _, _ = step(sched)
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    assert [c.req_id for c in so.scheduled_cached_reqs] == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.output_token_ids == [10, 11]
    assert sched.kv.num_free_blocks == 2
    run_to_completion(sched)
    assert a.output_token_ids == b.output_token_ids == [10, 11, 12, 13]


def test_prompt_waits_for_blocks() -> None:
    sched = make_sched(num_blocks=3, block_size=2, budget=64, caching=False)
    a = make_req(sched, "a", 5, max_tokens=1)  # 3 blocks, finishes at once
    b = make_req(sched, "b", 3, max_tokens=3)
    so, _, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 5}  # b does not fit yet
    assert a.is_finished
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    so, _, _ = step(sched)
    assert so.num_scheduled_tokens == {"b": 3}
    run_to_completion(sched)
    assert b.num_output_tokens == 3


def test_preempted_request_hits_its_own_prefix() -> None:
    sched = make_sched(num_blocks=6, block_size=4, budget=64)
    a = make_req(sched, "a", 8, max_tokens=9)
    b = make_req(sched, "b", 8, max_tokens=9)
    saw_resume = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        so, _, _ = step(sched)
        for n in so.scheduled_new_reqs:
            if n.output_token_ids:
                saw_resume.append(n)
    assert saw_resume, "expected a preemption and a resume"
    # The resumed request hit at least its first prompt block.
    assert any(n.num_computed_tokens >= 4 for n in saw_resume)
    for r in (a, b):
        assert r.output_token_ids == list(range(10, 19))
        assert r.num_cached_tokens == 0  # set at first admission only
    assert sched.kv.num_free_blocks == 6


# ---------------------------------------------------------------- abort


def test_abort_waiting_request() -> None:
    sched = make_sched(budget=8, max_seqs=1)
    make_req(sched, "a", 4, max_tokens=5)
    make_req(sched, "w", 4, max_tokens=5)
    step(sched)
    assert [r.request_id for r in sched.waiting] == ["w"]
    ended = sched.finish_requests(["w", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in ended] == ["w"]
    assert ended[0].status == RequestStatus.FINISHED_ABORTED
    assert ended[0].status.finish_reason == "abort"
    assert "w" not in sched.requests and not sched.waiting
    sched.check_integrity()
    so, _, _ = step(sched)
    assert so.finished_req_ids == {"w"}
    # Aborting again is a no-op.
    assert sched.finish_requests(["w"], RequestStatus.FINISHED_ABORTED) == []
    run_to_completion(sched)


def test_abort_running_request_frees_blocks() -> None:
    sched = make_sched(num_blocks=16, block_size=4, budget=64)
    a = make_req(sched, "a", 10, max_tokens=10)
    make_req(sched, "b", 6, max_tokens=10)
    step(sched)
    step(sched)
    assert sched.kv.get_block_ids("a")[0] == [0, 1, 2]
    free_before = sched.kv.num_free_blocks
    ended = sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert ended == [a] and a.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.get_block_ids("a")[0] == []
    assert sched.kv.num_free_blocks == free_before + 3
    assert [r.request_id for r in sched.running] == ["b"]
    sched.check_integrity()
    so, out, _ = step(sched)
    assert so.finished_req_ids == {"a"}
    assert "a" not in so.num_scheduled_tokens
    assert [o.request_id for o in out] == ["b"]
    run_to_completion(sched)


def test_abort_between_schedule_and_update() -> None:
    sched = make_sched()
    make_req(sched, "a", 4, max_tokens=5)
    make_req(sched, "b", 4, max_tokens=5)
    so = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = sched.update_from_output(so, ModelRunnerOutput(["a", "b"], [[1], [1]]))
    assert [o.request_id for o in out] == ["b"]
    sched.check_integrity()
    assert sched.schedule().finished_req_ids == {"a"}


def test_abort_preempted_request() -> None:
    sched = make_sched(num_blocks=4, block_size=4, budget=64)
    make_req(sched, "a", 7, max_tokens=6)
    b = make_req(sched, "b", 7, max_tokens=6)
    for _ in range(3):
        step(sched)
    assert b.status == RequestStatus.PREEMPTED
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert not sched.waiting
    sched.check_integrity()
    so, _, _ = step(sched)
    assert so.finished_req_ids == {"b"}
    run_to_completion(sched)


def test_finish_requests_rejects_unfinished_status() -> None:
    sched = make_sched()
    make_req(sched, "a", 4)
    with pytest.raises(ValueError):
        sched.finish_requests(["a"], RequestStatus.RUNNING)
    assert "a" in sched.requests


def test_finish_stopped_from_outside() -> None:
    sched = make_sched()
    r = make_req(sched, "a", 4, max_tokens=10)
    step(sched)
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert r.status.finish_reason == "stop"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.schedule().finished_req_ids == {"a"}


# ---------------------------------------------------------------- prefix caching


def test_prefix_hit_reported_in_output() -> None:
    sched = make_sched(num_blocks=32, block_size=16, budget=128)
    shared = list(range(500, 532))
    a = make_req(sched, "a", shared + [1] * 8, max_tokens=2)
    run_to_completion(sched)
    b = make_req(sched, "b", shared + [2] * 8, max_tokens=2)
    so, out, _ = step(sched)
    assert so.num_scheduled_tokens == {"b": 8}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 32
    assert so.scheduled_new_reqs[0].block_ids[0][:2] == [0, 1]
    assert out[0].num_cached_tokens == 32
    assert b.num_cached_tokens == 32
    outputs, _ = run_to_completion(sched)
    assert all(o.num_cached_tokens == 32 for o in outputs["b"])
    assert a.num_cached_tokens == 0
    stats = sched.make_stats()
    assert stats.prefix_cache_hits == 32
    assert stats.prefix_cache_queries == 80


def test_identical_prompts_in_one_step_share_blocks() -> None:
    sched = make_sched(num_blocks=32, block_size=16, budget=128)
    prompt = list(range(700, 740))
    make_req(sched, "a", prompt, max_tokens=3)
    make_req(sched, "b", prompt, max_tokens=3)
    so, out, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 40, "b": 8}
    a_ids = so.scheduled_new_reqs[0].block_ids[0]
    b_ids = so.scheduled_new_reqs[1].block_ids[0]
    assert b_ids[:2] == a_ids[:2] and b_ids[2] != a_ids[2]
    assert {o.request_id: o.num_cached_tokens for o in out} == {"a": 0, "b": 32}
    run_to_completion(sched)


def test_salted_requests_do_not_share() -> None:
    sched = make_sched(num_blocks=32, block_size=16, budget=128)
    prompt = list(range(700, 740))
    make_req(sched, "a", prompt, max_tokens=1)
    run_to_completion(sched)
    req = Request("s", prompt, SamplingParams(max_tokens=1), cache_salt="t1", max_model_len=256)
    sched.add_request(req)
    so, out, _ = step(sched)
    assert so.num_scheduled_tokens == {"s": 40}
    assert out[0].num_cached_tokens == 0


# ---------------------------------------------------------------- random workloads


@settings(max_examples=120, deadline=None)
@given(
    num_blocks=st.integers(3, 12),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 8),
    caching=st.booleans(),
    reqs=st.lists(
        st.tuples(
            st.lists(st.integers(0, 2), min_size=1, max_size=16),  # prompt (collides)
            st.integers(1, 12),                                    # max_tokens
            st.integers(0, 6),                                     # arrival step
            st.integers(0, 80),                                    # abort at step (rarely hit)
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_random_workload(num_blocks, block_size, budget, max_seqs, caching, reqs) -> None:
    # The pool always fits one request of max_model_len tokens, like the engine guarantees.
    max_model_len = min(num_blocks * block_size, 24)
    sched = make_sched(num_blocks, block_size, budget, max_seqs, max_model_len, caching)
    live: dict[str, Request] = {}
    done: dict[str, Request] = {}
    aborted: set[str] = set()
    finished_seen: set[str] = set()
    expect_finished: set[str] = set()
    emitted: dict[str, list[int]] = {}
    pending = {f"r{i}": r for i, r in enumerate(reqs)}
    for n in range(3000):
        for rid, (prompt, max_tokens, arrival, _) in list(pending.items()):
            if arrival <= n:
                del pending[rid]
                live[rid] = make_req(sched, rid, prompt[: max_model_len - 1], max_tokens=max_tokens)
        for i, (_, _, _, abort_at) in enumerate(reqs):
            rid = f"r{i}"
            if abort_at == n and rid in live:
                ended = sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                assert [r.request_id for r in ended] == [rid]
                aborted.add(rid)
                done[rid] = live.pop(rid)
                expect_finished.add(rid)
                assert sched.kv.get_block_ids(rid)[0] == []
        if not sched.has_unfinished_requests() and not pending:
            break
        so, out, _ = step(sched, lambda r: (r.num_output_tokens * 7 + len(r.request_id)) % 3)
        assert so.finished_req_ids <= expect_finished
        finished_seen |= so.finished_req_ids
        for o in out:
            emitted.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.finish_reason == "length"
                done[o.request_id] = live.pop(o.request_id)
                expect_finished.add(o.request_id)
    else:
        raise AssertionError("workload did not finish")
    assert not live and not pending
    assert sched.kv.num_free_blocks == num_blocks
    sched.check_integrity()
    # Every finished id is reported exactly once, in a later step's output.
    finished_seen |= sched.schedule().finished_req_ids
    assert finished_seen == set(done)
    for rid, r in done.items():
        assert emitted.get(rid, []) == r.output_token_ids
        if rid not in aborted:
            assert r.num_output_tokens == r.max_output_tokens
            assert r.num_tokens == r.num_prompt_tokens + r.max_output_tokens <= max_model_len


def test_schedule_again_before_output_arrives() -> None:
    """schedule() accounts for the tokens it hands out, so calling it again
    before update_from_output (as its comment allows) must not reschedule them."""
    sched = make_sched(budget=8)
    a = make_req(sched, "a", 20, max_tokens=2)
    outs = [sched.schedule() for _ in range(3)]
    assert [so.num_scheduled_tokens for so in outs] == [{"a": 8}, {"a": 8}, {"a": 4}]
    assert a.num_computed_tokens == a.num_tokens == 20
    sched.check_integrity()
    # Nothing is left to compute until the sampled token arrives.
    b = make_req(sched, "b", 3, max_tokens=1)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"b": 3}
    sched.check_integrity()
    for o in outs:
        sched.update_from_output(o, ModelRunnerOutput(["a"], [[] if o is not outs[-1] else [10]]))
    sched.update_from_output(so, ModelRunnerOutput(["b"], [[10]]))
    assert b.is_finished
    assert a.output_token_ids == [10]
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.finished_req_ids == {"b"}
    sched.update_from_output(so, ModelRunnerOutput(["a"], [[11]]))
    assert a.is_finished
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.check_integrity()


def test_prompt_logprobs_skip_the_prefix_cache_and_report_each_chunk():
    """A request asking prompt_logprobs computes every prompt position even when its prefix
    is cached, and each prompt chunk's logprobs reach the front end though it samples nothing."""
    from pagoda.core.outputs import TokenLogprobs

    sched = make_sched(budget=8)
    prompt = list(range(100, 120))
    make_req(sched, "warm", prompt, max_tokens=1)
    run_to_completion(sched)
    req = make_req(sched, "p", prompt, max_tokens=1, prompt_logprobs=0)
    starts: list[int] = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        n = so.num_scheduled_tokens["p"]
        start = req.num_computed_tokens - n
        done = req.num_computed_tokens == req.num_tokens
        scored = list(range(start + 1, min(start + n, len(prompt) - 1) + 1))
        entries = [TokenLogprobs(-1.0, [], [], 1) for _ in scored]
        runner = ModelRunnerOutput(["p"], [[7] if done else []], prompt_logprobs={"p": (scored[0], entries)})
        for out in sched.update_from_output(so, runner):
            assert out.prompt_logprobs_start == scored[0] and len(out.prompt_logprobs) == len(scored)
            starts.append(out.prompt_logprobs_start)
        sched.check_integrity()
    assert req.num_cached_tokens == 0  # the cached prefix was not taken
    assert starts == [1, 9, 17]  # chunks of 8: positions 1..8, 9..16, 17..19
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
