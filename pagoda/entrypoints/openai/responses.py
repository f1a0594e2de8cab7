"""Response schemas, field for field as OpenAI sends them.

OpenAI writes absent values as ``null`` rather than leaving the key out (``logprobs``,
``finish_reason`` while streaming, ``refusal``), so these models dump every field;
the one exception is a streaming ``delta``, which carries only what changed.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

import pagoda

SYSTEM_FINGERPRINT = f"pagoda-{pagoda.__version__}"


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


# ---------------------------------------------------------------------- /v1/completions
class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    # None only for the first token of an echoed prompt (nothing precedes it), as OpenAI's.
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry, one per token id at a prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt position None (the first) or token id -> its entry.
PromptLogprobsOut = list[dict[str, PromptLogprob] | None]


def _drop_none(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    """Leave out extension fields that are not in use, so the shape stays OpenAI's."""
    for key in keys:
        if data.get(key) is None:
            data.pop(key, None)
    return data


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobsOut | None = None  # left out of the JSON unless asked for

    @model_serializer(mode="wrap")
    def _drop_unused(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _drop_none(handler(self), "prompt_logprobs")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------- /v1/chat/completions
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    # vLLM's field, with --reasoning-parser: the text between <think> and </think>.
    reasoning_content: str | None = None  # left out of the JSON when there is none
    tool_calls: list[ToolCall] | None = None  # left out of the JSON when there are none

    @model_serializer(mode="wrap")
    def _drop_empty_optional_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsOut | None = None  # left out of the JSON unless asked for

    @model_serializer(mode="wrap")
    def _drop_unused(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _drop_none(handler(self), "prompt_logprobs")


class ChatStreamChoice(BaseModel):
    index: int
    delta: dict[str, Any]  # only what changed: {"role", "content"} first, then {"content"}, {} at the end
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------- misc endpoints
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagoda"
    root: str | None = None           # the weights' path (a LoRA adapter's folder)
    parent: str | None = None         # a LoRA adapter's base model
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def sse(payload: BaseModel, exclude: set[str] | None = None) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
