"""Turns engine-core token outputs into RequestOutputs.

Runs in the front-end process: detokenizes incrementally, matches stop
strings (the engine core only knows token ids, so a stop string is reported
back as a request to finish), gathers logprobs, and joins the n samples of a
request (each runs in the core as its own child request, sharing the prompt's
KV blocks through the prefix cache).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Sequence

from pagoda.core.outputs import EngineCoreOutput, TokenLogprobs
from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.engine.messages import EngineCoreRequest
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import ImageInput
from pagoda.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
    child_request_id,
)
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import Tokenizer


def make_core_requests(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    arrival_time: float = 0.0,
    priority: int = 0,
    cache_salt: str | None = None,
    tenant: str | None = None,
    lora_request: LoRARequest | None = None,
    mm_inputs: Sequence[ImageInput] = (),
    background: bool = False,
) -> list[EngineCoreRequest]:
    """One core request per sample (best_of of them when set, else n). With a seed, sample
    i uses seed + i, so the samples differ yet the whole request is reproducible. Only
    sample 0 computes prompt_logprobs (they are the same for every sample). best_of's
    samples report their sampled tokens' logprobs, which rank them."""
    reqs = []
    num = params.num_samples
    ranks_samples = params.best_of is not None and params.best_of > params.n
    for i in range(num):
        seed = params.seed + i if params.seed is not None else None
        logprobs = params.logprobs if params.logprobs is not None or not ranks_samples else 0
        child = dataclasses.replace(params, n=1, best_of=None, seed=seed, logprobs=logprobs,
                                    prompt_logprobs=params.prompt_logprobs if i == 0 else None)
        reqs.append(
            EngineCoreRequest(
                request_id=child_request_id(request_id, i, num),
                prompt_token_ids=prompt_token_ids,
                sampling_params=child,
                eos_token_ids=sorted(eos_token_ids),
                arrival_time=arrival_time,
                priority=priority,
                cache_salt=cache_salt,
                tenant=tenant,
                lora_request=lora_request,
                mm_inputs=list(mm_inputs),
                background=background,
            )
        )
    return reqs


