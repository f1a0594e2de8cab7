"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API as a thin dialect
over chat completions' machinery.

The prompt is what /v1/chat/completions renders for the same conversation (the chat
template, tools written in by the tool parser), generation runs through the same
prepare / group / run calls, and the output is read by the same tool and reasoning
parsers; only the shapes differ: content blocks (``thinking``, ``text``, ``tool_use``),
``stop_reason`` and Anthropic's streaming events::

    message_start, then per block: content_block_start (a ping after the first one),
    content_block_delta (text_delta / thinking_delta / input_json_delta)..., content_block_stop;
    then message_delta (stop_reason, usage) and message_stop.

With ``--reasoning-parser``, the reasoning becomes a ``thinking`` block when the request
enables thinking; otherwise it is left out (it is not the answer). ``thinking.budget_tokens``
caps the reasoning: ``thinking_budget.BudgetedGroup`` runs the request in two phases when
the budget is spent, ending the reasoning with ``</think>`` itself. On GPT-OSS the prompt is
Harmony's and the parsers are its own (see serving_chat.py): the analysis channel is the thinking.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagoda.entrypoints.anthropic.errors import error_event
from pagoda.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagoda.entrypoints.anthropic.responses import (
    CountTokensResponse,
    MessageOut,
    MessagesUsage,
    TextOut,
    ThinkingOut,
    ToolUseOut,
    event,
)
from pagoda.entrypoints.openai.errors import APIError, bad_request, internal_error
from pagoda.entrypoints.openai.request_group import (
    RequestGroup,
    RequestStopped,
    SubRequest,
)
from pagoda.entrypoints.openai.serving_chat import ChatServing
from pagoda.entrypoints.openai.serving_engine import (
    ClientGone,
    SSEResponse,
    client_gone_response,
)
from pagoda.entrypoints.openai.thinking_budget import BudgetedGroup
from pagoda.entrypoints.openai.tools import ToolPlan
from pagoda.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_reason(c: CompletionOutput | None, num_calls: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for how an output ended."""
    if c is None:
        return "end_turn", None
    if num_calls and c.finish_reason == "stop":
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str):  # a stop string matched (a token id is an EOS-like stop)
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    # ---- the prompt -----------------------------------------------------------------
    def _encode(self, body: CountTokensRequest | MessagesRequest) -> tuple[ToolPlan, str, list[int], list]:
        if body.thinking is not None and body.thinking.type == "enabled" and self.chat.reasoning_parser is None:
            raise bad_request("Thinking is enabled, but this server has no reasoning parser; start it with "
                              "--reasoning-parser for a reasoning model.", param="thinking")  # fmt: skip
        plan = body.tool_plan()
        text, ids, images = self.chat.encode_chat_images(body.template_messages(), plan=plan)
        return plan, text, ids, images

    async def count_tokens(self, body: CountTokensRequest) -> CountTokensResponse:
        self.chat.check_model(body.model)
        _, _, ids, _ = await asyncio.to_thread(self._encode, body)
        return CountTokensResponse(input_tokens=len(ids))

    # ---- generating -----------------------------------------------------------------
    async def create(self, body: MessagesRequest, raw_request: Request) -> Response:
        lora = self.chat.check_model(body.model)
        body.check_thinking_budget()
        plan, text, ids, images = await asyncio.to_thread(self._encode, body)
        structured = self.chat.with_reasoning(plan.constraint(self.chat.tool_parser)) if plan.forced else None
        request_id = f"msg_{uuid.uuid4().hex[:24]}"
        sub = self.chat.prepare(request_id, text, ids, lambda _: self.chat.keep_markers(
                                    body.to_sampling_params(structured, self.chat.model_defaults.sampling), plan),
                                "messages",
                                "max_tokens", "tool_choice", lora_request=lora, mm_inputs=images)  # fmt: skip
        group = self._group(body, raw_request, sub)
        if body.stream:
            try:
                first = await self.chat.start_stream(group)
            except ClientGone:
                return client_gone_response()
            events = _MessageStream(self.chat, body, plan, request_id, sub).events(group, first)
            return SSEResponse(_guarded(events), on_close=group.close)
        try:
            outputs = await self.chat.run_to_end(group)
        except ClientGone:
            return client_gone_response()
        out = outputs[0]
        message = self._message(body, plan, request_id, sub, out)
        return Response(message.model_dump_json(), media_type="application/json")

    def _group(self, body: MessagesRequest, raw_request: Request, sub: SubRequest) -> RequestGroup | BudgetedGroup:
        """The engine request(s) of one message: with a thinking budget, the reasoning is cut at it."""
        budget = body.thinking.budget_tokens if body.thinking is not None else None
        parser = self.chat.reasoning_parser
        if budget is None or parser is None:  # (_encode refused enabled thinking without a parser)
            return self.chat.group(raw_request, [sub])
        return BudgetedGroup(self.chat, raw_request, sub, budget, parser)

    def _message(self, body: MessagesRequest, plan: ToolPlan, request_id: str, sub: SubRequest,
                 out: RequestOutput | None) -> MessageOut:  # fmt: skip
        c = out.outputs[0] if out is not None and out.outputs else None
        content: list[ThinkingOut | TextOut | ToolUseOut] = []
        reasoning, text = self.chat.split_reasoning(c.text if c is not None else "", plan)
        if reasoning is not None and body.thinking_on:
            omitted = body.thinking is not None and body.thinking.display == "omitted"
            content.append(ThinkingOut(thinking="" if omitted else reasoning))
        calls = []
        if plan.active and c is not None:
            parser = self.chat.tool_parser.for_tools(plan.tool_dicts())
            extracted = parser.extract(text or "", truncated=c.finish_reason == "length")
            text, calls = extracted.content, extracted.calls[: body.max_tool_calls]
        if text:
            content.append(TextOut(text=text))
        content.extend(ToolUseOut(id=new_tool_use_id(), name=call.name, input=_arguments(call.arguments))
                       for call in calls)  # fmt: skip
        reason, sequence = stop_reason(c, len(calls))
        return MessageOut(id=request_id, model=self.chat.response_model(body.model), content=content,
                          stop_reason=reason, stop_sequence=sequence, usage=usage(sub, out))  # type: ignore[arg-type]


def usage(sub: SubRequest, out: RequestOutput | None) -> MessagesUsage:
    cached = out.num_cached_tokens if out is not None else 0
    generated = len(out.outputs[0].token_ids) if out is not None and out.outputs else 0
    return MessagesUsage(input_tokens=len(sub.prompt_token_ids) - cached, output_tokens=generated,
                         cache_read_input_tokens=cached)  # fmt: skip


class _Blocks:
    """The content blocks of a stream: at most one open at a time, numbered from 0."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text" or "tool_use:<call index>"
        self.pinged = False

    def start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.stop()
        self.index += 1
        self.open = kind
        events.append(event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                    "content_block": block}))  # fmt: skip
        if not self.pinged:
            self.pinged = True
            events.append(event("ping", {"type": "ping"}))
        return events

    def delta(self, kind: str, delta: dict[str, Any], block: dict[str, Any] | None = None) -> list[str]:
        """A delta for the block of ``kind``, opening one (``block``) unless it is the open one."""
        events = [] if self.open == kind or block is None else self.start(kind, block)
        if self.open == kind:
            events.append(event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                        "delta": delta}))  # fmt: skip
        return events

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]


