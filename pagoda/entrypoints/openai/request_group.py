"""Running the engine requests behind one HTTP request, and the server-wide admission state.

One HTTP request becomes one engine request per prompt (a completions request may
carry several). ``RequestGroup`` runs each engine output stream in a pump task that
feeds one queue, so the handler reads "the next output of any prompt" with a single
await. A request can end early three ways: the client disconnects, the server shuts
down, or the request timeout passes. Each cancels the pumps at once; the cancellation
is thrown into the engine iterators, which is what makes the engine abort the requests
and free their KV blocks now rather than whenever the garbage collector gets to them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Literal

from starlette.requests import Request

from pagoda.engine.beam_search import BeamSearchParams, run_beam_search
from pagoda.multimodal.inputs import ImageInput
from pagoda.engine.client import EngineClient, EngineDeadError, EngineOverloadedError, GenerateCall, KVTransferError
from pagoda.entrypoints.openai.errors import APIError, bad_request, service_unavailable, too_many_requests
from pagoda.lora.request import LoRARequest
from pagoda.metrics.tracing import trace_headers
from pagoda.outputs import RequestOutput
from pagoda.pooling import PoolingParams
from pagoda.sampling_params import SamplingParams
from pagoda.tenants import TenantSpec

logger = logging.getLogger(__name__)

StopReason = Literal["disconnect", "shutdown", "timeout"]


class ServerState:
    """What all requests share: the draining flag and the bound on requests not yet started."""

    def __init__(self, max_num_queued_requests: int | None = None,
                 tenants: dict[str, TenantSpec] | None = None) -> None:  # fmt: skip
        self.max_num_queued_requests = max_num_queued_requests
        # Per-tenant bounds (max_queued) from the API keys file.
        self.tenants = tenants or {}
        self.num_waiting_by_tenant: dict[str, int] = {}
        self.draining = False
        self.num_active_http = 0  # kept by the middleware; shutdown waits for it to reach 0
        # Requests admitted whose first output has not arrived: queued or prefilling in the engine.
        self.num_waiting = 0
        self.groups: set[RequestGroup] = set()

    def admit(self, count: int, tenant: str | None = None) -> None:
        # No draining check here: the middleware turns away requests that arrive during a
        # drain; one that got past it before is in flight, and the drain waits for it.
        limit = self.max_num_queued_requests
        if limit is None:
            pass
        elif count > limit:
            raise bad_request(f"The request has {count} prompts; at most {limit} can be queued.", param="prompt")
        elif self.num_waiting + count > limit:
            raise too_many_requests(
                f"Too many requests are waiting to start ({self.num_waiting}, limit {limit}); retry later.",
                retry_after=1.0,
            )
        spec = self.tenants.get(tenant) if tenant is not None else None
        if spec is not None and spec.max_queued is not None:
            queued = self.num_waiting_by_tenant.get(spec.name, 0)
            if count > spec.max_queued:
                raise bad_request(f"The request has {count} prompts; at most {spec.max_queued} can be queued "
                                  f"for tenant {spec.name!r}.", param="prompt")  # fmt: skip
            if queued + count > spec.max_queued:
                raise too_many_requests(
                    f"Too many requests of tenant {spec.name!r} are waiting to start ({queued}, limit "
                    f"{spec.max_queued}); retry later.", retry_after=1.0,
                )  # fmt: skip
        self.num_waiting += count
        if tenant is not None:
            self.num_waiting_by_tenant[tenant] = self.num_waiting_by_tenant.get(tenant, 0) + count

    def release(self, tenant: str | None = None) -> None:
        """One admitted request got its first output (or ended)."""
        self.num_waiting -= 1
        if tenant is not None:
            left = self.num_waiting_by_tenant.get(tenant, 0) - 1
            if left > 0:
                self.num_waiting_by_tenant[tenant] = left
            else:
                self.num_waiting_by_tenant.pop(tenant, None)

    def stop_all(self, reason: StopReason) -> None:
        for group in list(self.groups):
            group.stop(reason)


@dataclass
class SubRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None = None
    beam: BeamSearchParams | None = None    # run as a beam search (pagoda/engine/beam_search.py)
    pooling_params: PoolingParams | None = None   # an embedding (params: a placeholder)
    mm_inputs: Sequence[ImageInput] = ()          # its images, processed (pagoda/multimodal)


class RequestStopped(Exception):
    """The request ended early for ``reason``; nothing more will come from the engine."""

    def __init__(self, reason: StopReason, timeout: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.timeout = timeout

    def to_api_error(self) -> APIError | None:
        """The error to report, or None when the client is gone and nobody is listening."""
        if self.reason == "timeout":
            return APIError(
                504, f"The request timed out after {self.timeout:g} s and was aborted.",
                type="timeout_error", code="request_timeout",
            )  # fmt: skip
        if self.reason == "shutdown":
            return service_unavailable("The server is shutting down; the request was aborted.", "server_shutting_down")
        return None


def map_engine_error(exc: BaseException) -> BaseException:
    """Engine exceptions -> the HTTP errors they mean; anything else is a bug (500)."""
    if isinstance(exc, EngineOverloadedError):
        return too_many_requests(str(exc) or "The engine queue is full; retry later.", exc.retry_after)
    if isinstance(exc, EngineDeadError):
        return service_unavailable(f"The engine is not running: {exc}", "engine_dead")
    if isinstance(exc, KVTransferError):
        return service_unavailable(str(exc), "kv_transfer_failed")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    return exc


class RequestGroup:
    def __init__(
        self,
        engine: EngineClient,
        state: ServerState,
        subrequests: list[SubRequest],
        raw_request: Request | None = None,
        timeout: float | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        background: bool = False,
    ) -> None:
        self.priority = priority
        self.background = background
        self.cache_salt = cache_salt
        self.tenant = tenant
        self.engine = engine
        self.state = state
        self.subrequests = subrequests
        self.raw_request = raw_request
        self.timeout = timeout
        self.last: list[RequestOutput | None] = [None] * len(subrequests)
        # One pump task per subrequest moves its engine outputs into this queue, so waiting
        # for "the next output of any subrequest" is a single queue read, and stopping is
        # cancelling the pumps (which throws into each engine iterator, aborting it).
        self._queue: asyncio.Queue[tuple[str, int, Any]] = asyncio.Queue()
        self._pumps: list[asyncio.Task[None]] = []
        self._live = 0  # subrequests whose end has not been read from the queue
        self._waiting: set[int] = set()  # indices still holding an admission slot
        self._seen: set[int] = set()  # indices that have produced something
        self._stop_reason: StopReason | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._started = False
        self._closed = False

    # ---- lifetime ------------------------------------------------------------------
    def start(self) -> None:
        """Admit and submit every subrequest (raises APIError 429/503 when it cannot be admitted).
        Background requests (a batch's lines) are not counted against --max-num-queued-requests:
        they wait in the engine without keeping live requests out."""
        if not self.background:
            self.state.admit(len(self.subrequests), self.tenant)
            self._waiting = set(range(len(self.subrequests)))
        self._started = True
        self._live = len(self.subrequests)
        loop = asyncio.get_running_loop()
        self.state.groups.add(self)
        # A W3C traceparent header makes the requests' spans children of the caller's (--otlp-traces-endpoint).
        traced = trace_headers(self.raw_request.headers) if self.raw_request is not None else None
        for i, sub in enumerate(self.subrequests):
            # OpenAIServing.prepare had the engine check each prompt: run it as it is.
            call = GenerateCall(sub.request_id, sub.prompt, sub.prompt_token_ids, sub.params, self.priority,
                                self.cache_salt, self.tenant, sub.lora_request, sub.pooling_params, sub.mm_inputs,
                                self.background, trace_headers=traced)
            stream = (self.engine.run_request(call) if sub.beam is None else
                      run_beam_search(self.engine, call, sub.beam, self.engine.tokenizer.eos_token_ids))
            self._pumps.append(loop.create_task(self._pump(i, stream)))
        if self.raw_request is not None:
            self._watcher = loop.create_task(self._watch_disconnect(self.raw_request))
        if self.timeout is not None:
            self._timer = loop.call_later(self.timeout, self.stop, "timeout")

    async def close(self) -> None:
        """Idempotent: stop watching, give back admission slots, end every engine request."""
        if self._closed:
            return
        self._closed = True
        self.state.groups.discard(self)
        for index in list(self._waiting):
            self._release(index)
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
        running = [t for t in self._pumps if not t.done()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)

    async def __aenter__(self) -> RequestGroup:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def stop(self, reason: StopReason) -> None:
        """End the request early: abort the engine requests now and make next() raise RequestStopped."""
        if self._stop_reason is not None or not self._started or self._closed:
            return
        self._stop_reason = reason
        for task in self._pumps:
            task.cancel()
        self._queue.put_nowait(("stop", -1, None))  # wakes a reader blocked in next()

    async def _pump(self, index: int, gen: Any) -> None:
        try:
            # Iterating to the end (not stopping at the finished output) lets the engine's
            # iterator finish normally rather than be closed at its last yield.
            async for output in gen:
                self._release(index)
                self._queue.put_nowait(("output", index, output))
            self._queue.put_nowait(("end", index, None))
        except asyncio.CancelledError:
            # stop() or close(): the CancelledError went through the engine iterator, aborting it.
            raise
        except Exception as exc:
            self._queue.put_nowait(("error", index, exc))
        finally:
            self._release(index)

    async def _watch_disconnect(self, request: Request) -> None:
        # The body has been read, so the next ASGI message can only be the disconnect.
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.stop("disconnect")
                return

    def _release(self, index: int) -> None:
        if index in self._waiting:
            self._waiting.discard(index)
            self.state.release(self.tenant)

    # ---- outputs -------------------------------------------------------------------
    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next output of any subrequest as (index, output); None when all have ended.
        Raises RequestStopped, or APIError for an engine error."""
        assert self._started, "start() first"
        while True:
            if self._stop_reason is not None:
                raise RequestStopped(self._stop_reason, self.timeout)
            if self._live == 0:
                return None
            kind, index, payload = await self._queue.get()
            if kind == "stop":
                continue
            self._seen.add(index)
            if kind == "end":
                self._live -= 1
                continue
            if kind == "error":
                self._live -= 1
                mapped = map_engine_error(payload)
                if mapped is payload:
                    raise payload
                raise mapped from payload
            self.last[index] = payload
            return index, payload

    async def first_outputs(self) -> list[tuple[int, RequestOutput]]:
        """Wait until every subrequest has produced an output (or ended). A streaming response
        waits for this before sending its 200 headers, so that errors the engine reports up front
        (context too long, queue full, engine dead) still get their own status code."""
        outputs = []
        while len(self._seen) < len(self.subrequests) and (item := await self.next()) is not None:
            outputs.append(item)
        return outputs

    async def final_outputs(self) -> list[RequestOutput | None]:
        """Run every subrequest to the end; the last output of each (None if it produced none)."""
        while await self.next() is not None:
            pass
        return self.last
