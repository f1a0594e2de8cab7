"""Pooling a prompt's hidden states into one vector, one chunk at a time.

A prompt may be computed over several steps (chunked prefill), so the pooler keeps a
little state per request between them: the running sum for MEAN, the first position's
hidden state for CLS; LAST needs none (the last chunk holds it). E.g. MEAN over a
10-token prompt in chunks of 4, 4, 2: sum rows 0-3, add rows 4-7, add rows 8-9, divide by
10. Sums are float32 whatever the model's dtype.

The state survives a swap preemption (the request resumes where it stopped) and starts
over when a request is (re)computed from position 0. MEAN and CLS need every position
computed, so an embedding engine with them turns prefix caching off (EngineCore); a
request that arrives part-computed anyway is a bug, reported as one.
"""

from __future__ import annotations

import torch

from pagoda.pooling import PoolerConfig, PoolingParams


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self._state: dict[str, torch.Tensor] = {}   # req id -> running sum (MEAN) or first row (CLS)

    def start(self, req_id: str, num_computed_tokens: int) -> None:
        """A request the runner (re)learns of: fresh state from position 0; a resumed
        request (swapped back in) keeps what it had."""
        if num_computed_tokens == 0:
            self._state.pop(req_id, None)
        elif self.config.needs_every_position and req_id not in self._state:
            raise RuntimeError(f"{self.config.pooling_type} pooling of {req_id} needs every position, but it "
                               f"starts with {num_computed_tokens} computed (prefix caching must be off)")

    def forget(self, req_id: str) -> None:
        self._state.pop(req_id, None)

    def add(self, req_id: str, rows: torch.Tensor, start: int, prompt_len: int,
            params: PoolingParams) -> list[float] | None:  # fmt: skip
        """Take one chunk's hidden states (``rows``: positions start .. start + len - 1);
        the finished embedding once the chunk reaches the prompt's end, else None."""
        kind = self.config.pooling_type
        end = start + rows.shape[0]
        if kind == "MEAN":
            chunk = rows.float().sum(dim=0)
            acc = self._state.get(req_id)
            self._state[req_id] = chunk if acc is None else acc + chunk
        elif kind == "CLS" and start == 0:
            self._state[req_id] = rows[0].float()
        if end < prompt_len:
            return None
        if kind == "LAST":
            vector = rows[-1].float()
        elif kind == "MEAN":
            vector = self._state.pop(req_id) / prompt_len
        else:
            vector = self._state.pop(req_id)
        return self.finish(vector, params).tolist()

    def finish(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """Truncate (Matryoshka), then L2-normalise unless the request or engine says not to."""
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = params.normalize if params.normalize is not None else self.config.normalize
        if normalize:
            vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
        return vector
