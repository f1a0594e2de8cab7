"""Response bodies of Anthropic's Messages API, and its server-sent events."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # pagoda does not sign thinking; sent back, it is dropped from the prompt anyway


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessagesUsage(BaseModel):
    """As Anthropic counts: ``input_tokens`` are the prompt tokens not read from the (automatic)
    prefix cache; ``cache_read_input_tokens`` those that were."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageOut(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingOut | TextOut | ToolUseOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


def event(name: str, data: dict[str, Any]) -> str:
    """One server-sent event, with the ``event:`` line Anthropic sends before its data."""
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"
