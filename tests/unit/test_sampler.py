from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.sample.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingRow
from pagoda.sampling_params import SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def make_row(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    generator: torch.Generator | None = None,
    eos: frozenset[int] = frozenset(),
) -> SamplingRow:
    if generator is None and not params.is_greedy:
        generator = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
    return SamplingRow(
        params=params,
        prompt_token_ids=list(prompt or [0]),
        output_token_ids=list(output or []),
        generator=generator,
        eos_token_ids=eos,
    )


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    md = SamplingMetadata.from_rows(rows, logits.shape[-1], CPU)
    return Sampler()(logits, md)


def full_logprobs(out: SamplerOutput, row: int, vocab: int) -> torch.Tensor:
    """Rebuild a row's whole logprob vector from top-k output where K == V."""
    assert out.topk_token_ids is not None and out.topk_logprobs is not None
    dense = torch.empty(vocab)
    dense[out.topk_token_ids[row]] = out.topk_logprobs[row]
    return dense


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 100)
    before = logits.clone()
    rows = [make_row(SamplingParams(temperature=0.0, top_k=3, top_p=0.1)) for _ in range(5)]
    out = sample(logits, rows)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.topk_token_ids is None and out.topk_logprobs is None
    assert torch.equal(logits, before)  # never modified in place


def test_greedy_rows_in_mixed_batch_are_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    rows = [
        make_row(SamplingParams(temperature=0.0)),
        make_row(SamplingParams(temperature=0.8, top_k=5, top_p=0.5, min_p=0.1, seed=3)),
        make_row(SamplingParams(temperature=0.0, logprobs=2)),
        make_row(SamplingParams(temperature=1.3, seed=4)),
    ]
    out = sample(logits, rows)
    assert out.sampled_token_ids[0] == logits[0].argmax()
    assert out.sampled_token_ids[2] == logits[2].argmax()
    # Greedy logprobs ignore temperature: plain log_softmax of the logits.
    assert out.topk_logprobs is not None
    assert torch.allclose(out.topk_logprobs[2], torch.log_softmax(logits[2], -1).topk(2).values)


# ------------------------------------------------------- reproducibility


def run_steps(
    steps: list[torch.Tensor], requests: list[tuple[SamplingParams, list[int]]], order: list[int]
) -> dict[int, list[int]]:
    """Decode len(steps) tokens for the requests, placed in the batch in `order`."""
    gens = {i: torch.Generator().manual_seed(p.seed) if p.seed is not None else None
            for i, (p, _) in enumerate(requests)}
    outputs: dict[int, list[int]] = {i: [] for i in order}
    for step_logits in steps:
        rows = [
            make_row(requests[i][0], requests[i][1], outputs[i], generator=gens[i]) for i in order
        ]
        # Each request always sees the same logits row, wherever it sits.
        logits = torch.stack([step_logits[i] for i in order])
        tokens = sample(logits, rows).sampled_token_ids.tolist()
        for i, t in zip(order, tokens):
            outputs[i].append(t)
    return outputs


def test_seeded_sampling_independent_of_batch() -> None:
    torch.manual_seed(2)
    vocab = 64
    steps = [torch.randn(5, vocab) * 2 for _ in range(8)]
    requests = [
        (SamplingParams(temperature=0.9, seed=1234), [1, 2, 3]),
        (SamplingParams(temperature=0.0, repetition_penalty=1.3), [4]),
        (SamplingParams(temperature=1.5, top_k=7, top_p=0.8, seed=7, logprobs=3), [5]),
        (SamplingParams(temperature=0.7, min_p=0.2, frequency_penalty=1.0, seed=99), [6, 6]),
        (SamplingParams(temperature=1.0, seed=5, logit_bias={3: 2.0}), [7]),
    ]
    alone = {i: run_steps(steps, requests, [i])[i] for i in (0, 2, 3, 4)}
    for order in ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4], [1, 3, 0], [3, 1, 4, 2]):
        together = run_steps(steps, requests, order)
        for i in order:
            if i != 1:
                assert together[i] == alone[i], (order, i)
    # And the seed matters.
    other = [(SamplingParams(temperature=0.9, seed=4321), [1, 2, 3])]
    assert run_steps(steps, other, [0])[0] != alone[0]


