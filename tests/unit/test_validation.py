"""pagoda/validation.py: one check for every engine, one message per problem; the scheduler
re-runs the admission part with the same messages."""

from __future__ import annotations

import pytest

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request
from pagoda.core.scheduler import Scheduler, SchedulerConfig
from pagoda.lora.request import LoRARequest
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.validation import InvalidRequestError, RequestLimits, admission_check, validate_request

LIMITS = RequestLimits(max_model_len=32, vocab_size=100)
PARAMS = SamplingParams(max_tokens=4)


@pytest.mark.parametrize(
    "ids, params, kwargs, message, param, code",
    [
        ([], PARAMS, {}, "The decoder prompt cannot be empty", None, None),
        ([1, 100, -1, 5], PARAMS, {}, r"Token ids \[100, -1\] are out of vocabulary \(vocabulary size 100\)", None, None),
        ([1], SamplingParams(logit_bias={100: 1.0, 5: 1.0, 101: 2.0}), {},
         r"logit_bias token id\(s\) \[100, 101\] contain out-of-vocab", None, None),
        ([1], SamplingParams(stop_token_ids=[7, 100]), {}, "stop_token_ids token id 100", None, None),
        ([1] * 32, PARAMS, {}, "maximum context length \\(max_model_len\\) is 32 tokens, but the prompt has 32",
         "prompt", "context_length_exceeded"),
        ([1] * 30, PARAMS, {}, r"you requested 34 tokens \(30 in the prompt, 4 for the completion\)",
         "max_tokens", "context_length_exceeded"),
        ([1], PARAMS, {"priority": 2}, "not allowed with the fcfs scheduling policy; start the engine with "
         "--scheduling-policy priority", "priority", "invalid_value"),
        ([1], PARAMS, {"priority": True}, "priority must be an integer", "priority", "invalid_value"),
        ([1], PARAMS, {"priority": 2**63}, "signed 64-bit integer", "priority", "invalid_value"),
        ([1], PARAMS, {"lora_request": LoRARequest("a", 1, "/a")}, "LoRA is not enabled: the engine runs without LoRA",
         None, None),
    ],
)  # fmt: skip
def test_each_problem_has_its_message(ids, params, kwargs, message, param, code) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        validate_request(ids, params, LIMITS, **kwargs)
    assert (info.value.param, info.value.code) == (param, code)


def test_what_passes() -> None:
    validate_request([0, 99] + [1] * 26, PARAMS, LIMITS)  # 28 + 4 = 32: exactly the context
    validate_request([1], SamplingParams(max_tokens=None), LIMITS)
    validate_request([1], PARAMS, RequestLimits(32, 100, "priority", enable_lora=True), priority=-5,
                     lora_request=LoRARequest("a", 1, "/a"))
    validate_request([10**6], PARAMS, RequestLimits(32))  # no vocabulary known: ids unchecked


def test_the_grammar_is_checked_last_and_only_when_asked() -> None:
    seen = []
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))
    validate_request([1], params, LIMITS, validate_grammar=seen.append)
    assert seen == [params.structured_outputs]
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        validate_request([1] * 40, params, LIMITS, validate_grammar=seen.append)
    assert len(seen) == 1
    admission_check([1], params, LIMITS)  # the core's re-check compiles nothing


def test_the_scheduler_rechecks_with_the_same_messages() -> None:
    sched = Scheduler(SchedulerConfig(max_model_len=32, vocab_size=100), KVCacheManager(16, 4))
    cases = [([1, 100], {}, "out of vocabulary"), ([1] * 32, {}, "max_model_len"),
             ([1], {"priority": 1}, "--scheduling-policy priority"),
             ([1], {"lora_request": LoRARequest("a", 1, "/a")}, "without LoRA")]  # fmt: skip
    for i, (ids, kwargs, message) in enumerate(cases):
        with pytest.raises(InvalidRequestError, match=message):
            sched.add_request(Request(f"r{i}", ids, PARAMS, **kwargs))
        with pytest.raises(InvalidRequestError, match=message):
            validate_request(ids, PARAMS, LIMITS, **kwargs)
    assert not sched.has_unfinished_requests()
    # Not a context error in the core: max_tokens beyond the context is cut to what fits.
    sched.add_request(Request("ok", [1] * 30, PARAMS, max_model_len=32))
    assert sched.requests["ok"].max_output_tokens == 2
