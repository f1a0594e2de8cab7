"""Embedding requests in the scheduler (a fake runner) and the runner's pooler, without a model.

An embedding request is prefill only: its chunks are scheduled like any prompt's, it samples
nothing, never gets draft slots, and ends (every block back) in the step that completes its
prompt, with the vector the runner pooled. The pooler sums MEAN over chunks, keeps CLS's
first row, and starts over when a request is recomputed from position 0.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.sched_output import ModelRunnerOutput
from pagoda.core.scheduler import Scheduler, SchedulerConfig
from pagoda.pooling import (
    PoolerConfig,
    PoolerOverrides,
    PoolingParams,
    placeholder_sampling_params,
    truncate_prompt,
)
from pagoda.core.request import Request, RequestStatus
from pagoda.validation import (
    InvalidRequestError,
    RequestLimits,
    WrongTaskError,
    validate_pooling_request,
)
from pagoda.worker.pooler import Pooler


def _sched(budget: int, spec: int = 0) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_model_len=64, num_speculative_tokens=spec)
    return Scheduler(cfg, KVCacheManager(32, 4, enable_caching=False))


def _embed_req(rid: str, n: int, max_model_len: int = 64) -> Request:
    return Request(rid, list(range(10, 10 + n)), placeholder_sampling_params(), max_model_len=max_model_len,
                   pooling_params=PoolingParams())


def test_scheduler_chunks_then_finishes_with_the_vector():
    sched = _sched(budget=8, spec=3)
    req = _embed_req("e", 20)
    sched.add_request(req)
    steps = []
    while True:
        so = sched.schedule()
        assert not so.num_spec_tokens  # a prompt's last token is no decode: no drafts
        steps.append(so.num_scheduled_tokens["e"])
        done = req.num_computed_tokens == req.num_tokens
        out = ModelRunnerOutput(["e"], [[]], pooled={"e": [0.6, 0.8]} if done else {})
        outs = sched.update_from_output(so, out)
        sched.check_integrity()
        if done:
            break
        assert outs == []
    assert steps == [8, 8, 4]
    assert [(o.request_id, o.finish_reason, o.pooled, o.new_token_ids) for o in outs] == [("e", "stop", [0.6, 0.8], [])]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids == []
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_aborted_mid_prompt_gives_blocks_back():
    sched = _sched(budget=8)
    sched.add_request(_embed_req("e", 30))
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(["e"], [[]]))
    assert sched.kv.num_free_blocks < sched.kv.num_blocks
    sched.finish_requests(["e"], RequestStatus.FINISHED_ABORTED)
    # A vector for it arriving afterwards is ignored.
    assert sched.update_from_output(so, ModelRunnerOutput(["e"], [[]], pooled={"e": [1.0]})) == []
    sched.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_prompt_may_fill_the_context():
    """Generation needs room for one token after the prompt; an embedding does not."""
    sched = _sched(budget=64)
    sched.add_request(_embed_req("full", 64))
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        sched.add_request(_embed_req("over", 65, max_model_len=None))


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_pooler_over_chunks(kind):
    hidden = torch.randn(10, 6, generator=torch.Generator().manual_seed(0))
    pooler = Pooler(PoolerConfig(kind, normalize=False, hidden_size=6))
    pooler.start("r", 0)
    assert pooler.add("r", hidden[:4], 0, 10, PoolingParams()) is None
    assert pooler.add("r", hidden[4:8], 4, 10, PoolingParams()) is None
    got = torch.tensor(pooler.add("r", hidden[8:], 8, 10, PoolingParams()))
    want = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[kind]
    torch.testing.assert_close(got, want)
    assert not pooler._state  # nothing left behind


def test_pooler_restarts_on_recompute_and_truncates():
    hidden = torch.arange(12.0).reshape(4, 3)
    pooler = Pooler(PoolerConfig("MEAN", normalize=True, hidden_size=3, is_matryoshka=True))
    pooler.start("r", 0)
    pooler.add("r", hidden[:2] + 100, 0, 4, PoolingParams())   # preempted after this chunk...
    pooler.start("r", 0)                                          # ...and recomputed from 0
    pooler.add("r", hidden[:2], 0, 4, PoolingParams())
    got = torch.tensor(pooler.add("r", hidden[2:], 2, 4, PoolingParams(dimensions=2)))
    torch.testing.assert_close(got, torch.nn.functional.normalize(hidden.mean(0)[:2], dim=0))
    with pytest.raises(RuntimeError, match="needs every position"):
        pooler.start("other", 5)


def test_request_checks():
    pooler = PoolerConfig("LAST", True, 8, matryoshka_dimensions=(4,))
    embed, generate = RequestLimits(16, 100, pooler=pooler), RequestLimits(16, 100)
    validate_pooling_request([1] * 16, PoolingParams(dimensions=4), embed)
    for ids, params, limits, error in [
        ([1], PoolingParams(), generate, WrongTaskError),
        ([], PoolingParams(), embed, InvalidRequestError),
        ([1, 100], PoolingParams(), embed, InvalidRequestError),
        ([1] * 17, PoolingParams(), embed, InvalidRequestError),
        ([1], PoolingParams(dimensions=8), embed, InvalidRequestError),
    ]:
        with pytest.raises(error):
            validate_pooling_request(ids, params, limits)
    assert truncate_prompt([1, 2, 3, 4], 2, 16) == [3, 4]
    assert truncate_prompt([1, 2, 3], -1, 2) == [2, 3]
    with pytest.raises(ValueError):
        truncate_prompt([1], 17, 16)
    assert PoolerOverrides.parse('{"pooling_type": "mean"}').pooling_type == "MEAN"
    with pytest.raises(ValueError, match="unknown key"):
        PoolerOverrides.parse({"pooling": "MEAN"})