def test_same_seed_same_tokens_in_one_batch() -> None:
    torch.manual_seed(3)
    logits = torch.randn(1, 1000).expand(3, 1000)
    rows = [make_row(SamplingParams(seed=11)) for _ in range(3)]
    tokens = sample(logits, rows).sampled_token_ids
    assert tokens[0] == tokens[1] == tokens[2]


# ------------------------------------------------------------ truncation


def allowed_tokens(logits: list[float], p: SamplingParams) -> set[int]:
    """Reference truncation in float64 with a little slack for float32 rounding."""
    x = torch.tensor(logits, dtype=torch.float64) / p.temperature
    probs = torch.softmax(x, -1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max() * (1 - 1e-4)
    if p.top_k > 0:
        kth = x.sort(descending=True).values[min(p.top_k, len(logits)) - 1]
        keep &= x >= kth - 1e-6
    if p.top_p < 1:
        q = torch.where(keep, probs, 0.0)
        q = q / q.sum()
        for t in range(len(logits)):
            mass_above = q[q > q[t] * (1 + 1e-4)].sum()
            if mass_above >= p.top_p + 1e-4:
                keep[t] = False
    return set(torch.nonzero(keep).flatten().tolist())


logit_values = st.one_of(
    st.floats(-10, 10, allow_nan=False, width=32),
    st.sampled_from([0.0, 1.0, 2.5]),  # force ties
)


@settings(max_examples=80, deadline=None)
@given(
    logits=st.lists(logit_values, min_size=1, max_size=40),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 45),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    seed=st.integers(0, 2**31),
)
def test_truncation_never_emits_filtered_token(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float, seed: int
) -> None:
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    draws = 64
    gen = torch.Generator().manual_seed(seed)
    rows = [make_row(p, generator=gen) for _ in range(draws)]
    batch = torch.tensor(logits, dtype=torch.float32).expand(draws, -1)
    tokens = set(sample(batch, rows).sampled_token_ids.tolist())
    assert tokens <= allowed_tokens(logits, p)
    if top_k > 0:
        assert len(tokens) <= top_k


def test_top_k_keeps_exactly_k_under_ties() -> None:
    draws = 600
    gen = torch.Generator().manual_seed(0)
    rows = [make_row(SamplingParams(top_k=3), generator=gen) for _ in range(draws)]
    tokens = sample(torch.zeros(draws, 10), rows).sampled_token_ids
    assert len(set(tokens.tolist())) == 3


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(2000, -1)
    gen = torch.Generator().manual_seed(0)

    def emitted(**kw: float) -> set[int]:
        rows = [make_row(SamplingParams(**kw), generator=gen) for _ in range(2000)]
        return set(sample(logits, rows).sampled_token_ids.tolist())

    assert emitted(top_p=0.5) == {0}  # 0.5 already reaches 0.5
    assert emitted(top_p=0.51) == {0, 1}
    assert emitted(top_p=0.85) == {0, 1, 2}  # 0.8 < 0.85
    assert emitted(top_p=0.01) == {0}  # always at least one token
    assert emitted(top_p=1.0) == {0, 1, 2, 3}
    assert emitted(min_p=0.5) == {0, 1}  # 0.3 >= 0.25, 0.15 < 0.25
    assert emitted(top_k=2) == {0, 1}
    assert emitted(top_k=100) == {0, 1, 2, 3}


# ------------------------------------------------------------- penalties


def test_penalties_exact_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    p = SamplingParams(
        temperature=0.0,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logprobs=6,
    )
    out = sample(logits, [make_row(p, prompt=[0, 1], output=[3, 3, 4])])
    # Repetition over prompt+output {0, 1, 3, 4}: positive / 2, negative * 2.
    # Then frequency 0.5 * count (3: 2, 4: 1), then presence 0.25 for 3 and 4.
    expected = torch.tensor([
        2.0 / 2,
        -1.0 * 2,
        0.5,
        3.0 / 2 - 0.5 * 2 - 0.25,
        -2.0 * 2 - 0.5 * 1 - 0.25,
        1.0,
    ])
    assert torch.allclose(full_logprobs(out, 0, 6), torch.log_softmax(expected, -1), atol=1e-6)
    assert out.sampled_token_ids.item() == 0  # 1.0 ties with token 5, argmax takes the first


