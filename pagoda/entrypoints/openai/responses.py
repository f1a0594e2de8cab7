"""Response schemas, field for field as OpenAI sends them.

OpenAI writes absent values as ``null`` rather than leaving the key out (``logprobs``,
``finish_reason`` while streaming, ``refusal``), so these models dump every field;
the one exception is a streaming ``delta``, which carries only what changed.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

import pagoda
from pagoda.outputs import RequestMetrics

SYSTEM_FINGERPRINT = f"pagoda-{pagoda.__version__}"


def _now() -> int:
    return int(time.time())


class _TokenIdsOut(BaseModel):
    """A model whose vLLM extension fields (``return_token_ids``' ids, ``prompt_logprobs``) are
    left out of the JSON unless asked for, so that other responses keep OpenAI's exact shape."""

    @model_serializer(mode="wrap")
    def _drop_absent_token_ids(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key in ("prompt_token_ids", "token_ids", "prompt_logprobs", "metrics"):
            if key in data and data[key] is None:
                del data[key]
        return data


class PerRequestMetrics(BaseModel):
    """vLLM's per-request ``metrics`` (``--enable-per-request-metrics``), from the engine's
    timings of a request of one sequence; a field is null where its timing is not known.
    ``time_to_first_token_ms`` counts from the engine's first scheduling of the request (vLLM's
    definition; the Prometheus TTFT counts from arrival); ``tokens_per_second`` is every
    generated token over scheduling -> last token, prefill included."""

    time_to_first_token_ms: float | None = None
    generation_time_ms: float | None = None   # first token -> last token
    queue_time_ms: float | None = None        # arrival -> first scheduled
    mean_itl_ms: float | None = None          # generation_time_ms / (tokens - 1); null for one token
    tokens_per_second: float | None = None

    @classmethod
    def of(cls, m: RequestMetrics) -> PerRequestMetrics:
        ms = 1000.0
        scheduled, first, last, n = m.scheduled_time, m.first_token_time, m.last_token_time, m.num_generation_tokens
        generation = (last - first) * ms if first else None
        return cls(
            time_to_first_token_ms=(first - scheduled) * ms if first and scheduled else None,
            generation_time_ms=generation,
            queue_time_ms=max(0.0, scheduled - m.arrival_time) * ms if scheduled else None,
            mean_itl_ms=generation / (n - 1) if generation is not None and n > 1 else None,
            tokens_per_second=n / (last - scheduled) if scheduled and last > scheduled else None,
        )  # fmt: skip


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


class CompletionChoice(_TokenIdsOut):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobsOut | None = None  # left out of the JSON unless asked for
    prompt_token_ids: list[int] | None = None  # return_token_ids (streaming: on a prompt's first chunk)
    token_ids: list[int] | None = None         # return_token_ids (streaming: this chunk's tokens)


class CompletionResponse(_TokenIdsOut):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[CompletionChoice]
    usage: Usage | None = None
    metrics: PerRequestMetrics | None = None  # --enable-per-request-metrics; left out when null


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


class ChatChoice(_TokenIdsOut):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # return_token_ids
    # /v1/chat/completions/batch: each choice is a conversation, with its own prompt's extras.
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobsOut | None = None


class ChatCompletionResponse(_TokenIdsOut):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsOut | None = None  # left out of the JSON unless asked for
    prompt_token_ids: list[int] | None = None  # return_token_ids
    metrics: PerRequestMetrics | None = None   # --enable-per-request-metrics


class ChatStreamChoice(_TokenIdsOut):
    index: int
    # Only what changed: {"role", "content"} first, then {"content"} (the last one with finish_reason).
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's tokens


class ChatCompletionChunk(_TokenIdsOut):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunk
    metrics: PerRequestMetrics | None = None   # --enable-per-request-metrics: on the usage chunk


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
    token_strs: list[str] | None = None  # return_token_strs


class TokenizerInfoResponse(BaseModel):
    """GET /tokenizer_info: the tokenizer's configuration, as vLLM's (tokenizer_config.json's keys)."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


class ServerLoadResponse(BaseModel):
    server_load: int  # generation requests in flight (vLLM's GET /load)


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
