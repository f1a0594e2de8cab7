"""A fake AsyncLLM: the real tokenizer, but tokens from a fixed script instead of a model.

Fast and deterministic, for testing the HTTP layer's wire format and error paths.
Choice i of a request emits ``SCRIPT`` tokens starting at offset i, one token per
step, and honours max_tokens, stop strings (held back while they might still match,
like the real detokenizer), stop_token_ids and logprobs. Knobs let tests make it
slow, dead, overloaded, hold requests before their first token, or fail mid-stream;
it records every request and every abort (an iterator closed before finishing).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import lru_cache

from pagoda.core.outputs import SchedulerStats
from pagoda.engine.async_llm import EngineDeadError, EngineOverloadedError
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import Tokenizer

SCRIPT = " The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!"


@lru_cache(maxsize=1)
def load_tokenizer() -> Tokenizer:
    from pagoda.model.gguf_file import GGUFFile
    from pagoda.model.loader import default_model_path

    return Tokenizer.from_gguf_metadata(GGUFFile(default_model_path()).metadata)


@dataclass
class FakeCall:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    tenant: str | None = None


@dataclass
class _Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    emitted: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class FakeEngine:
    def __init__(self, max_model_len: int = 512, step_delay: float = 0.0) -> None:
        self._init_args = (max_model_len, step_delay)
        self.tokenizer = load_tokenizer()
        self.max_model_len = max_model_len
        self.vocab_size = self.tokenizer.vocab_size
        self.script = self.tokenizer.encode(SCRIPT, add_special_tokens=False)
        self.step_delay = step_delay
        # Failure knobs, set by tests (from any thread).
        self.dead = False
        self.overloaded = False
        self.hold_first_token = False
        self.fail_after_steps: int | None = None
        # What happened.
        self.calls: list[FakeCall] = []
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.abort_event = threading.Event()
        self.started_event = threading.Event()  # some request produced its first output
        self.shut_down = False
        self._seen_prompts: set[tuple[int, ...]] = set()
        self._running = 0

    def reset(self) -> None:
        """Back to a fresh engine (knobs, records, prefix cache), for reuse behind a shared server."""
        self.__init__(*self._init_args)  # type: ignore[misc]

    # ---- AsyncLLM interface ------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        params.validate_for_vocab(self.vocab_size)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens does not fit {self.max_model_len}")

    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        self.validate_request(prompt_token_ids, sampling_params)
        if self.dead:
            raise EngineDeadError("engine core process exited with code -9")
        if self.overloaded:
            raise EngineOverloadedError("the waiting queue is full", retry_after=2.5)
        self.calls.append(FakeCall(request_id, prompt, list(prompt_token_ids), sampling_params,
                                   priority, cache_salt, tenant))
        key = tuple(prompt_token_ids)
        cached = (len(key) // 16) * 16 if key in self._seen_prompts else 0
        self._seen_prompts.add(key)
        choices = [_Choice(i) for i in range(sampling_params.n)]
        finished = False
        self._running += 1
        try:
            while self.hold_first_token:
                await asyncio.sleep(0.005)
            step = 0
            while not all(c.finish_reason for c in choices):
                await asyncio.sleep(self.step_delay)
                if self.dead or (self.fail_after_steps is not None and step >= self.fail_after_steps):
                    raise EngineDeadError("engine core died mid-request")
                outputs = [self._step(c, step, sampling_params) for c in choices]
                step += 1
                done = all(c.finish_reason for c in choices)
                yield RequestOutput(request_id, prompt, list(prompt_token_ids), outputs, done, cached)
                self.started_event.set()
            finished = True
            self.finished.append(request_id)
        finally:
            self._running -= 1
            if not finished:
                self.aborted.append(request_id)
                self.abort_event.set()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.abort_event.set()

    @property
    def is_healthy(self) -> bool:
        return not self.dead

    @property
    def dead_reason(self) -> str | None:
        return "engine core process exited with code -9" if self.dead else None

    def latest_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=self._running, num_waiting_reqs=0, kv_cache_usage=0.25, num_blocks=100,
            num_free_blocks=75, prefix_cache_queries=100, prefix_cache_hits=40, step_batch_size=self._running,
            step_num_tokens=self._running, num_steps=7,
        )  # fmt: skip

    async def shutdown(self) -> None:
        self.shut_down = True

    # ---- the script ------------------------------------------------------------------
    def _step(self, c: _Choice, step: int, params: SamplingParams) -> CompletionOutput:
        if c.finish_reason is not None:  # finished earlier: present, but unchanged
            return self._output(c, "", [], None, False)
        token = self.script[(step + c.index) % len(self.script)]
        c.token_ids.append(token)
        lps = None
        if params.logprobs is not None:
            lps = [self._logprobs(token, step, params.logprobs)]
            c.logprobs.extend(lps)
        text = self.tokenizer.decode(c.token_ids, skip_special_tokens=params.skip_special_tokens)
        for stop in params.stop or []:
            pos = text.find(stop)
            if pos >= 0:
                text = text[: pos + len(stop)] if params.include_stop_str_in_output else text[:pos]
                c.finish_reason, c.stop_reason = "stop", stop
                break
        if c.finish_reason is None:
            if token in (params.stop_token_ids or []):
                c.finish_reason, c.stop_reason = "stop", token
            elif len(c.token_ids) >= (params.max_tokens or self.max_model_len):
                c.finish_reason = "length"
            else:
                text = text[: len(text) - self._held_back(text, list(params.stop or []))]
        delta = text[len(c.emitted):]
        c.emitted = text
        return self._output(c, delta, [token], lps, c.finish_reason is not None)

    @staticmethod
    def _held_back(text: str, stops: list[str]) -> int:
        """Length of the longest suffix of text that could begin a stop string."""
        best = 0
        for stop in stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    best = max(best, k)
                    break
        return best

    def _logprobs(self, token: int, step: int, k: int) -> dict[int, Logprob]:
        lp = -0.25 - 0.01 * step
        sampled = Logprob(lp, 1 if k > 0 else None, self.tokenizer.decode([token], skip_special_tokens=False))
        entry = {token: sampled}
        alt = 100
        while len(entry) < k:
            if alt != token:
                entry[alt] = Logprob(lp - len(entry), len(entry) + 1,
                                     self.tokenizer.decode([alt], skip_special_tokens=False))  # fmt: skip
            alt += 1
        return entry

    @staticmethod
    def _output(c: _Choice, delta: str, delta_ids: list[int], delta_lps: list | None, just: bool) -> CompletionOutput:
        return CompletionOutput(
            index=c.index, text=c.emitted, token_ids=list(c.token_ids),
            cumulative_logprob=sum(next(iter(p.values())).logprob for p in c.logprobs) if c.logprobs else None,
            logprobs=list(c.logprobs) if delta_lps is not None or c.logprobs else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason, delta_text=delta,
            delta_token_ids=delta_ids, delta_logprobs=delta_lps, just_finished=just,
        )  # fmt: skip