def test_penalties_apply_per_row_and_negative_penalties_reward() -> None:
    logits = torch.zeros(3, 4)
    rows = [
        make_row(SamplingParams(temperature=0.0, logprobs=4), prompt=[1], output=[2]),
        make_row(SamplingParams(temperature=0.0, presence_penalty=-1.0, logprobs=4), output=[2, 2]),
        make_row(SamplingParams(temperature=0.0, frequency_penalty=-0.5, logprobs=4), output=[1, 1]),
    ]
    out = sample(logits, rows)
    assert torch.allclose(full_logprobs(out, 0, 4), torch.log_softmax(torch.zeros(4), -1))
    assert torch.allclose(
        full_logprobs(out, 1, 4), torch.log_softmax(torch.tensor([0.0, 0.0, 1.0, 0.0]), -1)
    )
    assert torch.allclose(
        full_logprobs(out, 2, 4), torch.log_softmax(torch.tensor([0.0, 1.0, 0.0, 0.0]), -1)
    )
    assert out.sampled_token_ids.tolist() == [0, 2, 1]


def test_repetition_penalty_uses_prompt_and_output() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, -1.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=4.0, logprobs=4)
    # Ids beyond the logits' width (padded vocab) are simply ignored.
    out = sample(logits, [make_row(p, prompt=[0, 3, 4000], output=[1])])
    expected = torch.tensor([0.25, 0.25, 1.0, -4.0])
    assert torch.allclose(full_logprobs(out, 0, 4), torch.log_softmax(expected, -1))
    assert out.sampled_token_ids.item() == 2


def test_temperature_scales_logprobs_of_random_rows() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.0]])
    p = SamplingParams(temperature=0.5, frequency_penalty=1.0, logprobs=3, seed=0)
    out = sample(logits, [make_row(p, output=[1])])
    expected = torch.log_softmax(torch.tensor([1.0, 1.0, 0.0]) / 0.5, -1)
    assert torch.allclose(full_logprobs(out, 0, 3), expected)


# ---------------------------------------------------------- logit_bias


def test_logit_bias_forces_and_bans() -> None:
    torch.manual_seed(4)
    draws = 300
    logits = torch.randn(1, 30).expand(draws, -1)
    gen = torch.Generator().manual_seed(0)
    force = [make_row(SamplingParams(logit_bias={17: 100.0}), generator=gen) for _ in range(draws)]
    assert set(sample(logits, force).sampled_token_ids.tolist()) == {17}

    top = int(logits[0].argmax())
    ban = SamplingParams(logit_bias={top: -100.0}, temperature=2.0)
    rows = [make_row(ban, generator=gen) for _ in range(draws)]
    assert top not in sample(logits, rows).sampled_token_ids.tolist()
    greedy = make_row(SamplingParams(temperature=0.0, logit_bias={top: -100.0}))
    assert sample(logits[:1], [greedy]).sampled_token_ids.item() != top


def test_logit_bias_added_before_penalties() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0]])
    p = SamplingParams(temperature=0.0, logit_bias={1: 2.0}, repetition_penalty=2.0, logprobs=3)
    out = sample(logits, [make_row(p, prompt=[1])])
    expected = torch.tensor([0.0, 1.0, 0.0])  # (0 + 2) / 2
    assert torch.allclose(full_logprobs(out, 0, 3), torch.log_softmax(expected, -1))


# ------------------------------------------------- grammar (structured output)


