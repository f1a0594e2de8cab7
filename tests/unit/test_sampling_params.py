from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from pagoda.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.presence_penalty == 0.0
    assert p.frequency_penalty == 0.0
    assert p.repetition_penalty == 1.0
    assert p.logit_bias is None
    assert p.seed is None
    assert p.stop == []
    assert p.stop_token_ids == []
    assert p.include_stop_str_in_output is False
    assert p.ignore_eos is False
    assert p.max_tokens == 16
    assert p.min_tokens == 0
    assert p.logprobs is None
    assert p.skip_special_tokens is True
    assert MAX_LOGPROBS == 20


# (field, bad value) pairs; each must raise ValueError naming the field.
INVALID: list[tuple[str, Any]] = [
    ("n", 0),
    ("n", -1),
    ("n", 1.5),
    ("n", True),
    ("n", "2"),
    ("temperature", -1.0),
    ("temperature", "hot"),
    ("temperature", None),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0.0),
    ("top_p", -0.1),
    ("top_p", 1.01),
    ("top_p", "1"),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", "5"),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", "0.1"),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", "x"),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -3.0),
    ("frequency_penalty", math.nan),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", "1"),
    ("logit_bias", {1: 101.0}),
    ("logit_bias", {1: -100.5}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", {1.0: 1.0}),
    ("logit_bias", {1: "a"}),
    ("logit_bias", {1: math.nan}),
    ("logit_bias", [1, 2]),
    ("seed", 1.5),
    ("seed", "42"),
    ("seed", 2**70),
    ("seed", -(2**63) - 1),
    ("n", 2**64),
    ("max_tokens", 2**63),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", 3),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("min_tokens", 1.0),
    ("logprobs", -2),  # -1 is the whole vocabulary; the upper bound is the engine's (--max-logprobs)
    ("prompt_logprobs", -2),
    ("prompt_logprobs", 1.0),
    ("logprob_token_ids", [-1]),
    ("logprob_token_ids", []),
    ("best_of", 0),
    ("logprobs", 1.0),
    ("include_stop_str_in_output", 1),
    ("ignore_eos", "yes"),
    ("skip_special_tokens", None),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_naming_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_temperature_message() -> None:
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1\.0"):
        SamplingParams(temperature=-1.0)


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=17, max_tokens=16)
    # Equal is fine, and without max_tokens any min_tokens is.
    SamplingParams(min_tokens=16, max_tokens=16)
    SamplingParams(min_tokens=1000, max_tokens=None)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"temperature": 2},
        {"top_p": 1},
        {"top_p": 1e-9},
        {"top_k": -1},
        {"top_k": 1},
        {"min_p": 1.0},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"repetition_penalty": 1e-3},
        {"logit_bias": {0: -100, 5: 100.0}},
        {"seed": 0},
        {"seed": -7},
        {"max_tokens": None},
        {"max_tokens": 1},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
    ],
)
def test_valid_edge_values(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs)


def test_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(5, 6), top_k=-1, temperature=0)
    assert p.stop == ["###"]
    assert p.stop_token_ids == [5, 6]
    assert p.top_k == 0
    assert isinstance(p.temperature, float)
    p = SamplingParams(stop=("a", "b"))
    assert p.stop == ["a", "b"]


def test_sampling_type() -> None:
    assert SamplingParams(temperature=0.0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(temperature=0.0, seed=3).is_greedy
    assert SamplingParams(temperature=1e-5).sampling_type is SamplingType.RANDOM
    assert SamplingParams(temperature=0.5, seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert not SamplingParams().is_greedy


def test_clone_and_replace_are_independent() -> None:
    bias = {3: 1.0}
    stops = ["x"]
    p = SamplingParams(logit_bias=bias, stop=stops, stop_token_ids=[1])
    bias[4] = 2.0
    stops.append("y")
    assert p.logit_bias == {3: 1.0} and p.stop == ["x"]

    c = p.clone()
    assert c == p and c is not p
    assert c.logit_bias is not p.logit_bias and c.stop is not p.stop
    c.stop.append("z")
    assert p.stop == ["x"]

    r = dataclasses.replace(p, temperature=0.0, top_k=-1)
    assert r.is_greedy and r.top_k == 0 and r.stop == ["x"]
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(p, temperature=-0.5)


def test_validate_for_vocab() -> None:
    SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[99]).validate_for_vocab(100)
    SamplingParams().validate_for_vocab(1)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={100: 1.0}).validate_for_vocab(100)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[0, 100]).validate_for_vocab(100)


def test_integers_are_bounded_to_64_bits() -> None:
    """The engine link encodes 64-bit integers: a larger seed is a ValueError naming the
    bound (a 400 at the HTTP edge), not an OverflowError while the request is sent."""
    with pytest.raises(ValueError, match=r"seed must be between -9223372036854775808 and 9223372036854775807"):
        SamplingParams(seed=2**70)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
