"""AsyncLLM: the asyncio front end of the engine, used by the HTTP server.

The engine core (scheduler + model runner) runs its busy loop in its own
process and talks to this object over ZMQ, so neither GIL stalls the other.
This side tokenizes, detokenizes and tracks each request's stream; a
background task reads the core's outputs and fans them out to per-request
queues. ``multiprocess=False`` runs the same loop in a thread (inproc ZMQ),
for tests and tools.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import threading
import time
import uuid
from typing import Any, AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from pagoda.config import EngineConfig, check_priority
from pagoda.core.outputs import SchedulerStats
from pagoda.engine.core_proc import CoreProcess, EngineInfo, run_engine_core, start_core_process
from pagoda.engine.output_processor import OutputProcessor, make_core_requests
from pagoda.engine.protocol import EngineCoreOutputs
from pagoda.lora.errors import LoRAAdapterError, LoRAInUseError
from pagoda.lora.request import LoRARequest
from pagoda.metrics.log import StatLogger, log_request
from pagoda.metrics.stats import EngineMetrics
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
# Busy with no output for this long = stalled (one CPU step is well under it).
STALL_TIMEOUT_S = 60.0

_dec_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs)


class EngineDeadError(RuntimeError):
    """The engine-core process died or stopped making progress."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (--max-num-queued-requests); retry later."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class LoRANotFoundError(ValueError):
    """No adapter of that name is loaded."""


class LoRAExistsError(ValueError):
    """An adapter of that name is loaded already."""


def _tokenizer_for(config: EngineConfig) -> Tokenizer:
    from pagoda.tokenizer import load_tokenizer

    return load_tokenizer(config)


