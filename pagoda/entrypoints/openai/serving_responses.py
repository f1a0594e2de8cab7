"""POST /v1/responses (OpenAI's Responses API) as a thin translation onto the chat path.

The input items (after ``instructions`` as the system message, and the stored conversation
that ``previous_response_id`` names) become chat messages rendered by ``ChatServing``'s chat
template; function tools and ``tool_choice`` become a chat ``ToolPlan``; ``text.format``
becomes the structured output constraint. With a reasoning parser, the output is split as chat
splits it: the reasoning becomes a ``reasoning`` item before the message, tool calls are read
from the rest, and a constraint applies after the (free) reasoning. ``reasoning.effort`` is
honoured as chat's ``reasoning_effort`` is (GPT-OSS's ``Reasoning:`` level, or the template's
variable; a 400 elsewhere), and on GPT-OSS (Harmony) the reasoning items sent back are rendered
as analysis before the calls they preceded, as Harmony keeps the current turn's reasoning. The
engine request is then prepared, admitted and run by ``OpenAIServing`` exactly as a chat
completion is, so greedy output is the same text /v1/chat/completions gives for the same
messages. What differs is the answer's shape: output items (``responses_output.OutputBuilder``)
and, when streaming, the Responses event types with their ``sequence_number`` and ``event:``
lines, and no ``[DONE]``. Stored responses: ``responses_store.py``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagoda.entrypoints.openai.errors import APIError, bad_request, unsupported
from pagoda.entrypoints.openai.protocol import make_sampling_params
from pagoda.entrypoints.openai.request_group import RequestGroup, SubRequest
from pagoda.entrypoints.openai.responses_output import (
    Event,
    EventWriter,
    IncompleteDetails,
    InputItemList,
    OutputBuilder,
    ReasoningEcho,
    ResponseDeleted,
    ResponseError,
    ResponseObject,
    ResponseStatus,
    ResponseUsage,
    new_id,
)
from pagoda.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    InputItem,
    MessageItem,
    ReasoningInputItem,
    ResponsesRequest,
    parse_item,
    to_chat_messages,
)
from pagoda.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from pagoda.entrypoints.openai.serving_chat import ChatServing
from pagoda.entrypoints.openai.serving_engine import (
    TENANT_SCOPE_KEY,
    ClientGone,
    OpenAIServing,
    client_gone_response,
)
from pagoda.entrypoints.openai.structured import from_response_format
from pagoda.entrypoints.openai.tool_parsers import ToolCallStreamer
from pagoda.entrypoints.openai.tools import ToolPlan
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.reasoning import ReasoningStreamer, count_reasoning_tokens
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams


def _raw_message(text: str, token_ids: list[int]) -> dict[str, Any]:
    """One of enable_response_messages' entries (vLLM's ResponseRawMessageAndToken)."""
    return {"type": "raw_message_tokens", "message": text, "tokens": list(token_ids)}


def response_not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


def _status(c: CompletionOutput | None) -> tuple[ResponseStatus, IncompleteDetails | None, ResponseError | None]:
    reason = c.finish_reason if c is not None else None
    if reason == "stop":
        return "completed", None, None
    if reason == "length":  # max_output_tokens, or the end of the context
        return "incomplete", IncompleteDetails(reason="max_output_tokens"), None
    return "failed", None, ResponseError(code="server_error", message="The generation was aborted.")


def _stored_item(item: InputItem) -> dict[str, Any]:
    """An input item as stored and listed: with an id, and message text as a content part."""
    data = item.model_dump(by_alias=True, exclude_none=True)
    if isinstance(item, MessageItem):
        if isinstance(item.content, str):
            data["content"] = [{"type": "output_text" if item.role == "assistant" else "input_text",
                                "text": item.content}]  # fmt: skip
        data.setdefault("id", new_id("msg"))
    elif isinstance(item, ReasoningInputItem):
        data.setdefault("id", new_id("rs"))
    else:
        data.setdefault("id", new_id("fc" if isinstance(item, FunctionCallItem) else "fco"))
    return data


class _Run:
    """What one /v1/responses request resolved to, shared by the streaming and plain paths."""

    def __init__(self, body: ResponsesRequest, response_id: str, tenant: str | None, plan: ToolPlan,
                 sub: SubRequest, items: list[InputItem], history: list[dict[str, Any]]) -> None:  # fmt: skip
        self.body, self.response_id, self.tenant, self.plan, self.sub = body, response_id, tenant, plan, sub
        self.items, self.history = items, history
        self.created_at = int(time.time())


class ResponsesServing(OpenAIServing):
    def __init__(self, chat: ChatServing, store: ResponseStore) -> None:
        super().__init__(chat.engine, chat.state, chat.served_model_name, chat.request_timeout, chat.model_defaults,
                         per_request_metrics=chat.per_request_metrics)
        self.chat = chat
        self.store = store

    # ---- POST /v1/responses ------------------------------------------------------------
    async def create(self, body: ResponsesRequest, raw_request: Request) -> Response:
        run = self._resolve(body, raw_request)
        group = self.group(raw_request, [run.sub])
        if body.stream:
            try:
                first = await self.start_stream(group)
            except ClientGone:
                return client_gone_response()
            writer = EventWriter()
            builder = OutputBuilder()
            return self.stream_response(group, self._events(run, group, first, writer, builder),
                                        on_error=lambda err: self._failed_events(run, writer, builder, err),
                                        done=None)  # fmt: skip
        try:
            outputs = await self.run_to_end(group)
        except ClientGone:
            return client_gone_response()
        out = outputs[0]
        c = out.outputs[0] if out is not None and out.outputs else None
        builder = OutputBuilder()
        if c is not None:
            self._add_logprobs(run, builder, c.token_ids, c.logprobs)
            reasoning, content = self.chat.split_reasoning(c.text, run.plan)
            builder.reasoning(reasoning or "")
            if run.plan.active:
                extracted = self.chat.tool_parser.for_tools(run.plan.tool_dicts()).extract(
                    content or "", truncated=c.finish_reason == "length")
                builder.text(extracted.content or "")
                for call in extracted.calls:
                    builder.start_call(call.name)
                    builder.call_arguments(call.arguments)
            else:
                builder.text(content or "")
        response, _ = self._finish(run, builder, c, outputs)
        return Response(response.model_dump_json(), media_type="application/json")

    def _add_logprobs(self, run: _Run, builder: OutputBuilder, token_ids: list[int], logprobs: Any) -> None:
        """With include ["message.output_text.logprobs"]: these tokens' logprobs, chat's entries."""
        if run.body.output_logprobs and logprobs:
            entries = self.logprobs.chat(token_ids, logprobs, run.body.top_logprobs or 0)
            builder.logprobs([e.model_dump() for e in entries])

    def _resolve(self, body: ResponsesRequest, raw_request: Request) -> _Run:
        """Check the request and prepare its engine request (every 400 and 404 comes from here)."""
        lora = self.check_model(body.model)
        body.check_supported(reasoning_parser=self.chat.reasoning_parser is not None)
        if body.store is True and not self.store.enabled:
            raise unsupported("store", "is not available: this server keeps no responses (--responses-store-max-entries 0)")
        tenant = raw_request.scope.get(TENANT_SCOPE_KEY)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id, tenant)
            if previous is None:
                raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")  # fmt: skip
            history = previous.conversation()
        items = body.input_items()
        messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
        messages += to_chat_messages([parse_item(h) for h in history] + items, keep_reasoning=self.chat.harmony)
        plan = body.tool_plan()
        structured, structured_param = self._structured(body, plan)
        effort = body.reasoning.effort if body.reasoning is not None else None
        template_kwargs = self.chat.effort_kwargs(effort, "reasoning.effort")
        try:
            text, ids, images = self.chat.encode_chat_images(messages, plan=plan, template_kwargs=template_kwargs)
        except APIError as e:
            # The chat messages' places are not the input's (instructions, earlier turns): "input".
            e.param = "input" if e.param is not None and e.param.startswith("messages") else e.param
            raise
        response_id = new_id("resp")

        def to_params(default_max_tokens: int) -> SamplingParams:
            # The model's own defaults (ModelDefaults.sampling) under the request's fields.
            defaults = self.model_defaults.sampling
            kwargs: dict[str, Any] = {**defaults, "structured_outputs": structured,
                                      "max_tokens": min(default_max_tokens, defaults.get("max_tokens", default_max_tokens))}
            if body.max_output_tokens is not None:
                kwargs["max_tokens"] = body.max_output_tokens
            if body.temperature is not None:
                kwargs["temperature"] = body.temperature
            for name in ("top_p", "top_k", "min_p", "repetition_penalty"):
                if getattr(body, name) is not None:
                    kwargs[name] = getattr(body, name)
            if body.output_logprobs:
                kwargs["logprobs"] = body.top_logprobs or 0
            names = {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}
            return self.chat.keep_markers(make_sampling_params(kwargs, names), plan)

        sub = self.prepare(response_id, text, ids, to_params, "input", "max_output_tokens", structured_param,
                           lora_request=lora, mm_inputs=images, logprobs_param="top_logprobs")  # fmt: skip
        return _Run(body, response_id, tenant, plan, sub, items, history)

    def _structured(self, body: ResponsesRequest, plan: ToolPlan) -> tuple[StructuredOutputsParams | None, str | None]:
        """The constraint and the field it came from; with a reasoning parser it applies after
        the reasoning section, which stays free."""
        structured, param = self._constraint(body, plan)
        return self.chat.with_reasoning(structured), param

    def _constraint(self, body: ResponsesRequest, plan: ToolPlan) -> tuple[StructuredOutputsParams | None, str | None]:
        fmt = body.response_format()
        structured = from_response_format(fmt, "text.format") if fmt is not None else None
        if plan.forced:
            if structured is not None:
                raise bad_request(
                    f"'text.format' cannot be combined with a forced tool call (tool_choice "
                    f"{plan.named or plan.mode!r}): both constrain the whole output.", param="text.format",
                )  # fmt: skip
            return plan.constraint(self.chat.tool_parser), "tools"
        return structured, ("text.format" if structured is not None else None)

    # ---- the Response object -------------------------------------------------------------
    def _response(self, run: _Run, status: ResponseStatus, builder: OutputBuilder, **fields: Any) -> ResponseObject:
        body, params = run.body, run.sub.params
        fmt = body.text.format if body.text is not None else None
        text: dict[str, Any] = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}
        if body.text is not None and body.text.verbosity is not None:
            text["verbosity"] = body.text.verbosity
        choice = body.tool_choice
        return ResponseObject(
            id=run.response_id, created_at=run.created_at, status=status, output=list(builder.items),
            instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            max_tool_calls=body.max_tool_calls, metadata=body.metadata or {}, model=self.response_model(body.model),
            parallel_tool_calls=body.parallel_tool_calls is not False, previous_response_id=body.previous_response_id,
            prompt_cache_key=body.prompt_cache_key, prompt_cache_retention=body.prompt_cache_retention,
            reasoning=self._reasoning_echo(body),
            safety_identifier=body.safety_identifier, service_tier=body.service_tier, store=body.stored,
            temperature=params.temperature, top_p=params.top_p, top_logprobs=params.logprobs, text=text,
            tool_choice=choice.model_dump() if choice is not None and not isinstance(choice, str) else choice or "auto",
            tools=[t.model_dump() for t in body.tools or []], user=body.user, **fields,
        )  # fmt: skip

    @staticmethod
    def _reasoning_echo(body: ResponsesRequest) -> ReasoningEcho:
        r = body.reasoning
        if r is None:
            return ReasoningEcho()
        return ReasoningEcho(effort=r.effort, summary=r.summary or r.generate_summary, context=r.context, mode=r.mode)

    def _reasoning_tokens(self, run: _Run, c: CompletionOutput | None) -> int:
        parser = self.chat.reasoning_parser
        if parser is None or c is None:
            return 0
        # Decoded as the output text was: with the special tokens a parser's tags may be (Harmony's markers).
        skip = run.sub.params.skip_special_tokens
        return count_reasoning_tokens(parser, c.token_ids, lambda ids: self.tokenizer.decode(ids, skip))

    def _finish(self, run: _Run, builder: OutputBuilder, c: CompletionOutput | None,
                outputs: Sequence[RequestOutput | None]) -> tuple[ResponseObject, list[Event]]:  # fmt: skip
        """Close the output, make the final Response object and store it if asked to; the
        events that closed the last item."""
        status, incomplete, error = _status(c)
        events = builder.finish("incomplete" if status == "incomplete" else "completed")
        usage = self.usage([run.sub], outputs)
        details = usage.prompt_tokens_details
        messages: dict[str, Any] = {}
        if run.body.enable_response_messages:
            # vLLM's raw messages: the prompt as rendered, the output as generated (reasoning and markup included).
            sub = run.sub
            messages["input_messages"] = [_raw_message(sub.prompt or "", sub.prompt_token_ids)]
            messages["output_messages"] = [_raw_message(c.text, c.token_ids)] if c is not None and c.token_ids else []
        response = self._response(
            run, status, builder, incomplete_details=incomplete, error=error,
            completed_at=int(time.time()) if status == "completed" else None,
            usage=ResponseUsage.of(usage.prompt_tokens, usage.completion_tokens, details.cached_tokens,
                                   self._reasoning_tokens(run, c)),
            metrics=self.request_metrics(outputs), **messages,
        )  # fmt: skip
        if run.body.stored and self.store.enabled:
            entry = StoredResponse(response.model_dump(mode="json"), [_stored_item(i) for i in run.items],
                                   run.history, run.tenant)  # fmt: skip
            self.store.put(entry)
        return response, events

    # ---- streaming -------------------------------------------------------------------------
    async def _events(self, run: _Run, group: RequestGroup, first: list[tuple[int, RequestOutput]],
                      writer: EventWriter, builder: OutputBuilder) -> AsyncIterator[str]:  # fmt: skip
        started = self._response(run, "in_progress", builder).model_dump(mode="json")
        yield writer({"type": "response.created", "response": started})
        yield writer({"type": "response.in_progress", "response": started})
        streamer = self.chat.tool_parser.for_tools(run.plan.tool_dicts()).streamer() if run.plan.active else None
        reasoner = self.chat.reasoning_streamer(run.plan)
        for _, out in first:
            for event in self._step(run, out, builder, streamer, reasoner):
                yield writer(event)
        while (item := await group.next()) is not None:
            for event in self._step(run, item[1], builder, streamer, reasoner):
                yield writer(event)
        last = group.last[0]
        c = last.outputs[0] if last is not None and last.outputs else None
        response, events = self._finish(run, builder, c, group.last)
        for event in events:
            yield writer(event)
        yield writer({"type": f"response.{response.status}", "response": response.model_dump(mode="json")})

    def _step(self, run: _Run, out: RequestOutput, builder: OutputBuilder, streamer: ToolCallStreamer | None,
              reasoner: ReasoningStreamer | None) -> list[Event]:  # fmt: skip
        events: list[Event] = []
        for c in out.outputs:
            if c.finished and not c.just_finished:
                continue  # finished in an earlier update
            self._add_logprobs(run, builder, c.delta_token_ids, c.delta_logprobs)
            text = c.delta_text
            if reasoner is not None:
                split = reasoner.feed(text, final=c.just_finished)
                events += builder.reasoning(split.reasoning)
                text = split.content
            if streamer is None:
                events += builder.text(text)
                continue
            delta = streamer.feed(text, final=c.just_finished)
            events += builder.text(delta.content)
            for call in delta.calls:
                if call.name is not None:
                    events += builder.start_call(call.name)
                events += builder.call_arguments(call.arguments)
        return events

    def _failed_events(self, run: _Run, writer: EventWriter, builder: OutputBuilder, err: APIError) -> str:
        """After the 200 went out: an ``error`` event with the error's own code, then
        ``response.failed`` so that a client waiting for a terminal event gets one."""
        error = writer({"type": "error", "code": err.code, "message": err.message, "param": err.param})
        failed = self._response(run, "failed", builder, error=ResponseError(code="server_error", message=err.message))
        return error + writer({"type": "response.failed", "response": failed.model_dump(mode="json")})

    # ---- stored responses ------------------------------------------------------------------
    def stored(self, response_id: str, raw_request: Request) -> StoredResponse:
        entry = self.store.get(response_id, raw_request.scope.get(TENANT_SCOPE_KEY))
        if entry is None:
            raise response_not_found(response_id)
        return entry


def add_responses_routes(app: FastAPI, serving: ResponsesServing, errors: dict[int | str, dict[str, Any]]) -> None:
    """POST /v1/responses; GET and DELETE /v1/responses/{id}; GET /v1/responses/{id}/input_items."""

    @app.post("/v1/responses", responses={200: {"model": ResponseObject}, **errors})
    async def create_response(body: ResponsesRequest, raw_request: Request) -> Response:
        return await serving.create(body, raw_request)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=errors)
    async def retrieve_response(
        response_id: str, raw_request: Request, stream: bool = False, starting_after: int | None = None,
        include: Annotated[list[str] | None, Query()] = None,
    ) -> JSONResponse:  # fmt: skip
        if stream or starting_after is not None:
            raise unsupported("stream", "replaying a stored response as a stream is not supported")
        _check_include(include)
        return JSONResponse(serving.stored(response_id, raw_request).response)

    @app.delete("/v1/responses/{response_id}", response_model=ResponseDeleted, responses=errors)
    async def delete_response(response_id: str, raw_request: Request) -> ResponseDeleted:
        serving.stored(response_id, raw_request)  # 404 if unknown
        serving.store.delete(response_id, raw_request.scope.get(TENANT_SCOPE_KEY))
        return ResponseDeleted(id=response_id)

    @app.get("/v1/responses/{response_id}/input_items", response_model=InputItemList, responses=errors)
    async def list_input_items(
        response_id: str, raw_request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc", after: str | None = None,
        include: Annotated[list[str] | None, Query()] = None,
    ) -> InputItemList:  # fmt: skip
        _check_include(include)
        items = list(serving.stored(response_id, raw_request).input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise bad_request(f"No input item with id '{after}' in response '{response_id}'.", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                             last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)  # fmt: skip


def _check_include(include: list[str] | None) -> None:
    extra = [i for i in include or [] if i != "reasoning.encrypted_content"]
    if extra:
        raise unsupported("include", f"values other than 'reasoning.encrypted_content' are not supported: {extra}")
