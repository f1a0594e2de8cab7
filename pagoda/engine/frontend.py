"""EngineFrontEnd: the API-process half of an engine, over a link to its core.

It tracks each request's stream: turns a request into core requests (one per sample),
detokenizes and matches stop strings (OutputProcessor), fans the core's outputs out to
per-request queues, aborts what a consumer stops reading, keeps the LoRA adapters'
names, and answers the debug integrity check. What goes to the core and what comes back
are the messages of pagoda/engine/messages.py: a subclass sends them (``_send``) and
feeds what the core answers to ``_receive``. AsyncLLM sends them over ZMQ to an
engine-core process; the tests' FakeEngine answers them from a script in-process, so
that the HTTP tests run this same code.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagoda.config import EngineConfig
from pagoda.core.outputs import EngineCoreOutput, SchedulerStats
from pagoda.engine.client import (
    EngineClientBase,
    EngineDeadError,
    GenerateCall,
    KVTransferError,
    LoRAExistsError,
    LoRANotFoundError,
)
from pagoda.engine.messages import (
    Abort,
    AddLora,
    CheckIntegrity,
    Dead,
    EngineCoreOutputs,
    EngineCoreRequest,
    FromCore,
    IntegrityResult,
    LoraResult,
    RemoveLora,
    RequestError,
    Stop,
    ToCore,
)
from pagoda.engine.output_processor import OutputProcessor, make_core_requests
from pagoda.lora.errors import LoRAAdapterError, LoRAInUseError
from pagoda.lora.request import LoRARequest
from pagoda.metrics.log import StatLogger
from pagoda.metrics.stats import EngineMetrics
from pagoda.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagoda.pooling import PoolerConfig, placeholder_sampling_params
from pagoda.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def _snapshot(out: RequestOutput) -> RequestOutput:
    """Copy what later steps mutate in place, so a slow consumer sees this step."""
    return dataclasses.replace(out, outputs=[
        dataclasses.replace(
            c, token_ids=list(c.token_ids),
            logprobs=list(c.logprobs) if c.logprobs is not None else None,
        )
        for c in out.outputs
    ], prompt_logprobs=list(out.prompt_logprobs) if out.prompt_logprobs is not None else None)


class EngineFrontEnd(EngineClientBase):
    # Busy with no output from the core for this long = unhealthy (one CPU step is well under it).
    stall_timeout: float = 60.0

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        max_model_len: int,
        vocab_size: int,
        metrics: EngineMetrics | None = None,
        stats: SchedulerStats | None = None,
        stat_logger: StatLogger | None = None,
        pooler_config: PoolerConfig | None = None,
    ) -> None:
        """``metrics``: the recorder /metrics and the dashboard read (None: none kept);
        ``stats``: the core's state until its first message; ``stat_logger``: logs a
        throughput line now and then; ``pooler_config``: the core's, when it embeds."""
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = tokenizer.eos_token_ids
        self.processor = OutputProcessor(tokenizer)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.metrics = metrics
        self._stats = stats if stats is not None else SchedulerStats()
        if metrics is not None:
            metrics.stats = self._stats
        self._stat_logger = stat_logger
        self._queues: dict[str, asyncio.Queue] = {}
        self.pooler_config = pooler_config
        # Embedding requests in the core: request id -> prompt token ids. They bypass the
        # output processor (nothing to detokenize); their one output goes to their queue.
        self._pooling: dict[str, list[int]] = {}
        self._dead: str | None = None
        self._last_output = time.monotonic()
        # Request/reply calls to the core (integrity checks, LoRA calls) by their token.
        self._pending: dict[str, asyncio.Future] = {}
        # LoRA adapters by name. Ids are never reused, so prefix-cache keys of an
        # unloaded adapter can never match a later one loaded under the same name.
        self.lora_requests: dict[str, LoRARequest] = {}
        self._lora_busy: set[str] = set()     # names being loaded or unloaded
        self._next_lora_id = 1
        # Adapter name -> [prompt tokens, generated tokens], for /metrics.
        self.lora_token_counts: dict[str, list[int]] = {}
        self.replicas: tuple[EngineClientBase, ...] = ()  # one engine, no data-parallel replicas

    # ---- the link to the core (subclasses) -------------------------------------------------

    async def _send(self, msg: ToCore) -> None:
        """Send one message to the core."""
        raise NotImplementedError

    def _ensure_tasks(self) -> None:
        """Start whatever reads the core's messages (on the running loop), if not started."""

    def _check_alive(self) -> None:
        """Call ``_die`` if the core is found gone."""

    # ---- what the core says ----------------------------------------------------------------

    async def _receive(self, msg: FromCore) -> None:
        """Apply one message from the core."""
        self._last_output = now = time.monotonic()
        if isinstance(msg, EngineCoreOutputs):  # a step's outputs, or an idle Heartbeat
            if msg.scheduler_stats is not None:
                self._stats = msg.scheduler_stats
            metrics = self.metrics
            if metrics is not None:
                metrics.on_engine_outputs(msg, now)
            core_outputs = msg.outputs
            if any(o.error is not None for o in core_outputs):
                for o in core_outputs:
                    if o.error is not None:
                        await self._request_failed(o.request_id, KVTransferError(o.error))
                core_outputs = [o for o in core_outputs if o.error is None]
            if self._pooling and core_outputs:
                core_outputs = self._deliver_pooled(core_outputs)
            if core_outputs:
                # The step's own time (the core's clock, also CLOCK_MONOTONIC) for RequestMetrics.
                outputs, to_stop = self.processor.process_outputs(core_outputs, msg.timestamp)
                if metrics is not None:
                    metrics.on_request_outputs(outputs, now)
                if to_stop:
                    await self._send(Stop(to_stop))
                for out in outputs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(_snapshot(out))
            if self._stat_logger is not None:
                self._stat_logger.maybe_log(now)
        elif isinstance(msg, RequestError):
            await self._request_failed(msg.request_id, ValueError(msg.message))
        elif isinstance(msg, (IntegrityResult, LoraResult)):
            fut = self._pending.pop(msg.token, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, Dead):
            self._die(f"engine core failed: {msg.reason}")
        else:
            self._die(f"the engine core sent an unexpected {type(msg).__name__} message")

    def _deliver_pooled(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Hand embedding requests' outputs to their streams; the rest (generation) is returned."""
        rest = []
        for out in outputs:
            prompt = self._pooling.pop(out.request_id, None) if out.finished else None
            if prompt is None:
                rest.append(out)
                continue
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(EmbeddingRequestOutput(out.request_id, prompt, EmbeddingOutput(out.pooled or []),
                                                    finish_reason=out.finish_reason or "stop",
                                                    num_cached_tokens=out.num_cached_tokens))
        return rest

    async def _request_failed(self, core_request_id: str, error: Exception) -> None:
        """The core gave up on one of a request's core requests: abort the request, and its
        consumer gets ``error``."""
        if core_request_id in self._pooling:
            await self.abort(core_request_id)
            q = self._queues.get(core_request_id)
            if q is not None:
                q.put_nowait(error)
            return
        parent = self.processor.parent_id(core_request_id)
        if parent is not None:
            await self.abort(parent)
            q = self._queues.get(parent)
            if q is not None:
                q.put_nowait(error)

    def _die(self, reason: str) -> None:
        if self._dead is not None:
            return
        logger.error("%s", reason)
        self._dead = reason
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(reason))
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))

    # ---- requests --------------------------------------------------------------------------

    def ensure_background_tasks(self) -> None:
        if self._dead is None:
            self._ensure_tasks()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._queues)

    async def _generate(self, call: GenerateCall) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput]:
        if call.pooling_params is not None:
            async with contextlib.aclosing(self._embed(call)) as stream:
                async for out in stream:
                    yield out
            return
        request_id, prompt, prompt_token_ids, sampling_params = (
            call.request_id, call.prompt, call.prompt_token_ids, call.sampling_params)
        priority, cache_salt, tenant, lora_request = call.priority, call.cache_salt, call.tenant, call.lora_request
        queue = self._open_queue(request_id)
        finished = False
        try:
            self.processor.add_request(request_id, prompt, prompt_token_ids, sampling_params)
            arrival = time.monotonic()
            for req in make_core_requests(
                request_id, prompt_token_ids, sampling_params, self.eos_token_ids,
                arrival_time=arrival, priority=priority, cache_salt=cache_salt, tenant=tenant,
                lora_request=lora_request, mm_inputs=call.mm_inputs, background=call.background,
            ):
                if self.metrics is not None:
                    self.metrics.add_request(req.request_id, arrival, len(prompt_token_ids),
                                             tenant=tenant, priority=priority, sampling_params=sampling_params,
                                             trace_headers=call.trace_headers)  # fmt: skip
                await self._send(req)
            lora_counts = None
            if lora_request is not None:
                lora_counts = self.lora_token_counts.setdefault(lora_request.lora_name, [0, 0])
                lora_counts[0] += len(prompt_token_ids)
            num_generated = 0
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                if lora_counts is not None:
                    n = sum(len(c.token_ids) for c in item.outputs)
                    lora_counts[1] += n - num_generated
                    num_generated = n
                finished = item.finished
                yield item
                if finished:
                    break
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    def _open_queue(self, request_id: str) -> asyncio.Queue:
        """A new request's output queue, registered; raises when the engine is dead or the id is taken."""
        self._check_alive()
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        self._ensure_tasks()
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    async def _embed(self, call: GenerateCall) -> AsyncIterator[EmbeddingRequestOutput]:
        """An embedding request: one core request, one output (its vector) when the prompt is done."""
        request_id = call.request_id
        queue = self._open_queue(request_id)
        finished = False
        try:
            arrival = time.monotonic()
            self._pooling[request_id] = list(call.prompt_token_ids)
            if self.metrics is not None:
                self.metrics.add_request(request_id, arrival, len(call.prompt_token_ids), tenant=call.tenant,
                                         priority=call.priority, trace_headers=call.trace_headers)
            await self._send(EngineCoreRequest(
                request_id=request_id, prompt_token_ids=call.prompt_token_ids,
                sampling_params=placeholder_sampling_params(), arrival_time=arrival, priority=call.priority,
                cache_salt=call.cache_salt, tenant=call.tenant, lora_request=call.lora_request,
                pooling_params=call.pooling_params, background=call.background,
            ))  # fmt: skip
            item = await queue.get()
            finished = True
            if isinstance(item, Exception):
                raise item
            yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        if self._pooling.pop(request_id, None) is not None:
            if self.metrics is not None:
                self.metrics.on_abort([request_id], time.monotonic())
            if self._dead is None:
                await self._send(Abort([request_id]))
            return
        children = self.processor.child_ids(request_id)
        self.processor.abort_request(request_id)
        if self.metrics is not None:
            self.metrics.on_abort(children, time.monotonic())
        if children and self._dead is None:
            await self._send(Abort(children))

    # ---- LoRA adapters ---------------------------------------------------------------------

    async def add_lora(self, lora_name: str, lora_path: str) -> LoRARequest:
        if not self.config.enable_lora:
            raise ValueError("LoRA is not enabled; start the server with --enable-lora")
        if lora_name in self.lora_requests or lora_name in self._lora_busy:
            raise LoRAExistsError(f"The LoRA adapter {lora_name!r} has already been loaded.")
        request = LoRARequest(lora_name, self._next_lora_id, lora_path)
        self._next_lora_id += 1
        self._lora_busy.add(lora_name)
        try:
            result: LoraResult = await self._call(lambda token: AddLora(token, request), 60.0)
        finally:
            self._lora_busy.discard(lora_name)
        if result.error_type is not None:
            raise LoRAAdapterError(result.message)
        self.lora_requests[lora_name] = request
        return request

    async def remove_lora(self, lora_name: str) -> None:
        request = self.lora_requests.pop(lora_name, None)
        if request is None:
            raise LoRANotFoundError(f"The LoRA adapter {lora_name!r} is not loaded.")
        # Out of the name map while the engine decides, so that no new request picks it.
        self._lora_busy.add(lora_name)
        try:
            result: LoraResult = await self._call(lambda token: RemoveLora(token, request.lora_int_id), 60.0)
        except BaseException:
            self.lora_requests[lora_name] = request
            raise
        finally:
            self._lora_busy.discard(lora_name)
        if result.error_type is not None:
            self.lora_requests[lora_name] = request
            raise (LoRAInUseError if result.error_type == "LoRAInUseError" else ValueError)(result.message)

    # ---- request/reply calls ---------------------------------------------------------------

    async def _call(self, make: Callable[[str], ToCore], timeout: float) -> Any:
        """Send the message ``make(token)`` and await the core's answer, which ``_receive``
        resolves by the same token."""
        self._check_alive()
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        self._ensure_tasks()
        token = uuid.uuid4().hex
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[token] = fut
        try:
            await self._send(make(token))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(token, None)

    async def check_integrity(self, timeout: float = 10.0) -> dict[str, Any]:
        result: IntegrityResult = await self._call(CheckIntegrity, timeout)
        return {"ok": result.error is None, "error": result.error, "engine_pid": result.engine_pid}

    # ---- health and stats ------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        if self._dead is not None:
            return False
        busy = bool(self._queues)
        return not busy or time.monotonic() - self._last_output < self.stall_timeout

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def latest_stats(self) -> SchedulerStats:
        return self._stats