def allowed_mask(vocab: int, allowed: list[int]) -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[allowed] = True
    return mask


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_grammar_mask_bans_disallowed_tokens(temperature: float) -> None:
    torch.manual_seed(6)
    draws, vocab = 200, 20
    logits = torch.randn(1, vocab).expand(draws, -1).contiguous()
    before = logits.clone()
    allowed = [3, 11, 19]
    gen = torch.Generator().manual_seed(0)
    p = SamplingParams(temperature=temperature, logprobs=vocab, seed=1)
    rows = [make_row(p, generator=gen) for _ in range(draws)]
    for row in rows:
        row.allowed_tokens = allowed_mask(vocab, allowed)
    out = sample(logits, rows)
    assert set(out.sampled_token_ids.tolist()) <= set(allowed)
    if temperature == 0.0:
        assert out.sampled_token_ids.tolist() == [max(allowed, key=lambda t: float(logits[0, t]))] * draws
    # Logprobs are over the allowed tokens only: the rest are -inf.
    lp = full_logprobs(out, 0, vocab)
    expected = torch.full((vocab,), NEG_INF)
    expected[allowed] = torch.log_softmax(logits[0, allowed] / (temperature or 1.0), -1)
    assert torch.allclose(lp, expected)
    assert torch.equal(logits, before)  # never modified in place


def test_grammar_mask_only_touches_its_rows_and_bans_past_its_end() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0], [0.0, 1.0, 2.0, 9.0, 8.0]])
    greedy = SamplingParams(temperature=0.0, logprobs=5)
    constrained = make_row(greedy)
    # A mask narrower than the logits (the tokenizer's vocabulary < the model's):
    # the columns past its end are banned too.
    constrained.allowed_tokens = torch.tensor([True, True, True])
    out = sample(logits, [make_row(greedy), constrained])
    assert out.sampled_token_ids.tolist() == [3, 2]
    assert torch.allclose(full_logprobs(out, 0, 5), torch.log_softmax(logits[0], -1))
    lp = full_logprobs(out, 1, 5)
    assert lp[3] == NEG_INF and lp[4] == NEG_INF
    assert torch.allclose(lp[:3], torch.log_softmax(logits[1, :3], -1))
    # A mask wider than the logits: the extra columns are ignored.
    wide = make_row(greedy)
    wide.allowed_tokens = allowed_mask(8, [1, 4, 7])
    assert sample(logits[:1], [wide]).sampled_token_ids.tolist() == [4]


def test_grammar_mask_before_bias_and_penalties() -> None:
    """Bias cannot revive a token the grammar bans, and penalties see -inf there."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    p = SamplingParams(temperature=0.0, logit_bias={3: 100.0}, repetition_penalty=2.0,
                       frequency_penalty=1.0, logprobs=4)
    row = make_row(p, prompt=[2], output=[2])
    row.allowed_tokens = allowed_mask(4, [0, 1, 2])
    out = sample(logits, [row])
    assert out.sampled_token_ids.tolist() == [1]       # 2 is penalised to 2 / 2 - 1 = 0
    expected = torch.tensor([0.0, 1.0, 0.0, NEG_INF])
    assert torch.allclose(full_logprobs(out, 0, 4), torch.log_softmax(expected, -1))
    greedy_ids, probs = Sampler().target_distribution(logits, SamplingMetadata.from_rows([row], 4, CPU))
    assert greedy_ids.tolist() == [1] and probs is None


def _runner_masking_before_the_move(logits: torch.Tensor, masks: dict[int, torch.Tensor]) -> torch.Tensor:
    """What ModelRunner.execute_model did to the logits before the sampler took the
    grammar step over (row -> [V'] allowed mask), kept to prove the move changed no bit."""
    rows = sorted(masks)
    allowed = torch.stack([masks[j] for j in rows])
    vocab = min(allowed.shape[1], logits.shape[1])
    banned = torch.ones(len(rows), logits.shape[1], dtype=torch.bool)
    banned[:, :vocab] = ~allowed[:, :vocab]
    idx = torch.tensor(rows)
    logits = logits.clone()
    logits[idx] = logits[idx].masked_fill(banned, float("-inf"))
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), mask_width=st.sampled_from([40, 48, 64]))
def test_grammar_step_is_bit_identical_to_the_runner_masking(dtype: torch.dtype, seed: int,
                                                             mask_width: int) -> None:
    g = torch.Generator().manual_seed(seed)
    vocab, n = 48, 6
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, seed=1, top_k=5, logprobs=2, logit_bias={7: 2.5}),
        SamplingParams(temperature=1.3, seed=2, top_p=0.8, min_p=0.02, repetition_penalty=1.4),
        SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.3, min_tokens=4,
                       stop_token_ids=[5]),
        SamplingParams(temperature=1.0, seed=3, logprobs=0),
        SamplingParams(temperature=0.5, seed=4, logprobs=5),
    ]
    constrained = [j for j in range(n) if torch.rand((), generator=g) < 0.6]
    masks = {j: torch.rand(mask_width, generator=g) < 0.3 for j in constrained}
    for m in masks.values():
        m[int(torch.randint(0, min(vocab, mask_width), (), generator=g))] = True   # a grammar allows something

    def rows(with_masks: bool) -> list[SamplingRow]:
        out = []
        for j, p in enumerate(params):
            row = make_row(p, prompt=[1, 2, 7], output=[5, 7, 7],
                           generator=None if p.is_greedy else torch.Generator().manual_seed(100 + j),
                           eos=frozenset({0}))
            row.allowed_tokens = masks.get(j) if with_masks else None
            out.append(row)
        return out

    old = sample(_runner_masking_before_the_move(logits, masks) if masks else logits, rows(False))
    new = sample(logits, rows(True))
    assert torch.equal(new.sampled_token_ids, old.sampled_token_ids)
    for a, b in ((new.logprobs, old.logprobs), (new.topk_token_ids, old.topk_token_ids),
                 (new.topk_logprobs, old.topk_logprobs)):
        assert a is not None and b is not None
        assert torch.equal(a, b)


