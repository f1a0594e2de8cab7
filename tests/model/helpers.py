"""Reference decoding and near-tie-aware comparison for model tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Summing in another order may flip a genuine near-tie; only then is a
# divergence excused.
NEAR_TIE = 1e-4


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with transformers, EOS not special (like ignore_eos).
    Returns the tokens and the logits at every generated position."""
    ids = torch.tensor([prompt_ids])
    out = model(ids, use_cache=True)
    past = out.past_key_values
    logits = out.logits[0, -1].float()
    tokens: list[int] = []
    all_logits = []
    for _ in range(max_new_tokens):
        all_logits.append(logits)
        token = int(torch.argmax(logits))
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    return tokens, all_logits


@dataclass
class Comparison:
    equal: bool
    excused: list[str]


def top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def compare_greedy(
    got: list[int],
    want: list[int],
    gap_at: "callable",
    label: str,
    tie: float = NEAR_TIE,
) -> Comparison:
    """Token-for-token equality, except a first divergence at a position
    whose top-2 logits (per ``gap_at(pos)``, the smallest gap either side saw)
    are within ``tie``. After an excused divergence the rest may differ."""
    for pos, (a, b) in enumerate(zip(got, want)):
        if a != b:
            gap = gap_at(pos)
            if gap < tie:
                return Comparison(True, [f"{label}: near-tie at position {pos} (top-2 gap {gap:.2e})"])
            return Comparison(False, [f"{label}: position {pos}: got {a}, want {b}, top-2 gap {gap:.2e}"])
    if len(got) != len(want):
        return Comparison(False, [f"{label}: lengths differ: {len(got)} vs {len(want)}"])
    return Comparison(True, [])


def logprob_gap(output, pos: int) -> float:
    """Top-2 gap from an engine output's logprobs (greedy: logprob gap == logit gap)."""
    entry = output.logprobs[pos]
    lps = sorted((lp.logprob for lp in entry.values()), reverse=True)
    return lps[0] - lps[1] if len(lps) > 1 else float("inf")


def assert_greedy_matches_hf(hf, prompts: list[list[int]], outputs, max_tokens: int, label: str,
                             greedy=None) -> None:
    """Each engine output (generated with logprobs=2) equals transformers' greedy tokens,
    a divergence excused only at a near-tie either side saw. ``greedy``: what runs
    transformers (hf_greedy's signature; a caching one, say)."""
    for i, (ids, out) in enumerate(zip(prompts, outputs)):
        want, want_logits = (greedy or hf_greedy)(hf, ids, max_tokens)
        result = compare_greedy(
            out.outputs[0].token_ids, want,
            lambda pos: min(top2_gap(want_logits[pos]), logprob_gap(out.outputs[0], pos)),
            f"{label} prompt {i}",
        )
        assert result.equal, result.excused
