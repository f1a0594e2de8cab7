"""Prompt lookup: propose the tokens that followed the last occurrence of the current suffix.

For n from ``max_n`` down to ``min_n``: take the last n tokens (prompt + output so far),
find their most recent earlier occurrence, and propose the tokens that came after it.
Editing and copying workloads (code rewrites, quoting, summaries that reuse phrases)
repeat long runs of the prompt, which this finds for free.

E.g. tokens [5, 6, 7, 8, 5, 6], n = 2: the suffix [5, 6] occurred at index 0, so the
proposal is [7, 8, 5, ...] (as many as asked, up to the end of the sequence).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagoda.spec_decode.proposer import DraftRequest


def ngram_lookup(token_ids: list[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    tokens = np.asarray(token_ids, dtype=np.int64)
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n:]
        # Windows that end before the last token, so at least one token follows each.
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    """Needs only token ids: no model, no KV cache."""

    needs_sync = False

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [ngram_lookup(r.token_ids, self.min_n, self.max_n, r.num_drafts) for r in requests]
