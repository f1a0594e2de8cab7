"""AsyncLLM: the asyncio front end of the engine, used by the HTTP server.

The engine core (scheduler + model runner) runs its busy loop in its own
process and talks to this object over ZMQ, so neither GIL stalls the other.
This side (EngineFrontEnd, pagoda/engine/frontend.py) tokenizes, detokenizes and
tracks each request's stream; here a background task reads the core's messages
(pagoda/engine/messages.py) and hands them to it. ``multiprocess=False`` runs the
same loop in a thread (inproc ZMQ), for tests and tools.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from pagoda.config import EngineConfig
from pagoda.core.outputs import SchedulerStats
from pagoda.engine.client import EngineDeadError, EngineOverloadedError, LoRAExistsError, LoRANotFoundError
from pagoda.engine.core_proc import CoreProcess, run_engine_core, start_core_process
from pagoda.engine.frontend import EngineFrontEnd
from pagoda.engine.messages import Dead, EngineCoreRequest, MessageError, Ready, Shutdown, ToCore, decode, encode
from pagoda.metrics.log import StatLogger, log_request
from pagoda.metrics.stats import EngineMetrics, RequestTrace
from pagoda.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pagoda.metrics.tracing import RequestTracer

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError", "LoRAExistsError", "LoRANotFoundError"]

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
# Busy with no output for this long = stalled (one CPU step is well under it).
STALL_TIMEOUT_S = 60.0
# How long shutdown waits to hand the core its Shutdown message (a gone core never takes it).
_SHUTDOWN_SEND_S = 5.0


def _tokenizer_for(config: EngineConfig) -> Tokenizer:
    from pagoda.tokenizer import load_tokenizer

    return load_tokenizer(config)


def _on_request_end(log_requests: bool, tracer: RequestTracer | None) -> Callable[[RequestTrace], None] | None:
    """What runs as each request ends: its log line, its span, both or neither."""
    if tracer is None:
        return log_request if log_requests else None
    if not log_requests:
        return tracer.record

    def log_and_trace(trace: RequestTrace) -> None:
        log_request(trace)
        tracer.record(trace)

    return log_and_trace


class AsyncLLM(EngineFrontEnd):
    ep_link: Any = None   # see __init__

    def __init__(
        self,
        config: EngineConfig,
        multiprocess: bool = True,
        *,
        log_stats: bool = True,
        log_stats_interval: float = 10.0,
        log_requests: bool = True,
        tracer: RequestTracer | None = None,
        stall_timeout: float = STALL_TIMEOUT_S,
        core: CoreProcess | None = None,
    ) -> None:
        """``log_stats``: log a throughput / queue / KV line every ``log_stats_interval``
        seconds while busy. ``log_requests``: log one line per finished request.
        ``tracer``: make an OpenTelemetry span of each finished request (--otlp-traces-endpoint,
        pagoda/metrics/tracing.py; the caller shuts it down, after the engine).
        ``stall_timeout``: busy with no engine output for this long = unhealthy.
        ``core``: an engine-core process already started for ``config``
        (``start_core_process``); by default one is started here."""
        self.stall_timeout = stall_timeout
        if log_stats and not log_stats_interval > 0:
            raise ValueError(f"log_stats_interval must be > 0, got {log_stats_interval}")
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
            tokenizer = _tokenizer_for(config)
        except BaseException:
            if self._proc is not None:
                self._proc.kill()
                self._proc.join(10)
            self._cleanup()
            raise
        self.info: Ready = self._wait_ready()
        metrics = EngineMetrics(
            self.info.max_model_len, config.max_num_seqs, config.max_num_batched_tokens,
            on_request_end=_on_request_end(log_requests, tracer),
        )  # fmt: skip
        super().__init__(
            config, tokenizer, self.info.max_model_len, self.info.vocab_size, metrics,
            # Until the first heartbeat: an idle engine with an empty pool.
            stats=SchedulerStats(num_blocks=self.info.num_blocks, num_free_blocks=self.info.num_blocks),
            stat_logger=StatLogger(metrics, log_stats_interval) if log_stats else None,
            pooler_config=self.info.pooler,
        )  # fmt: skip
        self._output_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        # A replica of an expert-parallel group (set by DataParallelLLM, pagoda/engine/dp_client.py):
        # its requests are numbered and announced to the other replicas; one replica's death is all's.
        self.ep_link: Any = None

    @classmethod
    def from_config(cls, config: EngineConfig, multiprocess: bool = True, **kwargs: Any) -> AsyncLLM:
        return cls(config, multiprocess, **kwargs)

    def _wait_ready(self) -> Ready:
        # Read the first frame synchronously through a shadow of the bound socket.
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        raw = zmq.Socket.shadow(self._output.underlying)
        poller = zmq.Poller()
        poller.register(raw, zmq.POLLIN)
        while time.monotonic() < deadline:
            if poller.poll(200):
                try:
                    msg = decode(raw.recv())
                except MessageError as e:
                    self._cleanup()
                    raise RuntimeError(f"engine core failed to start: {e}") from None
                if isinstance(msg, Ready):
                    return msg
                if isinstance(msg, Dead):
                    self._cleanup()
                    raise RuntimeError(f"engine core failed to start:\n{msg.reason}")
            if self._proc is not None and not self._proc.is_alive():
                self._cleanup()
                raise RuntimeError(f"engine core process exited with code {self._proc.exitcode} during startup")
        self._cleanup()
        raise RuntimeError("engine core did not start in time")

    # ---- the link to the core --------------------------------------------------------------

    def _ensure_tasks(self) -> None:
        if self._output_task is None:
            self._output_task = asyncio.get_running_loop().create_task(self._read_outputs())
            self._watch_task = asyncio.get_running_loop().create_task(self._watch_process())

    async def _read_outputs(self) -> None:
        while self._dead is None:
            frame = await self._output.recv()
            try:
                msg = decode(frame)
            except MessageError as e:
                self._die(f"the engine core sent a frame that is not an engine message: {e}")
                return
            await self._receive(msg)

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

    async def _send(self, msg: ToCore) -> None:
        if self.ep_link is not None and isinstance(msg, EngineCoreRequest):
            await self.ep_link.send_request(self, msg)   # numbered, and the group's other replicas woken
        else:
            await self._input.send(encode(msg))

    def _die(self, reason: str) -> None:
        first = self._dead is None
        super()._die(reason)
        if first and self.ep_link is not None:
            self.ep_link.member_died(self, reason)

    # ---- health and lifetime ---------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        if self._proc is not None and not self._proc.is_alive():
            return False
        return super().is_healthy

    async def shutdown(self) -> None:
        self._check_alive()  # the watcher only runs once a request started
        if self._dead is None:
            # Bounded: a core that is gone or hung must not hold the shutdown (a send to
            # a socket with no peer waits forever); _join then stops the process.
            try:
                await asyncio.wait_for(self._send(Shutdown()), _SHUTDOWN_SEND_S)
            except (zmq.ZMQError, asyncio.TimeoutError):
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
