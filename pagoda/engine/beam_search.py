"""Beam search on top of the engine, as vLLM does it: each step of each beam is its own
one-token request that asks for the top 2 x beam_width logprobs.

Why on top rather than inside the scheduler: a beam is then an ordinary request, so
everything the engine does for requests holds for beams too (batching, preemption,
abort, every block back at the end). Forking a beam costs no copy: the step requests of
a beam's children all start with the same tokens, so the prefix cache hands each of
them the parent's full KV blocks (ref counted, shared); only the tokens of the last,
partial block are prefilled again ("re-prefill from the cache", not copy-on-write). With
prefix caching off the algorithm is the same, each step recomputing its whole prefix.

The algorithm (``BeamSearch``), per step, for every live beam: extend it by each of its
top 2W tokens (W = beam_width); an extension ending in an EOS token (unless ignore_eos)
is complete, the others compete for the W live places by score. After max_tokens steps
(or when nothing is live; or, with early_stopping, once W sequences are complete), the
complete and live sequences together are ranked by score and the best W returned.

Score: cumulative logprob / length ** length_penalty, where length counts the generated
tokens less a final EOS (at least 1). The logprobs are those of the logits divided by
the temperature (temperature 0: the raw logits), the sampler's processed logprobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams, _check_bool, _check_float, _check_int

if TYPE_CHECKING:
    from pagoda.engine.client import EngineClient, GenerateCall


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams, plus early_stopping (HF's True: stop once beam_width
    sequences are complete; False: run until max_tokens or until nothing is live)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # keep the final EOS token's text
    early_stopping: bool = False

    def __post_init__(self) -> None:
        self.beam_width = _check_int("beam_width", self.beam_width)
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        self.max_tokens = _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.length_penalty = _check_float("length_penalty", self.length_penalty)
        self.include_stop_str_in_output = _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        self.early_stopping = _check_bool("early_stopping", self.early_stopping)

    def step_params(self) -> SamplingParams:
        """One step of one beam: a single token, with the top 2W logprobs to extend it by.
        EOS is ignored by the step request itself: whether an EOS extension ends a beam is
        the search's decision."""
        return SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width,
                              ignore_eos=True)  # fmt: skip


@dataclass
class BeamSearchSequence:
    """One beam. ``tokens`` holds the prompt too (as vLLM's); ``output_token_ids`` is the
    generated part; ``logprobs``: per generated token, its Logprob (a one-entry dict)."""

    tokens: list[int]
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None    # "stop" (EOS) or "length"
    text: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]   # best first


def beam_score(num_output_tokens: int, ends_with_eos: bool, cum_logprob: float, length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty, length without a final EOS (and at least 1)."""
    length = max(num_output_tokens - (1 if ends_with_eos else 0), 1)
    return cum_logprob / (length ** length_penalty)


class BeamSearch:
    """The search for one prompt, driven from outside: ``pending()`` lists the token ids
    of each live beam, the driver runs one step request per entry and hands the top
    logprobs of each back to ``advance``, until ``done``; then ``result()``."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams,
                 eos_token_ids: frozenset[int]) -> None:  # fmt: skip
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.live = [BeamSearchSequence(list(prompt_token_ids), len(prompt_token_ids))]
        self.complete: list[BeamSearchSequence] = []
        self.num_steps = 0

    def _score(self, beam: BeamSearchSequence) -> float:
        # Only a complete beam ends with an EOS ("stop"); live ones never hold one.
        return beam_score(len(beam.output_token_ids), beam.finish_reason == "stop", beam.cum_logprob,
                          self.params.length_penalty)  # fmt: skip

    @property
    def done(self) -> bool:
        p = self.params
        return (not self.live or self.num_steps >= p.max_tokens
                or (p.early_stopping and len(self.complete) >= p.beam_width))  # fmt: skip

    def pending(self) -> list[list[int]]:
        return [] if self.done else [beam.tokens for beam in self.live]

    def advance(self, candidates: Sequence[dict[int, float]]) -> None:
        """``candidates[i]``: token id -> logprob of the next token after live beam i (its
        top 2W), in rank order (ties then go to the better ranked token)."""
        if len(candidates) != len(self.live):
            raise ValueError(f"got candidates for {len(candidates)} beams, {len(self.live)} are live")
        extended: list[BeamSearchSequence] = []
        for beam, options in zip(self.live, candidates):
            for token_id, logprob in options.items():
                child = BeamSearchSequence(beam.tokens + [token_id], beam.num_prompt_tokens,
                                           beam.cum_logprob + logprob,
                                           beam.logprobs + [{token_id: Logprob(logprob)}])  # fmt: skip
                if token_id in self.eos_token_ids:
                    child.finish_reason = "stop"
                    self.complete.append(child)
                else:
                    extended.append(child)
        # sorted() is stable: equal scores keep beam order, then rank order.
        self.live = sorted(extended, key=self._score, reverse=True)[: self.params.beam_width]
        self.num_steps += 1

    def result(self) -> list[BeamSearchSequence]:
        for beam in self.live:
            beam.finish_reason = "length"
        ranked = sorted(self.complete + self.live, key=self._score, reverse=True)
        return ranked[: self.params.beam_width]