# ----------------------------------------------------------- min_tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_ids(temperature: float) -> None:
    logits = torch.tensor([[0.0, 0.0, 50.0, 40.0, 30.0]])
    eos = frozenset({2})
    p = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[3], logprobs=5, seed=1)
    out = sample(logits, [make_row(p, output=[0, 1], eos=eos)])
    assert out.sampled_token_ids.item() == 4
    lp = full_logprobs(out, 0, 5)
    assert lp[2] == NEG_INF and lp[3] == NEG_INF
    # Once min_tokens outputs exist nothing is blocked.
    out = sample(logits, [make_row(p, output=[0, 1, 0], eos=eos)])
    assert out.sampled_token_ids.item() == 2


def test_min_tokens_with_ignore_eos_only_blocks_stop_ids() -> None:
    logits = torch.tensor([[0.0, 0.0, 50.0, 60.0]])
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3], ignore_eos=True)
    out = sample(logits, [make_row(p, output=[], eos=frozenset({2}))])
    assert out.sampled_token_ids.item() == 2


def test_min_tokens_per_row() -> None:
    logits = torch.tensor([[0.0, 9.0], [0.0, 9.0]])
    eos = frozenset({1})
    rows = [
        make_row(SamplingParams(temperature=0.0, min_tokens=1), output=[], eos=eos),
        make_row(SamplingParams(temperature=0.0, min_tokens=1), output=[0], eos=eos),
    ]
    assert sample(logits, rows).sampled_token_ids.tolist() == [0, 1]


# ------------------------------------------------------------- logprobs