class _MessageStream:
    """One streamed message: the reasoning and tool parsers follow the text as it grows."""

    def __init__(self, chat: ChatServing, body: MessagesRequest, plan: ToolPlan, request_id: str,
                 sub: SubRequest) -> None:  # fmt: skip
        self.chat, self.body, self.request_id, self.sub = chat, body, request_id, sub
        self.reasoner = chat.reasoning_streamer(plan)
        self.tools = chat.tool_parser.for_tools(plan.tool_dicts()).streamer() if plan.active else None
        self.show_thinking = body.thinking_on
        self.omit_thinking = body.thinking is not None and body.thinking.display == "omitted"
        self.blocks = _Blocks()
        self.num_calls = 0

    async def events(self, group: RequestGroup | BudgetedGroup, first: list[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        head = first[0][1] if first else None
        start_usage = usage(self.sub, head).model_dump()
        start_usage["output_tokens"] = 0
        yield event("message_start", {"type": "message_start", "message": {
            "id": self.request_id, "type": "message", "role": "assistant",
            "model": self.chat.response_model(self.body.model), "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": start_usage,
        }})  # fmt: skip
        for _, out in first:
            for e in self._step(out):
                yield e
        while (item := await group.next()) is not None:
            for e in self._step(item[1]):
                yield e
        last = group.last[0]
        c = last.outputs[0] if last is not None and last.outputs else None
        for e in self.blocks.stop():
            yield e
        if not self.blocks.pinged:
            yield event("ping", {"type": "ping"})
        reason, sequence = stop_reason(c, self.num_calls)
        final_usage = usage(self.sub, last).model_dump()
        yield event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                    "stop_sequence": sequence}, "usage": final_usage})  # fmt: skip
        yield event("message_stop", {"type": "message_stop"})

    def _step(self, out: RequestOutput) -> list[str]:
        events: list[str] = []
        for c in out.outputs[:1]:
            if c.finished and not c.just_finished:
                continue
            text = c.delta_text
            if self.reasoner is not None:
                split = self.reasoner.feed(text, final=c.just_finished)
                if split.reasoning and self.show_thinking:
                    piece = "" if self.omit_thinking else split.reasoning
                    events += self.blocks.delta("thinking", {"type": "thinking_delta", "thinking": piece},
                                                {"type": "thinking", "thinking": "", "signature": ""})  # fmt: skip
                text = split.content
            if self.tools is None:
                events += self._text(text)
                continue
            delta = self.tools.feed(text, final=c.just_finished)
            events += self._text(delta.content)
            for call in delta.calls:
                if self.body.max_tool_calls is not None and call.index >= self.body.max_tool_calls:
                    continue
                kind = f"tool_use:{call.index}"
                if call.name is not None:
                    self.num_calls += 1
                    events += self.blocks.start(kind, {"type": "tool_use", "id": new_tool_use_id(),
                                                       "name": call.name, "input": {}})  # fmt: skip
                if call.arguments:
                    events += self.blocks.delta(kind, {"type": "input_json_delta", "partial_json": call.arguments})
        return events

    def _text(self, text: str) -> list[str]:
        if not text:
            return []
        return self.blocks.delta("text", {"type": "text_delta", "text": text}, {"type": "text", "text": ""})


async def _guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass events through; an error after the 200 went out becomes Anthropic's error event.
    A client that left gets nothing more (its engine request is aborted by the group)."""
    try:
        async for e in events:
            yield e
    except RequestStopped as stopped:
        err = stopped.to_api_error()
        if err is None:
            logger.info("client disconnected; request aborted")
            return
        yield error_event(err)
    except APIError as err:
        yield error_event(err)
    except Exception:
        logger.exception("error while streaming a message")
        yield error_event(internal_error())
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