def top_candidates(out: RequestOutput, k: int) -> dict[int, float]:
    """A step request's top k logprobs (its first and only position), in rank order. The
    sampled token is left out unless it is among them: it is a draw, not a candidate."""
    position = out.outputs[0].logprobs[0] if out.outputs and out.outputs[0].logprobs else {}
    ranked = sorted((item for item in position.items() if item[1].rank is not None and item[1].rank <= k),
                    key=lambda item: item[1].rank or 0)  # fmt: skip
    return {tid: lp.logprob for tid, lp in ranked if not math.isnan(lp.logprob)}


def finish_text(beam: BeamSearchSequence, params: BeamSearchParams, decode: Callable[[list[int], bool], str],
                eos_token_ids: frozenset[int]) -> str:  # fmt: skip
    """The text of a beam: its tokens decoded, the final EOS kept only with include_stop_str_in_output."""
    out = beam.output_token_ids
    if beam.finish_reason == "stop" and out and out[-1] in eos_token_ids:
        text = decode(out[:-1], True)
        return text + decode(out[-1:], False) if params.include_stop_str_in_output else text
    return decode(out, True)


def to_request_output(request_id: str, prompt: str | None, prompt_token_ids: list[int],
                      beams: list[BeamSearchSequence]) -> RequestOutput:  # fmt: skip
    """The beams as a finished RequestOutput, one CompletionOutput per beam (best first)."""
    outputs = [
        CompletionOutput(index=i, text=beam.text or "", token_ids=beam.output_token_ids,
                         cumulative_logprob=beam.cum_logprob, logprobs=None, finish_reason=beam.finish_reason,
                         just_finished=True)
        for i, beam in enumerate(beams)
    ]  # fmt: skip
    return RequestOutput(request_id, prompt, prompt_token_ids, outputs, finished=True)


async def run_beam_search(engine: EngineClient, call: GenerateCall, params: BeamSearchParams,
                          eos_token_ids: frozenset[int]) -> AsyncIterator[RequestOutput]:  # fmt: skip
    """The server's beam search for one prompt (already validated): yields one finished
    RequestOutput. Each step's requests run concurrently; closing this iterator (client
    gone, timeout) cancels them, which aborts them in the engine."""
    search = BeamSearch(call.prompt_token_ids, params, eos_token_ids)
    step_params = params.step_params()

    async def one(step: int, i: int, tokens: list[int]) -> dict[int, float]:
        sub = dataclasses.replace(call, request_id=f"{call.request_id}-beam{step}-{i}", prompt=None,
                                  prompt_token_ids=tokens, sampling_params=step_params)  # fmt: skip
        final = None
        async with contextlib.aclosing(engine.run_request(sub)) as stream:
            async for out in stream:
                final = out
        return top_candidates(final, step_params.logprobs or 0) if final is not None else {}

    while not search.done:
        pending = search.pending()
        tasks = [asyncio.ensure_future(one(search.num_steps, i, t)) for i, t in enumerate(pending)]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        search.advance(results)
    beams = search.result()
    tok = engine.tokenizer
    for beam in beams:
        beam.text = finish_text(beam, params, lambda ids, skip: tok.decode(ids, skip_special_tokens=skip),
                                frozenset(eos_token_ids))  # fmt: skip
    yield to_request_output(call.request_id, call.prompt, call.prompt_token_ids, beams)