def test_logprobs_match_processed_log_softmax() -> None:
    torch.manual_seed(5)
    vocab = 40
    logits = torch.randn(4, vocab) * 3
    rows = [
        make_row(SamplingParams(temperature=0.7, logprobs=5, seed=1, top_k=3)),
        make_row(SamplingParams(temperature=0.0, logprobs=0)),
        make_row(SamplingParams(temperature=1.0, seed=2)),  # asked for none
        make_row(SamplingParams(temperature=2.0, logprobs=2, seed=3, top_p=0.3)),
    ]
    out = sample(logits, rows)
    assert out.logprobs is not None and out.topk_token_ids is not None
    assert out.topk_logprobs is not None
    assert out.logprobs.shape == (4,)
    assert out.topk_token_ids.shape == (4, 5) and out.topk_logprobs.shape == (4, 5)
    temps = torch.tensor([0.7, 1.0, 1.0, 2.0]).unsqueeze(1)
    reference = torch.log_softmax(logits / temps, -1)  # before top-k / top-p truncation
    sampled = out.sampled_token_ids
    assert torch.allclose(out.logprobs, reference.gather(1, sampled.unsqueeze(1)).squeeze(1))
    ref_vals, ref_ids = reference.topk(5, -1)
    assert torch.equal(out.topk_token_ids, ref_ids)
    assert torch.allclose(out.topk_logprobs, ref_vals)
    assert torch.all(out.topk_logprobs[:, :-1] >= out.topk_logprobs[:, 1:])  # sorted
    assert torch.allclose(out.topk_logprobs.gather(1, out.topk_token_ids.argsort(1)),
                          ref_vals.gather(1, ref_ids.argsort(1)))


def test_logprobs_zero_gives_only_sampled_token() -> None:
    out = sample(torch.tensor([[1.0, 2.0]]), [make_row(SamplingParams(temperature=0, logprobs=0))])
    assert out.logprobs is not None
    assert torch.allclose(out.logprobs, torch.log_softmax(torch.tensor([1.0, 2.0]), -1)[1:])
    assert out.topk_token_ids is not None and out.topk_token_ids.shape == (1, 0)


def test_logprobs_capped_by_vocab() -> None:
    out = sample(torch.tensor([[1.0, 2.0, 3.0]]), [make_row(SamplingParams(temperature=0, logprobs=20))])
    assert out.topk_token_ids is not None and out.topk_token_ids.tolist() == [[2, 1, 0]]


# ----------------------------------------------------------- statistics


def chi_square(tokens: list[int], probs: list[float]) -> float:
    n = len(tokens)
    counts = [tokens.count(i) for i in range(len(probs))]
    assert all(c == 0 for p, c in zip(probs, counts) if p == 0)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, [0.5, 0.25, 0.15, 0.1]),
        ({"temperature": 2.0}, None),  # probabilities proportional to sqrt(p)
        ({"top_k": 2}, [2 / 3, 1 / 3, 0.0, 0.0]),
        ({"top_p": 0.7}, [2 / 3, 1 / 3, 0.0, 0.0]),
    ],
)
def test_sampling_matches_distribution(kwargs: dict[str, float], expected: list[float] | None) -> None:
    base = [0.5, 0.25, 0.15, 0.1]
    if expected is None:
        roots = [math.sqrt(p) for p in base]
        expected = [r / sum(roots) for r in roots]
    draws = 4000
    gen = torch.Generator().manual_seed(1234)
    rows = [make_row(SamplingParams(**kwargs), generator=gen) for _ in range(draws)]
    logits = torch.tensor(base).log().expand(draws, -1)
    tokens = sample(logits, rows).sampled_token_ids.tolist()
    # df <= 3; the 0.1% critical value is 16.3. The seed is fixed, so this is
    # a check that the sampler is not badly biased, not a flaky test.
    assert chi_square(tokens, expected) < 25.0


# ---------------------------------------------------------------- counter-based draws (GPU)


def _counter_sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    md = SamplingMetadata.from_rows(rows, logits.shape[-1], CPU, counter_rng=True)
    assert md.random_seeds is not None
    return Sampler()(logits, md).sampled_token_ids


def test_counter_draws_take_no_per_row_generator_call(monkeypatch) -> None:
    """The GPU's draws: one hash for every random row (seeded or not), never a generator."""
    def refuse(*args, **kwargs):
        raise AssertionError("a per-row generator draw")

    monkeypatch.setattr(torch.Tensor, "exponential_", refuse)
    logits = torch.randn(4, 50)
    rows = [make_row(SamplingParams(temperature=0.8, seed=s)) for s in (1, 2, 3)] + [
        make_row(SamplingParams(temperature=0.0))]
    out = _counter_sample(logits, rows)
    assert out[3].item() == logits[3].argmax().item()


