"""The scheduler with speculative decoding, driven by a fake runner that verifies drafts.

The fake target's "true" next token of a request is a function of its length; the
fake proposer drafts the true tokens for the first ``good`` drafts and junk after, so
each test knows exactly what must be accepted, emitted and rolled back.
"""

from __future__ import annotations

import pytest

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request
from pagoda.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagoda.core.scheduler import Scheduler, SchedulerConfig
from pagoda.sampling_params import SamplingParams


def make_sched(k: int = 3, num_blocks: int = 64, block_size: int = 4, budget: int = 32,
               max_model_len: int = 256, caching: bool = True) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16, max_model_len=max_model_len,
                          num_speculative_tokens=k)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, caching))


def add(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int = 12, **params) -> Request:
    req = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **params),
                  max_model_len=sched.config.max_model_len)
    sched.add_request(req)
    return req


JUNK = 999_999   # a wrong draft; no prompt or true token has this id


def true_token(num_tokens: int) -> int:
    """The fake target's greedy token after a sequence of this length."""
    return 1000 + num_tokens


class FakeSpecRunner:
    """Verifies drafts like the real runner: the known token plus drafts are computed;
    drafts are kept while they match the target; one target token follows."""

    def __init__(self, good: int) -> None:
        self.good = good   # how many leading drafts are right
        self.emitted: dict[str, list[int]] = {}

    def execute(self, sched: Scheduler, so: SchedulerOutput) -> ModelRunnerOutput:
        req_ids, sampled, num_drafts = [], [], {}
        for rid, n in so.num_scheduled_tokens.items():
            req = sched.requests[rid]
            k = so.num_spec_tokens.get(rid, 0)
            req_ids.append(rid)
            # schedule() already counted the draft slots as computed.
            if req.num_computed_tokens - k < req.num_tokens:
                sampled.append([])   # a prompt chunk
                continue
            length = req.num_tokens
            drafts = [true_token(length + j) if j < self.good else JUNK for j in range(k)]
            out = []
            for j, d in enumerate(drafts):
                target = true_token(length + j)
                out.append(target)
                if d != target:
                    break
            else:
                out.append(true_token(length + k))
            if k:
                num_drafts[rid] = k
            sampled.append(out)
        return ModelRunnerOutput(req_ids, sampled, num_draft_tokens=num_drafts)


