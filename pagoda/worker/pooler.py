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

A classifying engine's pooled vector goes through its head (``classifier_head``): the
checkpoint's score head, or a causal LM's LM-head rows of its classifier tokens; the request
gets the raw logits (the API applies the activation its route asks for).
"""

from __future__ import annotations

from typing import Callable

import torch

from pagoda.pooling import ClassifierConfig, PoolerConfig, PoolingParams


def classifier_head(model: torch.nn.Module, classifier: ClassifierConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """[hidden] pooled vector (float32) -> [num_labels] float32 logits. From tokens: the
    model's own logits (its LM head, divisor and soft-capping) of those tokens; two of them
    make one logit, the second's minus the first's (sigmoid of it is the second's probability
    of the two: vLLM's from_2_way_softmax)."""
    dtype = model.activation_dtype
    if classifier.from_token_ids is None:
        return lambda vector: model.classify(vector[None].to(dtype))[0]
    rows = torch.tensor(classifier.from_token_ids)

    def head(vector: torch.Tensor) -> torch.Tensor:
        logits = model.compute_logits(vector[None].to(dtype))[0, rows.to(vector.device)]
        return logits[1:] - logits[:1] if classifier.two_way else logits

    return head


def pair_token_types(num_tokens: int, pairs: list[tuple[int, int, int, int]], device: torch.device) -> torch.Tensor:
    """A step's token type ids: 1 from each cross-encoder pair's second text on, 0 elsewhere.
    ``pairs``: (first row in the step, first position computed, tokens computed, the second
    text's first position). E.g. 6 tokens, one pair at rows 1-5 from position 0 whose second
    text starts at 3 -> [0, 0, 0, 0, 1, 1]."""
    types = torch.zeros(num_tokens, dtype=torch.long)
    for row, start, n, second in pairs:
        types[row + max(second - start, 0):row + n] = 1
    return types.to(device)


class Pooler:
    def __init__(self, config: PoolerConfig,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:  # fmt: skip
        """``head``: a classifying engine's (``classifier_head``)."""
        if (config.classifier is None) != (head is None):
            raise ValueError("a classifying engine's pooler needs its head, an embedding engine's none")
        self.config = config
        self.head = head
        self._state: dict[str, torch.Tensor] = {}   # req id -> running sum (MEAN) or first row (CLS)

    @classmethod
    def for_model(cls, config: PoolerConfig, model: torch.nn.Module) -> Pooler:
        return cls(config, classifier_head(model, config.classifier) if config.classifier is not None else None)

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
        """A classifier's logits; else truncate (Matryoshka), then L2-normalise unless the
        request or engine says not to."""
        if self.head is not None:
            return self.head(vector)
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = params.normalize if params.normalize is not None else self.config.normalize
        if normalize:
            vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
        return vector
