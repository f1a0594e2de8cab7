"""What the chat and completions endpoints share: prompt checks, running the engine, streaming."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagoda.engine.beam_search import BeamSearchParams
from pagoda.engine.client import EngineClient
from pagoda.entrypoints.openai.errors import (
    APIError,
    bad_request,
    internal_error,
    model_not_found,
)
from pagoda.entrypoints.openai.logprobs import LogprobFormatter
from pagoda.entrypoints.openai.request_group import (
    RequestGroup,
    RequestStopped,
    ServerState,
    SubRequest,
)
from pagoda.entrypoints.openai.responses import SSE_DONE, PerRequestMetrics, Usage
from pagoda.hub.stores import NO_DEFAULTS, ModelDefaults
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import ImageInput
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output.backend import GrammarError
from pagoda.validation import InvalidRequestError


class EngineRequests(Protocol):
    """What the serving steps below run: a ``RequestGroup``, or a group that runs its
    request in phases (``thinking_budget.BudgetedGroup``)."""

    async def __aenter__(self) -> Any: ...
    async def __aexit__(self, *exc: object) -> None: ...
    def start(self) -> None: ...
    async def first_outputs(self) -> list[tuple[int, RequestOutput]]: ...
    async def final_outputs(self) -> list[RequestOutput | None]: ...
    async def close(self) -> None: ...

logger = logging.getLogger(__name__)

# Set by the server middleware: the tenant a request belongs to.
TENANT_SCOPE_KEY = "pagoda.tenant"
# Set on the requests the server makes to itself for a batch's lines (pagoda/entrypoints/openai/batch):
# they run in the background, yielding to live traffic (pagoda/core/scheduler.py).
BACKGROUND_SCOPE_KEY = "pagoda.background"

# Sent for a request whose client disconnected: nobody reads it (nginx's "client closed request").
CLIENT_GONE = 499


class ClientGone(Exception):
    """The client disconnected before the response; there is nobody to answer."""


def error_event(err: APIError) -> str:
    # The openai client raises APIError for a stream event with an "error" key.
    return f"data: {json.dumps(err.body())}\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always closes its event generator and request group.

    On disconnect Starlette cancels the task iterating the body, and that may happen
    between two chunks, leaving the generator suspended and the engine request running
    until garbage collection. Closing here makes the abort immediate and certain.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            await self._on_close()


class OpenAIServing:
    def __init__(
        self, engine: EngineClient, state: ServerState, served_model_name: str, request_timeout: float | None,
        model_defaults: ModelDefaults = NO_DEFAULTS,
        *, force_include_usage: bool = False, per_request_metrics: bool = False,
    ) -> None:
        """``model_defaults``: what the model brings (an Ollama model's sampling defaults and
        system prompt, pagoda/hub/stores.py), applied where a request sets nothing."""
        self.engine = engine
        self.model_defaults = model_defaults
        # --enable-force-include-usage: streams end with a usage chunk even without stream_options.
        self.force_include_usage = force_include_usage
        # --enable-per-request-metrics: responses carry vLLM's per-request ``metrics`` (request_metrics).
        self.per_request_metrics = per_request_metrics
        self.state = state
        self.served_model_name = served_model_name
        self.request_timeout = request_timeout
        self.tokenizer = engine.tokenizer
        self.logprobs = LogprobFormatter(engine.tokenizer)

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names, None for the base model; 404 for neither."""
        if model is None or model == self.served_model_name:
            return None
        lora = self.engine.lora_requests.get(model)
        if lora is None:
            raise model_not_found(model)
        return lora

    def truncate(self, prompt_token_ids: list[int], truncate_prompt_tokens: int | None,
                 truncation_side: str | None = None) -> list[int]:  # fmt: skip
        """vLLM's truncate_prompt_tokens: keep N tokens of the prompt (-1: max_model_len), the
        last N (``truncation_side`` "left", the default: the start is cut) or the first N
        ("right"); a value beyond max_model_len is a 400, as there."""
        if truncate_prompt_tokens is None:
            return prompt_token_ids
        max_len = self.engine.max_model_len
        keep = max_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if keep > max_len:
            raise bad_request(
                f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_len}). "
                "Please, select a smaller truncation size.", param="truncate_prompt_tokens", code="invalid_value",
            )  # fmt: skip
        return prompt_token_ids[:keep] if truncation_side == "right" else prompt_token_ids[-keep:]

    def response_model(self, model: str | None) -> str:
        """The ``model`` a response names: the adapter's name when one was asked for."""
        if model is not None and model in self.engine.lora_requests:
            return model
        return self.served_model_name

    def prepare(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        to_params: Callable[[int], SamplingParams],
        prompt_param: str,
        max_tokens_param: str,
        structured_param: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        beam: Callable[[int], BeamSearchParams] | None = None,
        logprobs_param: str = "logprobs",
        mm_inputs: Sequence[ImageInput] = (),
    ) -> SubRequest:
        """Build one prompt's SamplingParams and have the engine check the request
        (pagoda/validation.py); 400 on any problem. ``prompt_param`` / ``max_tokens_param``:
        the request fields that a context length error names; ``structured_param``: the
        field the structured output constraint came from, named by the 400 for a schema,
        regex or grammar the compiler rejects. ``beam``: max_tokens -> BeamSearchParams, for a
        request run as a beam search (its SamplingParams are checked as those of its beams).
        ``logprobs_param``: the field a logprobs limit error names (chat: top_logprobs)."""
        # Absent max_tokens: whatever room the context leaves, as vLLM does (at least one
        # token, so that a prompt with no room gets the engine's context length error).
        params = to_params(max(self.engine.max_model_len - len(prompt_token_ids), 1))
        transfer = params.kv_transfer_params
        if transfer is not None and transfer.prompt_token_ids is not None:
            # A decode instance given the prefill instance's prompt takes it as is (vLLM's
            # kv_transfer_params.prompt_token_ids): the KV it fetches was computed for those tokens.
            if mm_inputs:
                raise bad_request("kv_transfer_params.prompt_token_ids cannot be given with images: their spans "
                                  "are placed in the prompt this instance renders.", param="kv_transfer_params")
            prompt, prompt_token_ids = None, list(transfer.prompt_token_ids)
            params = to_params(max(self.engine.max_model_len - len(prompt_token_ids), 1))
        try:
            self.engine.validate_request(prompt_token_ids, params, priority, lora_request)
        except GrammarError as e:
            raise bad_request(str(e), param=structured_param, code="invalid_structured_output") from None
        except InvalidRequestError as e:
            # Its message names the problem (context length, token ids out of range, priority...).
            param = {"prompt": prompt_param, "max_tokens": max_tokens_param, "logprobs": logprobs_param}.get(
                e.param, e.param)
            message = str(e)
            if e.param and param != e.param and message.startswith(e.param + " "):
                message = param + message[len(e.param):]  # in the request's own words (chat's top_logprobs)
            raise bad_request(message, param=param, code=e.code) from None
        except ValueError as e:
            raise bad_request(str(e)) from None
        beam_params = beam(params.max_tokens or 1) if beam is not None else None
        if beam_params is not None and mm_inputs:
            raise bad_request("'use_beam_search' with images is not supported.", param="use_beam_search")
        return SubRequest(request_id, prompt, prompt_token_ids, params, lora_request, beam_params,
                          mm_inputs=mm_inputs)

    def group(self, raw_request: Request, subrequests: list[SubRequest], priority: int = 0,
              cache_salt: str | None = None) -> RequestGroup:  # fmt: skip
        """The engine requests of one HTTP request (checked by ``prepare``); the tenant comes
        from the middleware (the API key's tenant, or the X-Tenant header when there are no keys)."""
        return RequestGroup(self.engine, self.state, subrequests, raw_request, self.request_timeout,
                            priority=priority, cache_salt=cache_salt, tenant=raw_request.scope.get(TENANT_SCOPE_KEY),
                            background=bool(raw_request.scope.get(BACKGROUND_SCOPE_KEY)))  # fmt: skip

    # ---- running ---------------------------------------------------------------------
    @staticmethod
    async def run_to_end(group: EngineRequests) -> list[RequestOutput | None]:
        try:
            async with group:
                return await group.final_outputs()
        except RequestStopped as e:
            raise _stopped_error(e) from None

    @staticmethod
    async def start_stream(group: EngineRequests) -> list[tuple[int, RequestOutput]]:
        """Admit the group and wait for its first outputs; on failure it is closed and the error raised."""
        try:
            group.start()
            return await group.first_outputs()
        except RequestStopped as e:
            await group.close()
            raise _stopped_error(e) from None
        except BaseException:
            await group.close()
            raise

    @staticmethod
    def stream_response(group: EngineRequests, events: AsyncIterator[str],
                        on_error: Callable[[APIError], str] = error_event, done: str | None = SSE_DONE) -> SSEResponse:
        """``on_error``: the event(s) that report an error after the 200 went out; ``done``: the
        last event of a stream the client did not cut (None: none, as in the Responses API)."""
        return SSEResponse(_guarded(events, on_error, done), on_close=group.close)

    def request_metrics(self, outputs: Sequence[RequestOutput | None]) -> PerRequestMetrics | None:
        """vLLM's per-request ``metrics`` with --enable-per-request-metrics: only for a request
        that ran as one engine sequence (one prompt, n = 1, no best_of: RequestOutput.metrics
        is set only then), as vLLM, which reports none where the timings are not one stream's."""
        if not self.per_request_metrics or len(outputs) != 1 or outputs[0] is None or outputs[0].metrics is None:
            return None
        return PerRequestMetrics.of(outputs[0].metrics)

    @staticmethod
    def usage(subrequests: Sequence[SubRequest], outputs: Sequence[RequestOutput | None]) -> Usage:
        # Each prompt counts once, however many choices it has; completions count every choice.
        return Usage.of(
            prompt_tokens=sum(len(s.prompt_token_ids) for s in subrequests),
            completion_tokens=sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs),
            cached_tokens=sum(o.num_cached_tokens for o in outputs if o is not None),
        )


def _stopped_error(stopped: RequestStopped) -> Exception:
    err = stopped.to_api_error()
    return err if err is not None else ClientGone()


async def _guarded(events: AsyncIterator[str], on_error: Callable[[APIError], str] = error_event,
                   done: str | None = SSE_DONE) -> AsyncIterator[str]:  # fmt: skip
    """Pass events through; an error after the 200 headers went out becomes an error event.
    Every stream that was not cut by the client ends with ``done`` ([DONE])."""
    try:
        try:
            async for event in events:
                yield event
        except RequestStopped as e:
            err = e.to_api_error()
            if err is None:
                logger.info("client disconnected; request aborted")
                return
            yield on_error(err)
        except APIError as e:
            yield on_error(e)
        except Exception:
            logger.exception("error while streaming a response")
            yield on_error(internal_error())
        if done is not None:
            yield done
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def client_gone_response() -> Response:
    return Response(status_code=CLIENT_GONE)
