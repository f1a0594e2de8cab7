"""Beam search (pagoda/engine/beam_search.py): the algorithm against exhaustive enumeration
of a tree, and LLM.beam_search on a tiny random model against the same search over the
tree transformers computes; every KV block back afterwards."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda import LLM
from pagoda.engine.beam_search import BeamSearch, BeamSearchParams, beam_score

VOCAB = 4
PROMPT = [1, 3, 0, 2, 1]


# ---------------------------------------------------------------------- the algorithm alone
def _table_logprobs(prefix: tuple[int, ...], vocab: int) -> list[float]:
    """A fixed, arbitrary next-token distribution per prefix (a seeded generator per prefix)."""
    gen = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return torch.log_softmax(torch.randn(vocab, generator=gen) * 2, dim=0).tolist()


def _run(search: BeamSearch, lookup) -> list:
    while not search.done:
        search.advance([lookup(tuple(t)) for t in search.pending()])
    return search.result()


def _exhaustive(vocab: int, max_tokens: int, eos: set[int], length_penalty: float, logprobs_of):
    """Every sequence the tree holds: those ending at an EOS early, and those of max_tokens."""
    scored = []

    def walk(prefix: tuple[int, ...], cum: float) -> None:
        lps = logprobs_of(prefix)
        for t in range(vocab):
            seq, total = prefix + (t,), cum + lps[t]
            if t in eos:
                scored.append((beam_score(len(seq), True, total, length_penalty), seq))
            elif len(seq) == max_tokens:
                scored.append((beam_score(len(seq), False, total, length_penalty), seq))
            else:
                walk(seq, total)

    walk((), 0.0)
    return sorted(scored, reverse=True)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.5])
@pytest.mark.parametrize("eos", [set(), {3}])
def test_wide_beam_is_exhaustive_search(length_penalty, eos):
    """A beam wide enough to keep every prefix finds the true best sequences of the tree."""
    vocab, max_tokens = 5, 3
    width = vocab**max_tokens
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty)
    search = BeamSearch([], params, frozenset(eos))
    beams = _run(search, lambda prefix: dict(enumerate(_table_logprobs(prefix, vocab))))
    truth = _exhaustive(vocab, max_tokens, eos, length_penalty, lambda p: _table_logprobs(p, vocab))
    assert len(beams) == min(width, len(truth))
    got = [(beam_score(len(b.output_token_ids), b.finish_reason == "stop", b.cum_logprob, length_penalty),
            tuple(b.output_token_ids)) for b in beams]  # fmt: skip
    assert [s for _, s in got] == [s for _, s in truth[: len(got)]]
    for (gs, _), (ts, _) in zip(got, truth):
        assert gs == pytest.approx(ts, abs=1e-9)
    for b in beams:
        ends = bool(eos) and b.output_token_ids[-1] in eos
        assert b.finish_reason == ("stop" if ends else "length")


def test_narrow_beam_keeps_width_best_at_each_step():
    """Width 2 over a table built so greedy and beam differ: the best full sequence starts
    with the second-best first token, which a width-1 search drops and width 2 keeps."""
    table = {(): [math.log(0.6), math.log(0.4)],
             (0,): [math.log(0.5), math.log(0.5)], (1,): [math.log(0.95), math.log(0.05)]}  # fmt: skip
    lookup = lambda p: dict(enumerate(table[p]))
    greedy = _run(BeamSearch([], BeamSearchParams(beam_width=1, max_tokens=2, length_penalty=0.0), frozenset()),
                  lookup)  # fmt: skip
    beam = _run(BeamSearch([], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=0.0), frozenset()),
                lookup)  # fmt: skip
    assert greedy[0].output_token_ids == [0, 0]
    assert beam[0].output_token_ids == [1, 0]
    assert beam[0].cum_logprob == pytest.approx(math.log(0.4 * 0.95))


def test_early_stopping_ends_once_width_sequences_are_complete():
    eos = frozenset({0})
    lookup = lambda p: {0: math.log(0.7), 1: math.log(0.3)}
    params = BeamSearchParams(beam_width=1, max_tokens=5, early_stopping=True)
    search = BeamSearch([], params, eos)
    beams = _run(search, lookup)
    assert search.num_steps == 1 and beams[0].output_token_ids == [0] and beams[0].finish_reason == "stop"
    # Without it the search runs on, and ignore_eos makes EOS an ordinary token.
    assert _run(BeamSearch([], BeamSearchParams(beam_width=1, max_tokens=5), eos), lookup)[0].finish_reason == "stop"
    ignored = _run(BeamSearch([], BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True), eos), lookup)
    assert ignored[0].output_token_ids == [0] * 5 and ignored[0].finish_reason == "length"


@pytest.mark.parametrize("bad", [{"beam_width": 0}, {"max_tokens": 0}, {"temperature": -1.0},
                                 {"length_penalty": float("nan")}, {"early_stopping": "yes"}])  # fmt: skip
def test_params_are_validated(bad):
    with pytest.raises(ValueError):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 3, **bad})


# ---------------------------------------------------------------------- on a real (tiny) model
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.5, tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    path = tmp_path_factory.mktemp("tiny-vocab4")
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    # Blocks of 4 tokens: beams fork inside and across blocks, so prefix hits matter.
    return LLM(tiny_dir, skip_tokenizer_init=True, show_progress=False, block_size=4, num_kv_blocks=256)


def _hf_logprobs(hf, temperature: float):
    cache: dict[tuple[int, ...], list[float]] = {}

    def logprobs_of(prefix: tuple[int, ...]) -> list[float]:
        if prefix not in cache:
            with torch.no_grad():
                logits = hf(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].float()
            cache[prefix] = torch.log_softmax(logits / (temperature or 1.0), dim=-1).tolist()
        return cache[prefix]

    return logprobs_of


def _all_free(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_tiny_model_wide_beam_equals_exhaustive_search(tiny_llm, hf_tiny, length_penalty):
    max_tokens = 3
    width = VOCAB**max_tokens
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty)
    out = tiny_llm.beam_search([{"prompt_token_ids": PROMPT}], params)[0]
    truth = _exhaustive(VOCAB, max_tokens, set(), length_penalty, _hf_logprobs(hf_tiny, 0.0))
    assert len(out.sequences) == width
    for beam, (score, seq) in zip(out.sequences, truth):
        assert beam.tokens[: len(PROMPT)] == PROMPT
        assert tuple(beam.output_token_ids) == seq
        assert beam_score(max_tokens, False, beam.cum_logprob, length_penalty) == pytest.approx(score, abs=1e-3)
    _all_free(tiny_llm)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_tiny_model_narrow_beam_equals_reference_search(tiny_llm, hf_tiny, temperature):
    """Width 2 over 5 tokens: the engine's search matches the same search run on the
    logprobs transformers computes for every prefix (the temperature scales them)."""
    params = BeamSearchParams(beam_width=2, max_tokens=5, temperature=temperature, length_penalty=1.0)
    logprobs_of = _hf_logprobs(hf_tiny, temperature)
    reference = _run(BeamSearch([], params, frozenset()), lambda p: dict(enumerate(logprobs_of(p))))
    out = tiny_llm.beam_search({"prompt_token_ids": PROMPT}, params)[0]
    assert [b.output_token_ids for b in out.sequences] == [b.output_token_ids for b in reference]
    for got, ref in zip(out.sequences, reference):
        assert got.cum_logprob == pytest.approx(ref.cum_logprob, abs=1e-3)
    _all_free(tiny_llm)


def test_beams_share_blocks_through_the_prefix_cache(tiny_llm):
    """A step request of a beam finds the full blocks its parent's step computed."""
    before = tiny_llm.engine.scheduler.make_stats().prefix_cache_hits
    tiny_llm.beam_search([{"prompt_token_ids": PROMPT * 3}], BeamSearchParams(beam_width=3, max_tokens=6))
    hits = tiny_llm.engine.scheduler.make_stats().prefix_cache_hits - before
    # Every step after the first re-reads at least the prompt's 3 full blocks, for every beam.
    assert hits >= 5 * 3 * 12
    _all_free(tiny_llm)


def test_several_prompts_in_one_batch(tiny_llm):
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    both = tiny_llm.beam_search([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[::-1]}], params)
    alone = [tiny_llm.beam_search({"prompt_token_ids": p}, params)[0] for p in (PROMPT, PROMPT[::-1])]
    for a, b in zip(both, alone):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    _all_free(tiny_llm)


def test_prompt_too_long_is_rejected(tiny_llm):
    with pytest.raises(ValueError, match="context length"):
        tiny_llm.beam_search({"prompt_token_ids": [1] * 250}, BeamSearchParams(beam_width=2, max_tokens=10))
    _all_free(tiny_llm)


def test_exhaustive_helper_counts_every_leaf():
    assert len(_exhaustive(3, 2, set(), 1.0, lambda p: [0.0] * 3)) == 9
    assert len(_exhaustive(3, 2, {0}, 1.0, lambda p: [0.0] * 3)) == 1 + 2 * 3
