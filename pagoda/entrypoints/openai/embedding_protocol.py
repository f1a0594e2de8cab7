"""POST /v1/embeddings: OpenAI's request and response, field for field.

As the other routes' models, the request forbids unknown fields. ``user`` is accepted and
ignored (it does not change the vector); ``truncate_prompt_tokens`` is vLLM's extension
(keep k tokens of each input; -1: the context length), with ``truncation_side`` (vLLM's: "left",
the default, keeps the last k; "right" the first k).
"""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Any, Literal

from pydantic import BaseModel, PlainValidator, ValidationInfo, field_validator

from pagoda.entrypoints.openai.protocol import _is_token_list, _Strict

# OpenAI's bound on inputs per request: each is an engine request of its own.
MAX_EMBEDDING_INPUTS = 2048


def check_truncation_side(value: str | None, info: ValidationInfo) -> str | None:
    """A field validator of ``truncation_side`` (declared after ``truncate_prompt_tokens``): it
    says which side a truncation cuts, so without one it would be ignored; a 400 instead."""
    if value is not None and info.data.get("truncate_prompt_tokens") is None:
        raise ValueError("applies only with 'truncate_prompt_tokens' (which side of an input a truncation cuts)")
    return value


def _check_input(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """A string, a list of strings, a list of token ids or a list of lists of token ids; none
    of them empty (OpenAI: "'$.input' is invalid"; an empty input has no hidden state to pool)."""
    if isinstance(value, str):
        if not value:
            raise ValueError("must not be an empty string")
        return value
    if not isinstance(value, list):  # ValueError: pydantic turns it into the 400's message
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists of token ids")  # noqa: TRY004
    if not value:
        raise ValueError("must not be empty")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise ValueError(f"may hold at most {MAX_EMBEDDING_INPUTS} inputs, got {len(value)}")
    if all(isinstance(p, str) for p in value):
        if not all(value):
            raise ValueError("must not contain empty strings")
        return value
    if _is_token_list(value):
        return value
    if all(_is_token_list(p) for p in value):
        if not all(value):
            raise ValueError("must not contain empty lists of token ids")
        return value
    raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists of token ids")


InputField = Annotated[
    str | list[str] | list[int] | list[list[int]],
    PlainValidator(_check_input, json_schema_input_type=str | list[str] | list[int] | list[list[int]]),
]


class EmbeddingRequest(_Strict):
    input: InputField
    model: str | None = None  # None: the served model
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted and ignored: it does not change the vector
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    _check_side = field_validator("truncation_side")(check_truncation_side)

    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding: a text or a token id list."""
        if isinstance(self.input, str) or _is_token_list(self.input):
            return [self.input]
        return list(self.input)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32, as OpenAI's SDK decodes it


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def encode_base64(vector: list[float]) -> str:
    """E.g. [1.0] -> "AACAPw==" (float32 0x3f800000, little-endian)."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
