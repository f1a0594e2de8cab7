"""prompt_logprobs, logprob_token_ids, whole-vocabulary logprobs and best_of on the default
model, against transformers' log-softmax of the same tokens; every KV block back after
each test."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.validation import InvalidRequestError, RequestLimits, validate_request

PROMPT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting each step "
          "as his father had taught him, and at the top he lit the lamp that guided the fishing boats "
          "home through the fog. One night the lamp would not light.")  # fmt: skip
TOL = 1e-3


@pytest.fixture(scope="module")
def llm():
    # 32-token steps split the prompt into chunks; blocks of 16 let its prefix be cached.
    return LLM(show_progress=False, num_kv_blocks=256, max_model_len=1024, block_size=16,
               max_num_batched_tokens=32, max_logprobs=-1)  # fmt: skip


@pytest.fixture(scope="module")
def prompt_ids(llm) -> list[int]:
    ids = llm.get_tokenizer().encode(PROMPT)
    assert len(ids) > 40  # more than one chunk of 32
    return ids


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is the log-softmax of the logits after ids[: i + 1]."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _all_free(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


def _assert_prompt_logprobs(prompt_logprobs, ids: list[int], want: torch.Tensor, k: int) -> None:
    assert len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        position, row = prompt_logprobs[i], want[i - 1]
        actual = position[ids[i]]
        assert actual.logprob == pytest.approx(row[ids[i]].item(), abs=TOL), f"position {i}"
        # Its rank: 1 + the tokens transformers finds clearly more likely (near-ties either way).
        assert (row > row[ids[i]] + TOL).sum().item() + 1 <= actual.rank <= (row > row[ids[i]] - TOL).sum().item() + 1
        top = sorted((lp for lp in position.values() if lp.rank <= k), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == list(range(1, k + 1))
        assert [lp.logprob for lp in top] == pytest.approx(row.topk(k).values.tolist(), abs=TOL)
        for token_id, lp in position.items():
            assert lp.logprob == pytest.approx(row[token_id].item(), abs=TOL)


def test_prompt_logprobs_match_transformers_through_chunked_prefill(llm, hf_default_model, prompt_ids):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    out = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0]
    _assert_prompt_logprobs(out.prompt_logprobs, prompt_ids, _hf_logprobs(hf_default_model, prompt_ids), 3)
    assert all(o.logprobs is None for o in out.outputs)  # only the prompt's were asked
    _all_free(llm)


def test_prompt_logprobs_with_the_prefix_already_cached(llm, hf_default_model, prompt_ids):
    """The prompt's blocks are in the prefix cache; the request must still compute (and
    report) every position, so it does not take the hit."""
    plain = SamplingParams(temperature=0, max_tokens=1)
    warm = llm.generate({"prompt_token_ids": prompt_ids}, plain, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": prompt_ids}, plain, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32, "the prefix should be cached now"
    out = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]  # fmt: skip
    assert out.num_cached_tokens == 0
    want = _hf_logprobs(hf_default_model, prompt_ids)
    _assert_prompt_logprobs(out.prompt_logprobs, prompt_ids, want, 0)
    assert out.outputs[0].token_ids == warm.outputs[0].token_ids
    _all_free(llm)


def test_prompt_logprobs_once_for_n_samples_and_whole_vocabulary(llm, hf_default_model, prompt_ids):
    ids = prompt_ids[:6]  # each position holds the whole vocabulary: keep them few
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=2, prompt_logprobs=-1)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    vocab = llm.engine.vocab_size
    assert all(len(p) == vocab for p in out.prompt_logprobs[1:])
    _assert_prompt_logprobs(out.prompt_logprobs, ids, _hf_logprobs(hf_default_model, ids), 5)
    _all_free(llm)


def test_logprob_token_ids_and_whole_vocabulary_logprobs(llm, hf_default_model, prompt_ids):
    tracked = [11, 260, 4093, 30]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1, logprob_token_ids=tracked)
    c = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0].outputs[0]
    want = _hf_logprobs(hf_default_model, prompt_ids + c.token_ids)
    for j, position in enumerate(c.logprobs):
        row = want[len(prompt_ids) - 1 + j]
        for token_id in tracked:
            lp = position[token_id]
            assert lp.logprob == pytest.approx(row[token_id].item(), abs=TOL)
            assert (row > row[token_id] + TOL).sum().item() + 1 <= lp.rank <= (row > row[token_id] - TOL).sum() + 1
        assert position[c.token_ids[j]].rank == 1  # greedy
    whole = SamplingParams(temperature=0, max_tokens=1, logprobs=-1)
    c = llm.generate({"prompt_token_ids": prompt_ids}, whole, use_tqdm=False)[0].outputs[0]
    assert len(c.logprobs[0]) == llm.engine.vocab_size
    values = torch.tensor([c.logprobs[0][t].logprob for t in range(llm.engine.vocab_size)])
    assert torch.allclose(values, want[len(prompt_ids) - 1], atol=TOL)
    _all_free(llm)


def test_best_of_returns_the_samples_of_highest_cumulative_logprob(llm, prompt_ids):
    ids = prompt_ids[:12]
    common = {"temperature": 1.0, "seed": 11, "max_tokens": 6, "ignore_eos": True}
    every = llm.generate({"prompt_token_ids": ids}, SamplingParams(n=4, logprobs=0, **common), use_tqdm=False)[0]
    best = llm.generate({"prompt_token_ids": ids}, SamplingParams(n=2, best_of=4, **common), use_tqdm=False)[0]
    # Sample i is seeded with seed + i either way, so best_of drew the same four.
    ranked = sorted(every.outputs, key=lambda o: o.cumulative_logprob, reverse=True)
    assert len({tuple(o.token_ids) for o in every.outputs}) > 1
    assert [o.token_ids for o in best.outputs] == [o.token_ids for o in ranked[:2]]
    assert [o.index for o in best.outputs] == [0, 1]
    for got, want in zip(best.outputs, ranked):
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-5)
        assert got.logprobs is None  # ranked by them, but not asked for
    _all_free(llm)


def test_bad_logprob_requests_are_rejected(llm, prompt_ids):
    with pytest.raises(ValueError, match="best_of must be >= n"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="temperature 0"):
        SamplingParams(n=1, best_of=2, temperature=0)
    with pytest.raises(ValueError, match="prompt_logprobs must be -1"):
        SamplingParams(prompt_logprobs=-2)
    limits = RequestLimits(max_model_len=1024, vocab_size=100, max_logprobs=20)
    with pytest.raises(InvalidRequestError, match="at most 20"):
        validate_request([1, 2], SamplingParams(logprobs=21), limits)
    with pytest.raises(InvalidRequestError, match="whole vocabulary"):
        validate_request([1, 2], SamplingParams(prompt_logprobs=-1), limits)
    validate_request([1, 2], SamplingParams(logprobs=-1), RequestLimits(1024, 100, max_logprobs=-1))
    with pytest.raises(ValueError, match="logprob_token_ids token id"):
        llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(logprob_token_ids=[10**6]), use_tqdm=False)
    _all_free(llm)
