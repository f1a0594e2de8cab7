"""Structured output requests (OpenAI's ``response_format``, vLLM's ``structured_outputs`` and
its legacy ``guided_*`` fields) mapped onto ``StructuredOutputsParams``.

At most one of these forms may be given. Whether a schema, regex or grammar compiles is
the engine's call (``validate_request``); here only the shape of the request is checked.
Grammars are Lark (llguidance's dialect); a llama.cpp GBNF grammar (``root ::= ...``) is
converted first.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagoda.entrypoints.openai.errors import bad_request
from pagoda.sampling_params import StructuredOutputsParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str
    # "schema" would shadow a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_matches_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("'json_schema' is required when 'type' is 'json_schema'")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"'json_schema' is only allowed when 'type' is 'json_schema', not {self.type!r}")
        return self


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


# llama.cpp GBNF rules are written "name ::= ..."; Lark never uses "::=" outside a string.
_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z_][\w-]*\s*::=")


def to_lark(grammar: str, param: str) -> str:
    """A Lark grammar as is; a GBNF one converted (400 if it cannot be)."""
    if not _GBNF_RULE.search(grammar):
        return grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(grammar)
    except Exception as e:  # GbnfToLarkError, or a plain Exception for an undefined rule
        raise bad_request(f"Invalid GBNF grammar: {e}", param=param, code="invalid_grammar") from None


def _build(param: str, **form: Any) -> StructuredOutputsParams:
    if form.get("grammar") is not None:
        form["grammar"] = to_lark(form["grammar"], param)
    try:
        return StructuredOutputsParams(**form)
    except ValueError as e:
        raise bad_request(f"Invalid value for '{param}': {e}", param=param, code="invalid_value") from None


def from_response_format(fmt: ResponseFormat, param: str = "response_format") -> StructuredOutputsParams | None:
    """``param``: the request field an error names (``text.format`` in the Responses API)."""
    if fmt.type == "text":
        return None
    if fmt.type == "json_object" or fmt.json_schema is None or fmt.json_schema.json_schema is None:
        return _build(param, json_object=True)
    return _build(param, json=fmt.json_schema.json_schema)


def from_structured_outputs(req: StructuredOutputsRequest) -> StructuredOutputsParams:
    form = {
        "json": req.json_, "json_object": bool(req.json_object), "regex": req.regex, "choice": req.choice,
        "grammar": req.grammar,
    }  # fmt: skip
    return _build("structured_outputs", **form)


def resolve(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputsRequest | None,
    guided: dict[str, Any],
) -> tuple[StructuredOutputsParams | None, str | None]:
    """The one structured output form a request gives, and the parameter it came from.

    ``guided``: the legacy fields by name (``guided_json`` ...), unset ones None."""
    given = [name for name, value in guided.items() if value is not None]
    if structured_outputs is not None:
        given.insert(0, "structured_outputs")
    if response_format is not None and response_format.type != "text":
        given.insert(0, "response_format")
    if len(given) > 1:
        raise bad_request(
            f"Only one structured output form may be given, got {', '.join(repr(g) for g in given)}.",
            param=given[1], code="invalid_value",
        )  # fmt: skip
    if not given:
        return None, None
    param = given[0]
    if param == "response_format":
        assert response_format is not None
        return from_response_format(response_format), param
    if param == "structured_outputs":
        assert structured_outputs is not None
        return from_structured_outputs(structured_outputs), param
    form = {param.removeprefix("guided_"): guided[param]}
    return _build(param, **form), param


__all__ = [
    "JsonSchemaFormat", "ResponseFormat", "StructuredOutputsRequest", "from_response_format",
    "from_structured_outputs", "resolve", "to_lark",
]  # fmt: skip