@dataclass
class _ChildState:
    parent: _ParentState
    index: int
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer | None
    # Timings (time.monotonic()): the engine's first scheduling, the steps of the first and
    # last tokens. Reported as RequestMetrics for a request of one sequence.
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    last_token_time: float = 0.0


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_ChildState]
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    arrival_time: float = 0.0

    @property
    def finished(self) -> bool:
        return all(c.output.finished for c in self.children)

    def to_output(self) -> RequestOutput:
        outputs = [c.output for c in self.children]
        if len(outputs) > self.params.n:
            # best_of: the n samples of the highest cumulative logprob, renumbered in that order.
            best = sorted(outputs, key=lambda o: o.cumulative_logprob or 0.0, reverse=True)[: self.params.n]
            outputs = [dataclasses.replace(o, index=i) for i, o in enumerate(best)]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            metrics=self._metrics(),
        )

    def _metrics(self) -> RequestMetrics | None:
        """A finished request's timings, when it ran as one sequence (with several, whose
        timings would they be?)."""
        if len(self.children) != 1 or not self.finished:
            return None
        c = self.children[0]
        return RequestMetrics(self.arrival_time, c.scheduled_time, c.first_token_time, c.last_token_time,
                              len(c.output.token_ids))


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else frozenset()
        self._children: dict[str, _ChildState] = {}
        self._parents: dict[str, _ParentState] = {}
        self._token_text: dict[int, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        if request_id in self._parents:
            raise ValueError(f"duplicate request id {request_id!r}")
        if self.tokenizer is None and (params.stop or params.bad_words):
            raise ValueError("stop strings and bad_words need a tokenizer (the engine was started with "
                             "skip_tokenizer_init)")
        if params.bad_words and params.bad_words_token_ids is None:
            params.update_from_tokenizer(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        parent = _ParentState(request_id, prompt, prompt_token_ids, params, [], arrival_time=time.monotonic())
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(prompt_token_ids)
        num = params.num_samples
        # best_of ranks its samples by cumulative logprob, asked for or not.
        tracks_cumulative = params.logprobs is not None or num > params.n
        for i in range(num):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer.backend,
                    prompt_token_ids=prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop or (),
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
            out = CompletionOutput(
                index=i, text="", token_ids=[],
                cumulative_logprob=0.0 if tracks_cumulative else None,
                logprobs=[] if params.logprobs is not None else None,
            )
            child = _ChildState(parent, i, out, detok)
            parent.children.append(child)
            self._children[child_request_id(request_id, i, num)] = child
        self._parents[request_id] = parent

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        if parent is None:
            return []
        n = len(parent.children)
        return [child_request_id(request_id, i, n) for i in range(n) if not parent.children[i].output.finished]

    def parent_id(self, child_id: str) -> str | None:
        child = self._children.get(child_id)
        return child.parent.request_id if child is not None else None

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    @property
    def num_unfinished(self) -> int:
        return len(self._parents)

    def _logprobs(self, entries: list[TokenLogprobs], token_ids: list[int]) -> SampleLogprobs:
        """One dict per position: the token itself first (with its rank when the core computed
        it), then the top alternatives by rank, then any tracked logprob_token_ids."""
        out: SampleLogprobs = []
        for entry, token_id in zip(entries, token_ids):
            pos: dict[int, Logprob] = {}
            for rank, (tid, lp) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1):
                pos[tid] = Logprob(lp, rank, self._decode_one(tid))
            if token_id not in pos:
                pos = {token_id: Logprob(entry.logprob, entry.rank, self._decode_one(token_id)), **pos}
            for tid, lp, rank in zip(entry.tracked_token_ids, entry.tracked_logprobs, entry.tracked_ranks):
                pos.setdefault(tid, Logprob(lp, rank, self._decode_one(tid)))
            out.append(pos)
        return out

    def _add_prompt_logprobs(self, parent: _ParentState, core_out: EngineCoreOutput) -> None:
        """Place a chunk's prompt logprobs by position (a recomputed chunk after preemption
        writes the same values again)."""
        if parent.prompt_logprobs is None or core_out.prompt_logprobs is None:
            return
        start = core_out.prompt_logprobs_start
        ids = parent.prompt_token_ids[start:start + len(core_out.prompt_logprobs)]
        for i, pos in enumerate(self._logprobs(core_out.prompt_logprobs, ids)):
            parent.prompt_logprobs[start + i] = pos

    def _decode_one(self, token_id: int) -> str | None:
        """A token's text, cached: logprobs over the whole vocabulary decode every token id
        at every position. (At most one entry per token id.)"""
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        timestamp: float | None = None) -> tuple[list[RequestOutput], list[str]]:  # fmt: skip
        """Apply one step's outputs (``timestamp``: the step's, time.monotonic(); None or 0: now).
        Returns the RequestOutputs of every parent request that changed, and the child ids
        the engine core must stop because a stop string matched."""
        now = timestamp or time.monotonic()
        touched: dict[str, _ParentState] = {}
        to_stop: list[str] = []
        for parent in self._parents.values():
            for child in parent.children:
                child.output.delta_text = ""
                child.output.delta_token_ids = []
                child.output.delta_logprobs = None
                child.output.just_finished = False
        for core_out in outputs:
            child = self._children.get(core_out.request_id)
            if child is None or child.output.finished:
                continue
            out = child.output
            parent = child.parent
            parent.num_cached_tokens = max(parent.num_cached_tokens, core_out.num_cached_tokens)
            self._add_prompt_logprobs(parent, core_out)
            new_ids = core_out.new_token_ids
            finish_reason = core_out.finish_reason
            stop_reason = core_out.stop_reason
            if core_out.scheduled_time and not child.scheduled_time:
                child.scheduled_time = core_out.scheduled_time
            if new_ids:
                child.first_token_time = child.first_token_time or now
                child.last_token_time = now
                out.token_ids.extend(new_ids)
                out.delta_token_ids = list(new_ids)
                if core_out.new_logprobs is not None and out.logprobs is not None:
                    lps = self._logprobs(core_out.new_logprobs, new_ids)
                    out.logprobs.extend(lps)
                    out.delta_logprobs = lps
                if core_out.new_logprobs is not None and out.cumulative_logprob is not None:
                    out.cumulative_logprob += sum(e.logprob for e in core_out.new_logprobs)
                text_ids = new_ids
                if finish_reason == "stop" and not parent.params.include_stop_str_in_output and (
                        new_ids[-1] == stop_reason or (new_ids[-1] in self.eos_token_ids and not parent.params.ignore_eos)):
                    # Ended by EOS or a stop token id: its text is not part of the output (as in
                    # vLLM), which matters when special tokens are decoded (skip_special_tokens=False).
                    # (A grammar that completes also ends a request with "stop", on a token of its own.)
                    text_ids = new_ids[:-1]
                if child.detokenizer is not None and text_ids:
                    matched = child.detokenizer.update(text_ids)
                    if matched is not None:
                        if finish_reason is None:
                            to_stop.append(core_out.request_id)  # the core knows only token ids
                        # The text ends at the stop string, so that is why it ended, also when
                        # the same step reached max_tokens ("length") or a stop token (as vLLM).
                        finish_reason, stop_reason = "stop", matched
            if finish_reason is not None:
                out.finish_reason = finish_reason
                out.stop_reason = stop_reason
                out.just_finished = True
            if child.detokenizer is not None:
                out.delta_text = child.detokenizer.get_delta(finished=out.finished)
                out.text = child.detokenizer.output_text if out.finished else out.text + out.delta_text
            touched[parent.request_id] = parent
        results = []
        for rid, parent in touched.items():
            if len(parent.children) > parent.params.n and not parent.finished:
                continue  # best_of: which samples are returned is known only at the end
            results.append(parent.to_output())
            if parent.finished:
                del self._parents[rid]
                n = len(parent.children)
                for i in range(n):
                    self._children.pop(child_request_id(rid, i, n), None)
        return results, to_stop

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Forget a request (the caller aborts it in the core); returns its final state."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return None
        n = len(parent.children)
        for child in parent.children:
            if not child.output.finished:
                child.output.finish_reason = "abort"
                child.output.just_finished = True
            self._children.pop(child_request_id(request_id, child.index, n), None)
        return parent.to_output()
