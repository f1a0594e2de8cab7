"""A fake engine: the real front end (EngineFrontEnd) over a scripted core instead of a model.

Fast and deterministic, for testing the HTTP layer's wire format and error paths. Only the
engine core is fake: requests go through the real validation, core-request fan-out,
detokenizer, stop-string matching (held back while a stop string might still match),
logprob assembly and abort paths, and every message to and from the "core" goes through
the real msgpack codec (pagoda/engine/messages.py). The script: choice i of a request
emits ``SCRIPT`` tokens starting at offset i, one token per step, and ends at max_tokens,
a stop_token_id or an EOS token; its logprobs are made up (-0.25 - 0.01 * step, alternatives from
token 100 on, each one lower). Knobs let tests make it slow, dead, overloaded, hold
requests before their first token, or fail mid-stream; it records every request and
every abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import lru_cache

from pagoda.config import EngineConfig
from pagoda.core.outputs import EngineCoreOutput, SchedulerStats, TokenLogprobs
from pagoda.engine.client import EngineDeadError, EngineOverloadedError, GenerateCall
from pagoda.engine.frontend import EngineFrontEnd
from pagoda.engine.messages import (
    Abort,
    AddLora,
    CheckIntegrity,
    EngineCoreOutputs,
    EngineCoreRequest,
    FromCore,
    IntegrityResult,
    LoraResult,
    RemoveLora,
    Shutdown,
    Stop,
    ToCore,
    decode,
    encode,
)
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import Tokenizer

SCRIPT = " The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!"
DEAD = "engine core process exited with code -9"


@lru_cache(maxsize=1)
def load_tokenizer() -> Tokenizer:
    from pagoda.hub.gguf_file import GGUFFile
    from pagoda.hub.paths import default_model_path

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
    background: bool = False


@dataclass
class _Scripted:
    """One request at the fake core: its core requests (one per choice) still running."""

    choices: dict[str, tuple[int, EngineCoreRequest]] = field(default_factory=dict)  # core id -> (index, req)
    generated: dict[str, int] = field(default_factory=dict)
    num_cached_tokens: int = 0
    step: int = 0
    scheduled_time: float = field(default_factory=time.monotonic)   # "admitted" when it arrives


class FakeEngine(EngineFrontEnd):
    def __init__(self, max_model_len: int = 512, step_delay: float = 0.0) -> None:
        self._init_args = (max_model_len, step_delay)
        tokenizer = load_tokenizer()
        # No EngineMetrics: /metrics and the dashboard must work without a recorder.
        super().__init__(EngineConfig(), tokenizer, max_model_len, tokenizer.vocab_size, metrics=None)
        self.script = tokenizer.encode(SCRIPT, add_special_tokens=False)
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
        self._scripted: dict[str, _Scripted] = {}   # the fake core's requests, by request id

    def reset(self) -> None:
        """Back to a fresh engine (knobs, records, prefix cache), for reuse behind a shared server."""
        self.__init__(*self._init_args)  # type: ignore[misc]

    # ---- the front end's hooks: what the tests record --------------------------------------
    async def _generate(self, call: GenerateCall) -> AsyncIterator[RequestOutput]:
        if self.dead:
            raise EngineDeadError(DEAD)
        if self.overloaded:
            raise EngineOverloadedError("the waiting queue is full", retry_after=2.5)
        self.calls.append(FakeCall(call.request_id, call.prompt, list(call.prompt_token_ids), call.sampling_params,
                                   call.priority, call.cache_salt, call.tenant, call.background))  # fmt: skip
        self._running += 1
        try:
            stream = super()._generate(call)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    yield out
            self.finished.append(call.request_id)
        finally:
            self._running -= 1

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.abort_event.set()
        await super().abort(request_id)

    @property
    def is_healthy(self) -> bool:
        return not self.dead

    @property
    def dead_reason(self) -> str | None:
        return DEAD if self.dead else None

    def latest_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=self._running, num_waiting_reqs=0, kv_cache_usage=0.25, num_blocks=100,
            num_free_blocks=75, prefix_cache_queries=100, prefix_cache_hits=40, step_batch_size=self._running,
            step_num_tokens=self._running, num_steps=7,
        )  # fmt: skip

    async def shutdown(self) -> None:
        self.shut_down = True

    # ---- the scripted core -----------------------------------------------------------------
    async def _send(self, msg: ToCore) -> None:
        msg = decode(encode(msg))  # through the real codec, as over ZMQ
        if isinstance(msg, EngineCoreRequest):
            self._add(msg)
        elif isinstance(msg, (Abort, Stop)):
            for core_id in msg.request_ids:
                self._drop(core_id)
        elif isinstance(msg, CheckIntegrity):
            await self._answer(IntegrityResult(msg.token, None, os.getpid()))
        elif isinstance(msg, (AddLora, RemoveLora)):
            await self._answer(LoraResult(msg.token))
        else:
            assert isinstance(msg, Shutdown), msg

    async def _answer(self, msg: FromCore) -> None:
        await self._receive(decode(encode(msg)))

    def _add(self, req: EngineCoreRequest) -> None:
        request_id = self.processor.parent_id(req.request_id)
        assert request_id is not None, req.request_id
        scripted = self._scripted.get(request_id)
        if scripted is None:
            key = tuple(req.prompt_token_ids)
            cached = (len(key) // 16) * 16 if key in self._seen_prompts else 0
            self._seen_prompts.add(key)
            scripted = self._scripted[request_id] = _Scripted(num_cached_tokens=cached)
            asyncio.get_running_loop().create_task(self._run(request_id, scripted))
        # The choices arrive in index order (make_core_requests), all before the task's first step.
        scripted.choices[req.request_id] = (len(scripted.choices), req)
        scripted.generated[req.request_id] = 0

    def _drop(self, core_id: str) -> None:
        for scripted in self._scripted.values():
            scripted.choices.pop(core_id, None)

    def _current(self, request_id: str, scripted: _Scripted) -> bool:
        """Whether this request still runs here (not ended, not forgotten by reset())."""
        return self._scripted.get(request_id) is scripted and bool(scripted.choices)

    async def _run(self, request_id: str, scripted: _Scripted) -> None:
        try:
            while self.hold_first_token and self._current(request_id, scripted):
                await asyncio.sleep(0.005)
            while self._current(request_id, scripted):
                await asyncio.sleep(self.step_delay)
                if not self._current(request_id, scripted):
                    break
                if self.dead or (self.fail_after_steps is not None and scripted.step >= self.fail_after_steps):
                    await self._request_failed(next(iter(scripted.choices)),
                                               EngineDeadError("engine core died mid-request"))  # fmt: skip
                    break
                outputs = [self._step(scripted, core_id) for core_id in list(scripted.choices)]
                scripted.step += 1
                await self._answer(EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic()))
                self.started_event.set()
        finally:
            if self._scripted.get(request_id) is scripted:
                del self._scripted[request_id]

    def _step(self, scripted: _Scripted, core_id: str) -> EngineCoreOutput:
        index, req = scripted.choices[core_id]
        params = req.sampling_params
        token = self.script[(scripted.step + index) % len(self.script)]
        scripted.generated[core_id] += 1
        finish_reason, stop_reason = None, None
        if token in (params.stop_token_ids or []):
            finish_reason, stop_reason = "stop", token
        elif token in req.eos_token_ids and not params.ignore_eos:
            finish_reason = "stop"  # as the real core: the model's end of turn, no stop_reason
        elif scripted.generated[core_id] >= (params.max_tokens or self.max_model_len):
            finish_reason = "length"
        if finish_reason is not None:
            del scripted.choices[core_id]
        logprobs = None
        if params.logprobs is not None:
            logprobs = [self._logprobs(token, scripted.step, params.logprobs)]
        first = scripted.generated[core_id] == 1
        return EngineCoreOutput(core_id, [token], logprobs, finish_reason, stop_reason,
                                num_cached_tokens=scripted.num_cached_tokens,
                                scheduled_time=scripted.scheduled_time if first else 0.0)  # fmt: skip

    @staticmethod
    def _logprobs(token: int, step: int, k: int) -> TokenLogprobs:
        """The sampled token first (rank 1) when k > 0, then other ids from 100 on, each 1 lower."""
        lp = -0.25 - 0.01 * step
        top = [token] if k > 0 else []
        alt = 100
        while len(top) < k:
            if alt != token:
                top.append(alt)
            alt += 1
        return TokenLogprobs(lp, top, [lp - i for i in range(len(top))])
