"""What ``/v1/responses`` sends back: the Response object (field for field after the ``openai``
package's ``types/responses/response.py``), its output items, and the streamed events.

``OutputBuilder`` is the one place output items are made, streaming or not: the serving code
tells it what the model produced (``text``, ``start_call``, ``call_arguments``, ``finish``) and
it grows the items and returns the events that announce each step, in OpenAI's order::

    response.output_item.added (message) -> response.content_part.added
      -> response.output_text.delta ... -> response.output_text.done
      -> response.content_part.done -> response.output_item.done
    response.output_item.added (function_call) -> response.function_call_arguments.delta ...
      -> response.function_call_arguments.done -> response.output_item.done

With a reasoning parser, what the model thought comes first, as a ``reasoning`` item
(``reasoning``), with the same shape of events::

    response.output_item.added (reasoning) -> response.content_part.added (reasoning_text)
      -> response.reasoning_text.delta ... -> response.reasoning_text.done
      -> response.content_part.done -> response.output_item.done
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from pagoda.entrypoints.openai.responses import PerRequestMetrics

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["completed", "failed", "in_progress", "incomplete"]
Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------- output items
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    # With include ["message.output_text.logprobs"]: per generated token {token, logprob, bytes,
    # top_logprobs: [{token, logprob, bytes}]}, chat's logprobs.content entries.
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    status: ItemStatus = "in_progress"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionToolCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus = "in_progress"
    call_id: str
    name: str
    arguments: str = ""


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningItem(BaseModel):
    """The model's reasoning as it wrote it (``content``); there is no summarizer, so
    ``summary`` is always empty, and no ``encrypted_content``: the text is there in the clear."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus = "in_progress"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


Item = OutputMessage | FunctionToolCall | ReasoningItem
OutputItem = Annotated[Item, Field(discriminator="type")]


# ---------------------------------------------------------------------- the response
class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    cache_write_tokens: int = 0  # explicit cache breakpoints (prompt_cache_options) do not exist here


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int = 0) -> ResponseUsage:
        return cls(input_tokens=input_tokens, output_tokens=output_tokens, total_tokens=input_tokens + output_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
                   output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens))  # fmt: skip


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] | None = None


class ResponseError(BaseModel):
    code: str  # "server_error": what OpenAI reports for a response that failed while generating
    message: str


class ReasoningEcho(BaseModel):
    effort: str | None = None
    summary: str | None = None
    context: str | None = None
    mode: str | None = None


