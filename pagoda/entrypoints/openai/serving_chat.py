"""POST /v1/chat/completions: messages rendered with the model's chat template, then generated.

With tools (see ``tools.py``), the output is read by the tool parser: calls become
``message.tool_calls`` (``delta.tool_calls`` while streaming: id, type and name first,
then the arguments in fragments) and ``finish_reason`` becomes ``"tool_calls"``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import Response

from pagoda.engine.client import EngineClient
from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.request_group import RequestGroup, ServerState
from pagoda.entrypoints.openai.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    FunctionCall,
    ToolCall,
    sse,
)
from pagoda.entrypoints.openai.serving_engine import ClientGone, OpenAIServing, client_gone_response
from pagoda.entrypoints.openai.tool_parsers import DEFAULT_TOOL_PARSER, ToolCallStreamer, get_tool_parser
from pagoda.entrypoints.openai.tools import ToolPlan, prompt_inputs
from pagoda.model.stores import NO_DEFAULTS, ModelDefaults
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _finish_reason(c: CompletionOutput, num_calls: int) -> str:
    reason = c.finish_reason or "abort"
    return "tool_calls" if num_calls and reason == "stop" else reason


class ChatServing(OpenAIServing):
    def __init__(
        self,
        engine: EngineClient,
        state: ServerState,
        served_model_name: str,
        request_timeout: float | None,
        tool_call_parser: str = DEFAULT_TOOL_PARSER,
        model_defaults: ModelDefaults = NO_DEFAULTS,
    ) -> None:
        super().__init__(engine, state, served_model_name, request_timeout, model_defaults)
        self.tool_parser = get_tool_parser(tool_call_parser)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               plan: ToolPlan | None = None) -> str:  # fmt: skip
        """The prompt text the chat template makes of these messages (and of the tools ``plan``
        puts in the prompt), with the model's default system prompt when they have none;
        400 if the template refuses them."""
        messages = self.model_defaults.with_system(messages)
        messages, tools = prompt_inputs(self.tokenizer, messages, plan or ToolPlan("none"), self.tool_parser)
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tools=tools)  # fmt: skip
        except (ValueError, jinja2.TemplateError) as e:
            # ChatTemplateError (a ValueError) is the template's own raise_exception(), e.g. roles
            # that do not alternate; other template errors also come from what the messages hold.
            raise bad_request(f"The chat template could not render the messages: {e}", param="messages") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    plan: ToolPlan | None = None) -> tuple[str, list[int]]:  # fmt: skip
        text = self.render(messages, add_generation_prompt, plan)
        # The template already wrote BOS and the role markers; adding special tokens would double BOS.
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    async def create(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        lora = self.check_model(body.model)
        body.check_supported()
        plan = body.tool_plan()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        text, ids = self.encode_chat(body.template_messages(), plan=plan)
        structured, structured_param = body.structured_output()
        if plan.forced:
            structured, structured_param = plan.constraint(self.tool_parser), "tools"

        def to_params(default_max_tokens: int) -> SamplingParams:
            return body.to_sampling_params(default_max_tokens, structured, self.model_defaults.sampling)

        max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        sub = self.prepare(request_id, text, ids, to_params, "messages", max_param, structured_param,
                           lora_request=lora, priority=body.priority)  # fmt: skip
        group = self.group(raw_request, [sub], body.priority, body.cache_salt)
        if body.stream:
            try:
                first = await self.start_stream(group)
            except ClientGone:
                return client_gone_response()
            return self.stream_response(group, self._events(body, plan, request_id, group, first))
        try:
            outputs = await self.run_to_end(group)
        except ClientGone:
            return client_gone_response()
        out = outputs[0]
        choices = []
        for i in range(body.n):
            c = out.outputs[i] if out is not None and i < len(out.outputs) else None
            message, finish_reason = self._message(plan, c)
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=self._logprobs(body, c, c.token_ids, c.logprobs) if c else None,
                    finish_reason=finish_reason,
                )
            )
        response = ChatCompletionResponse(
            id=request_id, model=self.response_model(body.model), choices=choices, usage=self.usage([sub], outputs)
        )
        return Response(response.model_dump_json(), media_type="application/json")

    def _message(self, plan: ToolPlan, c: CompletionOutput | None) -> tuple[ChatMessageOut, str]:
        if c is None:
            return ChatMessageOut(content=""), "abort"
        if not plan.active:
            return ChatMessageOut(content=c.text), c.finish_reason or "abort"
        extracted = self.tool_parser.extract(c.text, truncated=c.finish_reason == "length")
        calls = [
            ToolCall(id=new_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in extracted.calls
        ]
        message = ChatMessageOut(content=extracted.content, tool_calls=calls or None)
        return message, _finish_reason(c, len(calls))

    def _logprobs(
        self, body: ChatCompletionRequest, c: CompletionOutput, token_ids: list[int], logprobs: Any
    ) -> ChatLogprobs | None:
        if not body.logprobs or logprobs is None:
            return None
        return ChatLogprobs(content=self.logprobs.chat(token_ids, logprobs, body.top_logprobs or 0))

    async def _events(
        self, body: ChatCompletionRequest, plan: ToolPlan, request_id: str, group: RequestGroup,
        first: list[tuple[int, RequestOutput]],
    ) -> AsyncIterator[str]:  # fmt: skip
        created = int(time.time())
        exclude = None if body.include_usage else {"usage"}
        streamers: dict[int, ToolCallStreamer] = (
            {i: self.tool_parser.streamer() for i in range(body.n)} if plan.active else {}
        )

        def chunk(index: int, delta: dict[str, Any], logprobs: ChatLogprobs | None = None,
                  finish_reason: str | None = None) -> str:  # fmt: skip
            choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
            return sse(
                ChatCompletionChunk(id=request_id, created=created, model=self.response_model(body.model), choices=[choice]),
                exclude,
            )

        def tool_chunks(c: CompletionOutput, streamer: ToolCallStreamer, logprobs: ChatLogprobs | None) -> list[str]:
            delta = streamer.feed(c.delta_text, final=c.just_finished)
            events = []
            if delta.content or logprobs:
                events.append(chunk(c.index, {"content": delta.content}, logprobs))
            for call in delta.calls:
                if call.name is not None:
                    # As OpenAI: id, type and name first (arguments ""), then the arguments in pieces.
                    head = {"index": call.index, "id": new_call_id(), "type": "function",
                            "function": {"name": call.name, "arguments": ""}}  # fmt: skip
                    events.append(chunk(c.index, {"tool_calls": [head]}))
                if call.arguments:
                    piece = {"index": call.index, "function": {"arguments": call.arguments}}
                    events.append(chunk(c.index, {"tool_calls": [piece]}))
            return events

        def chunks(out: RequestOutput) -> list[str]:
            events = []
            for c in out.outputs:
                if c.finished and not c.just_finished:
                    continue  # finished in an earlier update
                logprobs = self._logprobs(body, c, c.delta_token_ids, c.delta_logprobs) if c.delta_logprobs else None
                streamer = streamers.get(c.index)
                if streamer is not None:
                    events.extend(tool_chunks(c, streamer, logprobs))
                elif c.delta_text or logprobs:
                    events.append(chunk(c.index, {"content": c.delta_text}, logprobs))
                if c.just_finished:
                    # As OpenAI: the finish reason comes in a chunk of its own with an empty delta.
                    num_calls = streamer.num_calls if streamer is not None else 0
                    events.append(chunk(c.index, {}, finish_reason=_finish_reason(c, num_calls)))
            return events

        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        for _, out in first:
            for event in chunks(out):
                yield event
        while (item := await group.next()) is not None:
            for event in chunks(item[1]):
                yield event
        last = group.last[0]
        for i in range(body.n):
            c = last.outputs[i] if last is not None and i < len(last.outputs) else None
            if c is None or not c.finished:
                yield chunk(i, {}, finish_reason="abort")
        if body.include_usage:
            usage = self.usage(group.subrequests, group.last)
            yield sse(ChatCompletionChunk(id=request_id, created=created, model=self.response_model(body.model), choices=[],
                                          usage=usage))  # fmt: skip
