"""Speculative decoding pieces without a model: config, ngram lookup, verification."""

from __future__ import annotations

import json

import pytest
import torch

from pagoda.config import EngineConfig
from pagoda.entrypoints.cli import build_parser, config_from_args, main
from pagoda.sample.rejection_sampler import rejection_sample, verify_greedy
from pagoda.config.speculative import SpeculativeConfig
from pagoda.spec_decode.ngram import ngram_lookup

# ---- config ------------------------------------------------------------------------------


def test_config_from_dict_json_and_object():
    d = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    a = EngineConfig(speculative_config=d).speculative_config
    b = EngineConfig(speculative_config=json.dumps(d)).speculative_config
    assert a == b == SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=5)
    assert EngineConfig(speculative_config=a).speculative_config is a
    assert EngineConfig().speculative_config is None
    # Defaults: lookups of 1..4 tokens.
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 4)
    ls = SpeculativeConfig.parse({"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 8})
    assert ls.num_layers == 8
    # vLLM's form without a method where a model is given: a draft model.
    dm = SpeculativeConfig.parse({"model": "path/to/assistant", "num_speculative_tokens": 4})
    assert (dm.method, dm.model) == ("draft_model", "path/to/assistant")


@pytest.mark.parametrize(
    "value, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        ({"num_speculative_tokens": 2}, "needs 'method'"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown key"),
        ({"method": "ngram", "num_speculative_tokens": 2, "num_layers": 3}, "does not apply"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
         "prompt_lookup_min (5) > prompt_lookup_max (3)"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be"),
        ({"method": "layer_skip", "num_speculative_tokens": 2}, "needs num_layers"),
        ({"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 0}, "num_layers must be"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": "m", "prompt_lookup_max": 2},
         "does not apply"),
    ],
)
def test_invalid_configs_are_rejected(value, message):
    with pytest.raises(ValueError, match="speculative_config") as info:
        EngineConfig(speculative_config=value)
    assert message in str(info.value)


def test_cli_flag(capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    for command in (["serve"], ["generate"], ["chat"], ["bench", "throughput"]):
        args = build_parser().parse_args(command + ["--speculative-config", spec])
        assert config_from_args(args).speculative_config == SpeculativeConfig("ngram", 3)
    # A bad value is a clear error before any model loads.
    assert main(["generate", "--prompt", "x", "--speculative-config", '{"method": "eagle"}']) == 2
    assert "speculative_config" in capsys.readouterr().err


# ---- ngram lookup ------------------------------------------------------------------------


def test_ngram_lookup_prefers_long_and_recent_matches():
    # Suffix [5, 6] occurs at 0; the proposal continues from there.
    assert ngram_lookup([5, 6, 7, 8, 5, 6], 1, 3, 3) == [7, 8, 5]
    # Proposals stop at the end of the sequence.
    assert ngram_lookup([5, 6, 7, 8, 5, 6], 1, 3, 10) == [7, 8, 5, 6]
    # The most recent earlier occurrence wins: [1, 2] is followed by 9 last time.
    assert ngram_lookup([1, 2, 3, 1, 2, 9, 1, 2], 2, 2, 1) == [9]
    # A longer match beats a shorter one: [4, 1, 2] -> 3, though [1, 2] -> 9 is more recent.
    assert ngram_lookup([4, 1, 2, 3, 0, 1, 2, 9, 4, 1, 2], 1, 3, 1) == [3]
    # Below min_n nothing counts.
    assert ngram_lookup([1, 2, 3, 1, 2, 9, 7, 2], 2, 3, 2) == []
    assert ngram_lookup([1, 2, 3, 7, 2], 1, 3, 2) == [3, 7]
    assert ngram_lookup([1], 1, 3, 2) == []
    assert ngram_lookup([1, 2, 3], 1, 3, 2) == []


# ---- verification ------------------------------------------------------------------------


def test_verify_greedy():
    assert verify_greedy([4, 7, 2, 5], [4, 7, 9]) == [4, 7, 2]
    assert verify_greedy([4, 7, 9, 5], [4, 7, 9]) == [4, 7, 9, 5]   # all kept + bonus
    assert verify_greedy([3, 7, 9, 5], [4, 7, 9]) == [3]            # first one wrong
    assert verify_greedy([8], []) == [8]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = float(counts.sum())
    expected = probs.double() * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was emitted"
    return float(((counts.double()[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# chi-square critical values at p = 0.001, by degrees of freedom (possible tokens - 1).
CHI2_999 = {4: 18.467}
N_SAMPLES = 20_000


@pytest.mark.parametrize("one_hot", [True, False], ids=["one-hot q (ngram)", "draft distribution q"])
def test_rejection_sampler_matches_target_distribution(one_hot):
    """Drafts come from q; whatever q is, the first emitted token is distributed as p,
    and so is the second after an accepted first draft (here p is the same per row)."""
    gen = torch.Generator().manual_seed(1234)
    p = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10, 0.0])   # a token the target never emits
    q = torch.tensor([0.30, 0.10, 0.10, 0.30, 0.10, 0.10])
    v = len(p)
    target = torch.stack([p, p, p])
    first = torch.zeros(v, dtype=torch.long)
    second = torch.zeros(v, dtype=torch.long)
    accepted = 0
    for _ in range(N_SAMPLES):
        if one_hot:
            draft = [3, 1]                       # a fixed proposal: q is one-hot at it
            qs = None
        else:
            draft = torch.multinomial(q, 2, replacement=True, generator=gen).tolist()
            qs = torch.stack([q, q])
        out = rejection_sample(target, draft, qs, gen)
        assert 1 <= len(out) <= 3
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
            accepted += 1
        # Kept tokens are a prefix of the drafts.
        assert out[:-1] == draft[: len(out) - 1]
    # Five tokens are possible: four degrees of freedom.
    assert _chi_square(first, p) < CHI2_999[4]
    assert _chi_square(second, p) < CHI2_999[4]
    # The acceptance rate is sum_x min(p, q) (one-hot: p(draft)).
    expected_rate = float(p[3]) if one_hot else float(torch.minimum(p, q).sum())
    assert abs(accepted / N_SAMPLES - expected_rate) < 0.015


def test_rejection_sampler_detects_a_wrong_distribution():
    """The test above can fail: sampling from the residual alone is caught."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10])
    counts = torch.zeros(5, dtype=torch.long)
    for _ in range(5000):
        residual = p.clone()
        residual[3] = 0
        counts[int(torch.multinomial(residual, 1, generator=gen))] += 1
    assert _chi_square(counts, p) > CHI2_999[4]


def test_rejection_sampler_certain_cases():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert rejection_sample(p, [1], None, gen) == [1, 2]      # p(draft) = 1: always kept
    assert rejection_sample(p, [0], None, gen) == [1]         # p(draft) = 0: never kept