class ResponseObject(BaseModel):
    """A Response; the request's parameters are echoed as OpenAI echoes them (defaults filled in)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    background: bool = False
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    reasoning: ReasoningEcho = Field(default_factory=ReasoningEcho)
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool = True
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    # vLLM's extensions, left out of the JSON unless asked for: enable_response_messages' prompt
    # and output ([{"type": "raw_message_tokens", "message": text, "tokens": ids}]), and
    # --enable-per-request-metrics' timings.
    input_messages: list[dict[str, Any]] | None = None
    output_messages: list[dict[str, Any]] | None = None
    metrics: PerRequestMetrics | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_extensions(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key in ("input_messages", "output_messages", "metrics"):
            if data.get(key, 0) is None:
                del data[key]
        return data


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: Literal[True] = True


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


# ---------------------------------------------------------------------- building the output
class OutputBuilder:
    """A response's output items as generation goes, and the events announcing each step."""

    def __init__(self) -> None:
        self.items: list[Item] = []
        self._open: Item | None = None
        self._logprobs: list[dict[str, Any]] = []   # tokens' logprobs no text delta has carried yet

    def logprobs(self, entries: list[dict[str, Any]]) -> None:
        """Generated tokens' logprobs (OutputText.logprobs entries). They ride on the next
        output text delta, whatever part of the output the tokens were (reasoning, a call's
        markup, an end token), and all of them end up in the message's ``output_text``."""
        self._logprobs += entries

    def text(self, delta: str) -> list[Event]:
        """Text for the assistant message (opened if another item, or none, is open)."""
        if not delta:
            return []
        events = [] if isinstance(self._open, OutputMessage) else self._close("completed") + self._open_message()
        message = self._open
        assert isinstance(message, OutputMessage)
        part = message.content[0]
        part.text += delta
        logprobs, self._logprobs = self._logprobs, []
        part.logprobs += logprobs
        events.append(self._at(message, type="response.output_text.delta", content_index=0, delta=delta,
                               logprobs=_event_logprobs(logprobs)))  # fmt: skip
        return events

    def reasoning(self, delta: str) -> list[Event]:
        """Reasoning text for the reasoning item (opened if another item, or none, is open)."""
        if not delta:
            return []
        events = [] if isinstance(self._open, ReasoningItem) else self._close("completed") + self._open_reasoning()
        item = self._open
        assert isinstance(item, ReasoningItem)
        item.content[0].text += delta
        events.append(self._at(item, type="response.reasoning_text.delta", content_index=0, delta=delta))
        return events

    def start_call(self, name: str, call_id: str | None = None) -> list[Event]:
        """A new function call (closing whatever was open); its arguments follow."""
        events = self._close("completed")
        call = FunctionToolCall(id=new_id("fc"), call_id=call_id or new_id("call"), name=name)
        return events + self._add(call)

    def call_arguments(self, delta: str) -> list[Event]:
        call = self._open
        if not delta:
            return []
        if not isinstance(call, FunctionToolCall):
            raise TypeError("function call arguments before the call's name")
        call.arguments += delta
        return [self._at(call, type="response.function_call_arguments.delta", delta=delta)]

    def finish(self, status: ItemStatus) -> list[Event]:
        """Close the last item with ``status`` ("incomplete" when the output was cut short).
        An output with no item at all gets an empty message: a response always says something."""
        events = [] if self.items else self._open_message()
        messages = [item for item in self.items if isinstance(item, OutputMessage)]
        if self._logprobs and messages:
            # Tokens after the last text (an end token, a call): still the output's logprobs.
            messages[-1].content[0].logprobs += self._logprobs
            self._logprobs = []
        return events + self._close(status)

    # ---- internals ---------------------------------------------------------------------
    def _open_message(self) -> list[Event]:
        message = OutputMessage(id=new_id("msg"))
        events = self._add(message)
        message.content.append(OutputText())
        part = message.content[0].model_dump()
        return events + [self._at(message, type="response.content_part.added", content_index=0, part=part)]

    def _open_reasoning(self) -> list[Event]:
        item = ReasoningItem(id=new_id("rs"))
        events = self._add(item)
        item.content.append(ReasoningText())
        part = item.content[0].model_dump()
        return events + [self._at(item, type="response.content_part.added", content_index=0, part=part)]

    def _add(self, item: Item) -> list[Event]:
        self.items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": item.model_dump()}]

    def _close(self, status: ItemStatus) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        events: list[Event] = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events.append(self._at(item, type="response.output_text.done", content_index=0, text=part.text,
                                   logprobs=_event_logprobs(part.logprobs)))  # fmt: skip
            events.append(self._at(item, type="response.content_part.done", content_index=0, part=part.model_dump()))
        elif isinstance(item, ReasoningItem):
            reasoning = item.content[0]
            events.append(self._at(item, type="response.reasoning_text.done", content_index=0, text=reasoning.text))
            events.append(self._at(item, type="response.content_part.done", content_index=0,
                                   part=reasoning.model_dump()))  # fmt: skip
        else:
            events.append(self._at(item, type="response.function_call_arguments.done", arguments=item.arguments))
        return events + [{"type": "response.output_item.done", "output_index": len(self.items) - 1,
                          "item": item.model_dump()}]  # fmt: skip

    def _at(self, item: Item, **event: Any) -> Event:
        # Only the open item, always the last one, gets events.
        return {"type": event.pop("type"), "item_id": item.id, "output_index": len(self.items) - 1, **event}


def _event_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Logprobs as the text delta and done events carry them (OpenAI's event types): no bytes."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]  # fmt: skip


class EventWriter:
    """Numbers the events of one stream (``sequence_number`` from 0) and writes them as SSE,
    with the ``event:`` line OpenAI sends before each ``data:`` line."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, event: Event) -> str:
        numbered = {"type": event["type"], "sequence_number": self.sequence_number,
                    **{k: v for k, v in event.items() if k != "type"}}  # fmt: skip
        self.sequence_number += 1
        return f"event: {event['type']}\ndata: {json.dumps(numbered, ensure_ascii=False)}\n\n"