def test_counter_draws_depend_on_seed_and_position_only() -> None:
    """A row's token is a function of its seed, its output position and its logits: the same
    alone, in any batch order, and after a preemption (the same position redrawn); another
    position or seed draws anew."""
    torch.manual_seed(5)
    vocab = 200
    logits = torch.randn(3, vocab)

    def row(seed: int, position: int) -> SamplingRow:
        return make_row(SamplingParams(temperature=1.0, seed=seed), output=[7] * position)

    alone = [_counter_sample(logits[i:i + 1], [row(10 + i, 4)]).item() for i in range(3)]
    together = _counter_sample(logits, [row(10 + i, 4) for i in range(3)]).tolist()
    reverse = _counter_sample(logits.flip(0), [row(12 - i, 4) for i in range(3)]).tolist()[::-1]
    assert together == alone == reverse
    flat = torch.zeros(1, vocab)   # a uniform row: a different draw changes the token
    seen = {_counter_sample(flat, [row(10, p)]).item() for p in range(8)}
    assert len(seen) > 4
    assert {_counter_sample(flat, [row(s, 4)]).item() for s in range(8)} != {alone[0]}


def test_counter_draws_sample_the_distribution() -> None:
    """Over many positions a row picks token i with probability probs[i] (binomial bounds)."""
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    n = 3000
    rows = [make_row(SamplingParams(temperature=1.0, seed=11), output=[0] * p) for p in range(n)]
    tokens = _counter_sample(logits.expand(n, 3).contiguous(), rows)
    freq = torch.bincount(tokens, minlength=3).float() / n
    assert torch.allclose(freq, torch.tensor([0.2, 0.5, 0.3]), atol=4 * math.sqrt(0.25 / n))


# ---------------------------------------------------------- allowed_token_ids and bad words


def test_allowed_token_ids_limit_every_row_they_are_set_on() -> None:
    torch.manual_seed(5)
    draws = 200
    logits = torch.randn(1, 40).expand(draws, -1)
    gen = torch.Generator().manual_seed(1)
    allowed = [3, 9, 27]
    rows = [make_row(SamplingParams(temperature=2.0, allowed_token_ids=allowed), generator=gen) for _ in range(draws)]
    got = set(sample(logits, rows).sampled_token_ids.tolist())
    assert got <= set(allowed) and len(got) > 1
    # Greedy: the best of the allowed, beside a row without the list (untouched).
    greedy = [make_row(SamplingParams(temperature=0.0, allowed_token_ids=allowed)),
              make_row(SamplingParams(temperature=0.0))]
    out = sample(logits[:2], greedy).sampled_token_ids.tolist()
    assert out == [max(allowed, key=lambda t: float(logits[0, t])), int(logits[0].argmax())]


def test_allowed_token_ids_meet_a_grammar_mask() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 4] = 5.0
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[2, 4, 6]] = True   # the grammar allows 2, 4, 6; the list 6, 7
    row = make_row(SamplingParams(temperature=0.0, allowed_token_ids=[6, 7]))
    row.allowed_tokens = mask
    assert sample(logits, [row]).sampled_token_ids.item() == 6


def test_bad_words_ban_their_last_token_after_the_rest() -> None:
    logits = torch.zeros(1, 20)
    logits[0, 5] = 3.0
    logits[0, 8] = 2.0
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[5], [1, 2, 8]])
    # A one-token bad word is always banned; the three-token one only after 1, 2.
    assert sample(logits, [make_row(params, output=[7])]).sampled_token_ids.item() == 8
    assert sample(logits, [make_row(params, output=[1, 2])]).sampled_token_ids.item() not in (5, 8)


def test_bad_words_become_token_ids_at_the_start_and_after_a_space() -> None:
    params = SamplingParams(bad_words=["hello world"])
    table = {"hello world": [1, 2], " hello world": [3, 2]}
    params.update_from_tokenizer(lambda text: table[text])
    assert params.bad_words_token_ids == [[1, 2], [3, 2]]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])
    with pytest.raises(ValueError, match="out of range"):
        SamplingParams(allowed_token_ids=[1, 99]).validate_for_vocab(50)
