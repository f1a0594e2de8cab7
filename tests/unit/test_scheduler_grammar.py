"""A request whose grammar is still compiling never holds up the others."""

from __future__ import annotations

from concurrent.futures import Future

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request
from pagoda.core.sched_output import ModelRunnerOutput
from pagoda.core.scheduler import Scheduler, SchedulerConfig
from pagoda.sampling_params import SamplingParams


class FakeMatcher:
    """Accepts anything; terminates after `limit` tokens."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.accepted: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.limit


def _step(s: Scheduler, token: int = 7):
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [[token] if s.requests[r].num_computed_tokens == s.requests[r].num_tokens else [] for r in ids]
    outs = s.update_from_output(so, ModelRunnerOutput(ids, sampled))
    s.check_integrity()
    return so, outs


def test_compiling_grammar_does_not_block_others_and_matcher_ends_request():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=256), KVCacheManager(32, 16))
    slow = Request("slow", [1] * 10, SamplingParams(temperature=0, max_tokens=10))
    slow.grammar = Future()
    s.add_request(slow)
    s.add_request(Request("free", [2] * 10, SamplingParams(temperature=0, max_tokens=3)))
    for _ in range(3):
        so, _ = _step(s)
        assert "slow" not in so.num_scheduled_tokens
        assert "free" in so.num_scheduled_tokens
        assert so.structured_req_ids == []
    assert "free" not in s.requests          # finished while the grammar compiled
    assert s.waiting[0] is slow
    matcher = FakeMatcher(limit=2)
    slow.grammar.set_result(matcher)
    so, _ = _step(s)
    assert so.structured_req_ids == ["slow"]
    so, outs = _step(s)
    assert outs[0].finish_reason == "stop"   # the grammar completed
    assert matcher.accepted == [7, 7]
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_failed_compile_aborts_only_that_request():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=256), KVCacheManager(32, 16))
    bad = Request("bad", [1] * 4, SamplingParams(max_tokens=4))
    bad.grammar = Future()
    bad.grammar.set_exception(ValueError("broken grammar"))
    s.add_request(bad)
    s.add_request(Request("ok", [2] * 4, SamplingParams(max_tokens=1)))
    so, outs = _step(s)
    assert {o.request_id: o.finish_reason for o in outs} == {"bad": "abort", "ok": "length"}
    assert not s.has_unfinished_requests()
