"""Verification of draft tokens against the target model's distributions.

The target computed logits at the last known token and at each draft, so row j of
its distribution is what it would sample next after the known tokens plus drafts
``d[:j]``; row m (after all m drafts) gives the bonus token when every draft is kept.

Greedy: keep the longest prefix of drafts equal to the target's argmax, then emit the
target's own token at the first mismatch (or the bonus). The emitted tokens are
exactly what plain greedy decoding would produce, one step at a time.

Sampled (Leviathan et al. 2023; Chen et al. 2023): draft d_j, drawn from q_j, is kept
with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token is
drawn from the residual max(0, p_j - q_j), normalised, and the rest is dropped. Each
emitted token is then distributed exactly as p_j. A proposer without a distribution
(ngram lookup, a greedy draft) proposes deterministically, so q_j is one-hot at d_j:
keep with probability p_j(d_j), else draw from p_j with d_j removed.
"""

from __future__ import annotations

import torch


def verify_greedy(target_ids: list[int], draft_ids: list[int]) -> list[int]:
    """``target_ids``: the target's argmax at each of the len(draft_ids) + 1 rows.

    E.g. drafts [4, 7, 9], targets [4, 7, 2, 5] -> [4, 7, 2] (two kept, then the fix).
    """
    out = []
    for draft, target in zip(draft_ids, target_ids):
        out.append(target)
        if draft != target:
            return out
    out.append(target_ids[len(draft_ids)])
    return out


def rejection_sample(
    target_probs: torch.Tensor,              # [m + 1, V] the target's distributions
    draft_ids: list[int],                    # m drafts
    draft_probs: torch.Tensor | None,        # [m, V] the proposal distributions; None = one-hot
    generator: torch.Generator | None,
) -> list[int]:
    out: list[int] = []
    for j, draft in enumerate(draft_ids):
        p = target_probs[j]
        q_draft = 1.0 if draft_probs is None else float(draft_probs[j, draft])
        accept = min(1.0, float(p[draft]) / q_draft) if q_draft > 0 else 0.0
        u = float(torch.rand((), generator=generator, device=p.device))
        if u < accept:
            out.append(draft)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_(min=0.0)
        total = float(residual.sum())
        if total <= 0.0:
            # Only reachable through rounding (p <= q everywhere means p == q, and then
            # the draft is always kept); fall back to the target itself.
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(draft_ids)], 1, generator=generator)))
    return out