def run(sched: Scheduler, runner: FakeSpecRunner, max_steps: int = 500) -> tuple[dict[str, list[int]], list]:
    tokens: dict[str, list[int]] = {}
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        sched.check_integrity()
        assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        for rid, k in so.num_spec_tokens.items():
            req = sched.requests[rid]
            assert 1 <= k <= sched.config.num_speculative_tokens
            assert so.num_scheduled_tokens[rid] == 1 + k
            # Slots for the known token and every draft.
            assert len(sched.kv.get_block_ids(rid)[0]) * sched.kv.block_size >= req.num_computed_tokens
        outs = sched.update_from_output(so, runner.execute(sched, so))
        sched.check_integrity()
        for req in sched.running:
            kv = sched.kv
            # Never a hash over unverified slots: only blocks full of known tokens.
            assert kv.num_cached_blocks.get(req.request_id, 0) <= req.num_tokens // kv.block_size
            # Rolled back: exactly the blocks its computed tokens need.
            if req.request_id in so.num_spec_tokens:
                assert req.num_computed_tokens == req.num_tokens - 1
                assert len(kv.get_block_ids(req.request_id)[0]) == -(-req.num_computed_tokens // kv.block_size)
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps.append(so)
    else:
        raise AssertionError("did not finish")
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.kv.pool.cached_blocks or not sched.kv.enable_caching
    for block_hash in sched.kv.pool.cached_blocks:
        # Rejected drafts were written into slots, but never registered.
        assert JUNK not in block_hash.token_ids
    return tokens, steps


def expected(prompt_len: int, max_tokens: int) -> list[int]:
    return [true_token(prompt_len + i) for i in range(max_tokens)]


@pytest.mark.parametrize("good", [0, 1, 2, 3])
def test_same_tokens_whatever_is_accepted(good):
    sched = make_sched(k=3)
    add(sched, "a", list(range(10)), max_tokens=13)
    add(sched, "b", list(range(20, 25)), max_tokens=9)
    tokens, steps = run(sched, FakeSpecRunner(good))
    assert tokens == {"a": expected(10, 13), "b": expected(5, 9)}
    stats = sched.make_stats()
    assert stats.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens == good * stats.spec_num_drafts - _cut(steps, good)
    assert stats.spec_accepted_per_pos[good:] == [0] * (3 - good)


def _cut(steps, good):
    """Drafts scheduled fewer than ``good`` (near max_tokens) accept fewer."""
    return sum(good - min(good, k) for so in steps for k in so.num_spec_tokens.values())


def test_decode_steps_and_caps():
    sched = make_sched(k=3)
    add(sched, "a", list(range(6)), max_tokens=6)
    tokens, steps = run(sched, FakeSpecRunner(good=3))
    assert tokens["a"] == expected(6, 6)
    # Prefill emits 1, then 1 + 3 drafts all kept + 1 = 4, then 1 left: no drafts.
    assert [so.num_scheduled_tokens["a"] for so in steps] == [6, 4, 1]
    assert [so.num_spec_tokens.get("a", 0) for so in steps] == [0, 3, 0]


def test_drafts_share_the_token_budget():
    sched = make_sched(k=3, budget=6)
    for rid in "abc":
        add(sched, rid, [1, 2], max_tokens=8)
    sched.update_from_output(so := sched.schedule(), FakeSpecRunner(0).execute(sched, so))
    so = sched.schedule()
    # Drafts fill what the budget leaves, but never at the cost of another running
    # request's own token: a gets 3 drafts, b and c decode plainly.
    assert so.num_scheduled_tokens == {"a": 4, "b": 1, "c": 1}
    assert so.num_spec_tokens == {"a": 3}
    sched.update_from_output(so, FakeSpecRunner(0).execute(sched, so))
    tokens, _ = run(sched, FakeSpecRunner(good=0))
    assert {rid: len(t) for rid, t in tokens.items()} == {"a": 6, "b": 6, "c": 6}


def test_requests_that_cannot_speculate_decode_plainly_in_the_same_batch():
    sched = make_sched(k=2)
    add(sched, "plain", [1, 2, 3], max_tokens=5)
    add(sched, "logprobs", [1, 2, 4], max_tokens=5, logprobs=1)
    add(sched, "json", [1, 2, 5], max_tokens=5, structured_outputs={"json_object": True})
    tokens, steps = run(sched, FakeSpecRunner(good=2))
    assert tokens["logprobs"] == expected(3, 5)
    speculated = {rid for so in steps for rid in so.num_spec_tokens}
    assert speculated == {"plain"}
    assert any(len(so.num_scheduled_tokens) == 3 and so.num_spec_tokens for so in steps)


def test_small_pool_drops_drafts_before_preempting():
    # 4 blocks of 4: two requests of 6 prompt tokens each need 2 blocks apiece. Draft
    # slots would need a third block; they are dropped, nobody is preempted.
    sched = make_sched(k=3, num_blocks=4, block_size=4)
    add(sched, "a", list(range(6)), max_tokens=2)
    add(sched, "b", list(range(10, 16)), max_tokens=2)
    tokens, steps = run(sched, FakeSpecRunner(good=3))
    assert sched.num_preemptions == 0
    assert tokens == {"a": expected(6, 2), "b": expected(6, 2)}


def test_preemption_with_speculation_keeps_the_pool_consistent():
    sched = make_sched(k=3, num_blocks=9, block_size=4, max_model_len=40)
    for i in range(4):
        add(sched, f"r{i}", list(range(10 * i, 10 * i + 7)), max_tokens=14)
    tokens, _ = run(sched, FakeSpecRunner(good=1))
    assert sched.num_preemptions > 0
    assert tokens == {f"r{i}": expected(7, 14) for i in range(4)}


def test_rollback_frees_fully_rejected_blocks():
    sched = make_sched(k=3, block_size=2)
    add(sched, "a", [1, 2, 3], max_tokens=10)
    runner = FakeSpecRunner(good=0)
    sched.update_from_output(so := sched.schedule(), runner.execute(sched, so))   # prefill
    req = sched.requests["a"]
    assert (req.num_tokens, req.num_computed_tokens, len(sched.kv.get_block_ids("a")[0])) == (4, 3, 2)
    so = sched.schedule()
    # Position 3 plus 3 drafts (positions 4..6): 4 blocks of 2.
    assert so.num_spec_tokens == {"a": 3} and len(sched.kv.get_block_ids("a")[0]) == 4
    free_before = sched.kv.num_free_blocks
    sched.update_from_output(so, runner.execute(sched, so))
    # Nothing accepted: 5 tokens, 4 computed, 2 blocks; the two draft-only blocks are back.
    assert (req.num_tokens, req.num_computed_tokens, len(sched.kv.get_block_ids("a")[0])) == (5, 4, 2)
    assert sched.kv.num_free_blocks == free_before + 2
    sched.check_integrity()
