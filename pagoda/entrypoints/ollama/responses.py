"""Response bodies of Ollama's API, and its error shape ``{"error": "message"}``.

Ollama leaves empty fields out (Go's ``omitempty``): the streamed lines carry no
durations and no ``done_reason`` until the last one. These models are dumped with
``exclude_none`` to match.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel
from starlette.responses import Response

from pagoda.entrypoints.openai.errors import APIError, register_error_shape
from pagoda.entrypoints.openai.responses import TokenLogprob

NDJSON = "application/x-ndjson"


def now_rfc3339() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


# ---------------------------------------------------------------------- errors
class ErrorResponse(BaseModel):
    error: str


def error_body(err: APIError) -> dict[str, str]:
    """Ollama's error is one string: it names the field at fault when the message does not."""
    if err.param and err.param not in err.message:
        return {"error": f"{err.param}: {err.message}"}
    return {"error": err.message}


def error_response(err: APIError) -> Response:
    """The APIError that shared code raised, in Ollama's shape (same status and headers)."""
    return Response(json.dumps(error_body(err)), status_code=err.status, headers=err.headers,
                    media_type="application/json")  # fmt: skip


def is_ollama_path(path: str) -> bool:
    return path == "/api" or path.startswith("/api/")


register_error_shape(is_ollama_path, error_response)


def error_line(err: APIError) -> str:
    """An error after the 200 went out: the last NDJSON line (the ollama client raises it)."""
    return json.dumps(error_body(err)) + "\n"


# ---------------------------------------------------------------------- generation
class _Line(BaseModel):
    def line(self) -> str:
        return self.model_dump_json(exclude_none=True) + "\n"


class GenerateResponse(_Line):
    """A line of /api/generate; the last (``done``) one has the context, counts and durations (ns)."""

    model: str
    created_at: str
    response: str
    thinking: str | None = None  # with "think": true, the model's reasoning
    done: bool
    done_reason: str | None = None
    context: list[int] | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[TokenLogprob] | None = None


class ToolCallFunctionOut(BaseModel):
    index: int
    name: str
    arguments: dict[str, Any]


class ToolCallOut(BaseModel):
    id: str
    function: ToolCallFunctionOut


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str
    thinking: str | None = None  # with "think": true, the model's reasoning
    tool_calls: list[ToolCallOut] | None = None


class ChatResponse(_Line):
    """A line of /api/chat; the last (``done``) one has the counts and durations (ns)."""

    model: str
    created_at: str
    message: ChatMessageOut
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[TokenLogprob] | None = None


# ---------------------------------------------------------------------- models
class ModelDetails(BaseModel):
    parent_model: str
    format: str
    family: str
    families: list[str] | None
    parameter_size: str
    quantization_level: str


class ListedModel(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class TagsResponse(BaseModel):
    models: list[ListedModel]


class RunningModel(BaseModel):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class PsResponse(BaseModel):
    models: list[RunningModel]


class ShowResponse(BaseModel):
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str
    license: str | None = None


class VersionResponse(BaseModel):
    version: str
    pagoda_version: str


class EmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int  # nanoseconds
    load_duration: int
    prompt_eval_count: int


class LegacyEmbeddingsResponse(BaseModel):
    embedding: list[float]