def _snapshot(out: RequestOutput) -> RequestOutput:
    """Copy what later steps mutate in place, so a slow consumer sees this step."""
    return dataclasses.replace(out, outputs=[
        dataclasses.replace(
            c, token_ids=list(c.token_ids),
            logprobs=list(c.logprobs) if c.logprobs is not None else None,
        )
        for c in out.outputs
    ])


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        multiprocess: bool = True,
        *,
        log_stats: bool = True,
        log_stats_interval: float = 10.0,
        log_requests: bool = True,
        stall_timeout: float = STALL_TIMEOUT_S,
        core: CoreProcess | None = None,
    ) -> None:
        """``log_stats``: log a throughput / queue / KV line every ``log_stats_interval``
        seconds while busy. ``log_requests``: log one line per finished request.
        ``stall_timeout``: busy with no engine output for this long = unhealthy.
        ``core``: an engine-core process already started for ``config``
        (``start_core_process``); by default one is started here."""
        self.stall_timeout = stall_timeout
        if log_stats and not log_stats_interval > 0:
            raise ValueError(f"log_stats_interval must be > 0, got {log_stats_interval}")
        self.config = config
        self._queues: dict[str, asyncio.Queue] = {}
        self._validator = None
        self._stats = SchedulerStats()
        # Filled in once the engine reports its limits (below); read by /metrics and /dashboard.
        self.metrics: EngineMetrics
        self._stat_logger: StatLogger | None = None
        self._dead: str | None = None
        self._last_output = time.monotonic()
        self._ctx = zmq.asyncio.Context()
        self._tmpdir = None
        if core is not None and not multiprocess:
            raise ValueError("an engine-core process was given to an in-process AsyncLLM")
        if multiprocess:
            core = core or start_core_process(config)
            self._tmpdir, in_addr, out_addr = core.tmpdir, core.input_addr, core.output_addr
        else:
            tag = uuid.uuid4().hex
            in_addr, out_addr = f"inproc://in-{tag}", f"inproc://out-{tag}"
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(in_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(out_addr)
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._thread: threading.Thread | None = None
        if core is not None:  # it connects to the addresses bound above (zmq retries until then)
            self._proc = core.proc
        else:
            sync_ctx = zmq.Context.shadow(self._ctx.underlying)
            self._thread = threading.Thread(
                target=run_engine_core, args=(config, in_addr, out_addr, sync_ctx),
                name="pagoda-engine-core", daemon=True,
            )
            self._thread.start()
        # The tokenizer is built while the engine core starts (imports, weights).
        try:
            self.tokenizer: Tokenizer = _tokenizer_for(config)
        except BaseException:
            if self._proc is not None:
                self._proc.kill()
                self._proc.join(10)
            self._cleanup()
            raise
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.processor = OutputProcessor(self.tokenizer)
        self.info = self._wait_ready()
        self.max_model_len = self.info.max_model_len
        self.vocab_size = self.info.vocab_size
        # Until the first heartbeat: an idle engine with an empty pool.
        self._stats = SchedulerStats(num_blocks=self.info.num_blocks, num_free_blocks=self.info.num_blocks)
        self.metrics = EngineMetrics(
            self.max_model_len, config.max_num_seqs, config.max_num_batched_tokens,
            on_request_end=log_request if log_requests else None,
        )  # fmt: skip
        self.metrics.stats = self._stats
        if log_stats:
            self._stat_logger = StatLogger(self.metrics, log_stats_interval)
        self._integrity_checks: dict[str, asyncio.Future] = {}
        # LoRA adapters by name. Ids are never reused, so prefix-cache keys of an
        # unloaded adapter can never match a later one loaded under the same name.
        self.lora_requests: dict[str, LoRARequest] = {}
        self._lora_busy: set[str] = set()     # names being loaded or unloaded
        self._next_lora_id = 1
        self._lora_calls: dict[str, asyncio.Future] = {}
        # Adapter name -> [prompt tokens, generated tokens], for /metrics.
        self.lora_token_counts: dict[str, list[int]] = {}
        self._output_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, multiprocess: bool = True, **kwargs: Any) -> AsyncLLM:
        return cls(config, multiprocess, **kwargs)

    def _wait_ready(self) -> EngineInfo:
        # Read the first frame synchronously through a shadow of the bound socket.
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        raw = zmq.Socket.shadow(self._output.underlying)
        poller = zmq.Poller()
        poller.register(raw, zmq.POLLIN)
        while time.monotonic() < deadline:
            if poller.poll(200):
                kind, payload = raw.recv_multipart()
                if kind == b"ready":
                    return msgspec.msgpack.decode(payload, type=EngineInfo)
                if kind == b"dead":
                    self._cleanup()
                    raise RuntimeError(f"engine core failed to start:\n{msgspec.msgpack.decode(payload)}")
            if self._proc is not None and not self._proc.is_alive():
                self._cleanup()
                raise RuntimeError(f"engine core process exited with code {self._proc.exitcode} during startup")
        self._cleanup()
        raise RuntimeError("engine core did not start in time")

    # ---- background tasks ----------------------------------------------------------

    def ensure_background_tasks(self) -> None:
        """Start reading the engine's messages (call on the serving loop). Done by the
        first request anyway; /metrics and the dashboard call it so that they show the
        engine's state before any request."""
        if self._dead is None:
            self._ensure_tasks()

    def _ensure_tasks(self) -> None:
        if self._output_task is None:
            self._output_task = asyncio.get_running_loop().create_task(self._read_outputs())
            self._watch_task = asyncio.get_running_loop().create_task(self._watch_process())

    async def _read_outputs(self) -> None:
        while True:
            kind, payload = await self._output.recv_multipart()
            self._last_output = time.monotonic()
            if kind in (b"outputs", b"heartbeat"):
                msg = _dec_outputs.decode(payload)
                now = self._last_output
                if msg.scheduler_stats is not None:
                    self._stats = msg.scheduler_stats
                self.metrics.on_engine_outputs(msg, now)
                if msg.outputs:
                    outputs, to_stop = self.processor.process_outputs(msg.outputs)
                    self.metrics.on_request_outputs(outputs, now)
                    if to_stop:
                        await self._send(b"stop", to_stop)
                    for out in outputs:
                        q = self._queues.get(out.request_id)
                        if q is not None:
                            q.put_nowait(_snapshot(out))
                if self._stat_logger is not None:
                    self._stat_logger.maybe_log(now)
            elif kind == b"error":
                child_id, message = msgspec.msgpack.decode(payload)
                parent = self.processor.parent_id(child_id)
                if parent is not None:
                    await self.abort(parent)
                    q = self._queues.get(parent)
                    if q is not None:
                        q.put_nowait(ValueError(message))
            elif kind == b"integrity":
                token, error, pid = msgspec.msgpack.decode(payload)
                fut = self._integrity_checks.pop(token, None)
                if fut is not None and not fut.done():
                    fut.set_result({"ok": error is None, "error": error, "engine_pid": pid})
            elif kind == b"lora_result":
                token, error_type, message = msgspec.msgpack.decode(payload)
                fut = self._lora_calls.pop(token, None)
                if fut is not None and not fut.done():
                    fut.set_result((error_type, message))
            elif kind == b"dead":
                self._die(f"engine core failed: {msgspec.msgpack.decode(payload)}")
                return

    async def _watch_process(self) -> None:
        while self._dead is None:
            await asyncio.sleep(0.2)
            self._check_alive()

    def _check_alive(self) -> None:
        # The watcher task only runs once a request started; check directly too.
        if self._proc is not None and not self._proc.is_alive():
            self._die(f"engine core process exited with code {self._proc.exitcode}")
        elif self._thread is not None and not self._thread.is_alive():
            self._die("engine core thread exited")

    def _die(self, reason: str) -> None:
        if self._dead is not None:
            return
        logger.error("%s", reason)
        self._dead = reason
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(reason))
        for fut in self._lora_calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))

    async def _send(self, kind: bytes, obj: object) -> None:
        await self._input.send_multipart([kind, msgspec.msgpack.encode(obj)])

    # ---- public API ----------------------------------------------------------------

    def _grammar_validator(self):
        """A grammar manager of the API process, used only to validate (and
        so reject bad schemas with a 400 before they reach the engine)."""
        if self._validator is None:
            from pagoda.structured_output.backend import LLGuidanceBackend
            from pagoda.structured_output.manager import StructuredOutputManager

            tok = self.tokenizer
            self._validator = StructuredOutputManager(
                lambda: LLGuidanceBackend(tok.backend.to_str(), self.vocab_size, tok.eos_token_ids))
        return self._validator

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (GrammarError for a bad schema/regex/grammar) for a
        request the engine would reject."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if params.structured_outputs is not None:
            self._grammar_validator().validate(params.structured_outputs)
        params.validate_for_vocab(self.vocab_size)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, "
                f"but the prompt has {n} tokens"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt ({n}) plus max_tokens ({params.max_tokens}) exceeds it"
            )

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._queues)

    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        self.validate_request(prompt_token_ids, sampling_params)
        check_priority(self.config, priority)
        if lora_request is not None and not self.config.enable_lora:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is not enabled (--enable-lora)")
        self._check_alive()
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        self._ensure_tasks()
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            self.processor.add_request(request_id, prompt, prompt_token_ids, sampling_params)
            arrival = time.monotonic()
            for req in make_core_requests(
                request_id, prompt_token_ids, sampling_params, self.eos_token_ids,
                arrival_time=arrival, priority=priority, cache_salt=cache_salt, tenant=tenant,
                lora_request=lora_request,
            ):
                self.metrics.add_request(req.request_id, arrival, len(prompt_token_ids),
                                         tenant=tenant, priority=priority)
                await self._send(b"add", req)
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

    async def abort(self, request_id: str) -> None:
        children = self.processor.child_ids(request_id)
        self.processor.abort_request(request_id)
        self.metrics.on_abort(children, time.monotonic())
        if children and self._dead is None:
            await self._send(b"abort", children)

    # ---- LoRA adapters -------------------------------------------------------------

    async def add_lora(self, lora_name: str, lora_path: str) -> LoRARequest:
        """Load an adapter in the engine under ``lora_name`` (LoRAAdapterError if it is bad)."""
        if not self.config.enable_lora:
            raise ValueError("LoRA is not enabled; start the server with --enable-lora")
        if lora_name in self.lora_requests or lora_name in self._lora_busy:
            raise LoRAExistsError(f"The LoRA adapter {lora_name!r} has already been loaded.")
        request = LoRARequest(lora_name, self._next_lora_id, lora_path)
        self._next_lora_id += 1
        self._lora_busy.add(lora_name)
        try:
            error_type, message = await self._lora_call(["add", lora_name, request.lora_int_id, lora_path])
        finally:
            self._lora_busy.discard(lora_name)
        if error_type is not None:
            raise LoRAAdapterError(message)
        self.lora_requests[lora_name] = request
        return request

    async def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter; LoRAInUseError while a request uses it (it stays loaded)."""
        request = self.lora_requests.pop(lora_name, None)
        if request is None:
            raise LoRANotFoundError(f"The LoRA adapter {lora_name!r} is not loaded.")
        # Out of the name map while the engine decides, so that no new request picks it.
        self._lora_busy.add(lora_name)
        try:
            error_type, message = await self._lora_call(["remove", request.lora_int_id])
        except BaseException:
            self.lora_requests[lora_name] = request
            raise
        finally:
            self._lora_busy.discard(lora_name)
        if error_type is not None:
            self.lora_requests[lora_name] = request
            raise (LoRAInUseError if error_type == "LoRAInUseError" else ValueError)(message)

    async def _call_engine(self, kind: bytes, pending: dict[str, asyncio.Future], payload: list,
                           timeout: float) -> Any:
        """Send one request/reply message to the engine core and await its answer, which
        the output reader resolves through ``pending`` (keyed by a fresh token)."""
        self._check_alive()
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        self._ensure_tasks()
        token = uuid.uuid4().hex
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        pending[token] = fut
        try:
            await self._send(kind, token if not payload else [token, *payload])
            return await asyncio.wait_for(fut, timeout)
        finally:
            pending.pop(token, None)

    async def _lora_call(self, call: list, timeout: float = 60.0) -> tuple[str | None, str | None]:
        return await self._call_engine(b"lora", self._lora_calls, call, timeout)

    async def check_integrity(self, timeout: float = 10.0) -> dict[str, Any]:
        """Debug: have the engine core run check_integrity() (block pool, KV cache
        manager, scheduler) between steps. Returns {"ok", "error", "engine_pid"}."""
        return await self._call_engine(b"check", self._integrity_checks, [], timeout)

    @property
    def is_healthy(self) -> bool:
        if self._dead is not None:
            return False
        if self._proc is not None and not self._proc.is_alive():
            return False
        busy = bool(self._queues)
        return not busy or time.monotonic() - self._last_output < self.stall_timeout

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def latest_stats(self) -> SchedulerStats:
        return self._stats

    async def shutdown(self) -> None:
        if self._dead is None:
            try:
                await self._send(b"shutdown", None)
            except zmq.ZMQError:
                pass
        for task in (self._output_task, self._watch_task):
            if task is not None:
                task.cancel()
        self._dead = self._dead or "engine shut down"
        await asyncio.get_running_loop().run_in_executor(None, self._join)
        self._cleanup()

    def _join(self) -> None:
        if self._proc is not None:
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
        if self._thread is not None:
            self._thread.join(10)

    def _cleanup(self) -> None:
        self._input.close(linger=0)
        self._output.close(linger=0)
        if self._tmpdir is not None:
            for name in ("input", "output"):
                try:
                    os.unlink(os.path.join(self._tmpdir, name))
                except OSError:
                    pass
            try:
                os.rmdir(self._tmpdir)
            except OSError:
                pass
