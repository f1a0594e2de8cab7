"""Structured output request forms (response_format, structured_outputs, guided_*) mapped onto
StructuredOutputsParams, on both endpoints; conflicts and malformed forms are 400s."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from pagoda.entrypoints.openai.errors import APIError, validation_error_to_api_error
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagoda.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def body_error(make: Any, **fields: Any) -> APIError:
    with pytest.raises(ValidationError) as info:
        make(**fields)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    return validation_error_to_api_error(RequestValidationError(errors))


def mapped(make: Any, **fields: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    return make(**fields).structured_output()


@pytest.mark.parametrize("make", [chat, completion])
@pytest.mark.parametrize(
    "fields, expected, param",
    [
        ({}, None, None),
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True), "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True,
                                                                      "description": "d"}}},
         StructuredOutputsParams(json=SCHEMA), "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         StructuredOutputsParams(json_object=True), "response_format"),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA), "structured_outputs"),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutputsParams(json=json.dumps(SCHEMA)),
         "structured_outputs"),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True),
         "structured_outputs"),
        ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputsParams(regex="[0-9]+"), "structured_outputs"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=["yes", "no"]),
         "structured_outputs"),
        ({"structured_outputs": {"grammar": 'start: "a"+'}}, StructuredOutputsParams(grammar='start: "a"+'),
         "structured_outputs"),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA), "guided_json"),
        ({"guided_regex": "a|b"}, StructuredOutputsParams(regex="a|b"), "guided_regex"),
        ({"guided_choice": ["x", "y"]}, StructuredOutputsParams(choice=["x", "y"]), "guided_choice"),
        ({"guided_grammar": "start: /[a-z]+/"}, StructuredOutputsParams(grammar="start: /[a-z]+/"), "guided_grammar"),
    ],
)  # fmt: skip
def test_forms(make: Any, fields: dict[str, Any], expected: StructuredOutputsParams | None, param: str | None) -> None:
    assert mapped(make, **fields) == (expected, param)
    params = make(**fields).to_sampling_params(16, expected)
    assert params.structured_outputs == expected


def test_gbnf_is_converted_to_lark() -> None:
    params, _ = mapped(chat, guided_grammar='root ::= "yes" | "no"')
    assert params is not None and params.grammar is not None
    assert "::=" not in params.grammar and "start" in params.grammar
    lark = 'start: "a ::= b"'  # "::=" inside a string is not GBNF
    assert mapped(chat, structured_outputs={"grammar": lark})[0] == StructuredOutputsParams(grammar=lark)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": 'root ::= "a'}, "guided_grammar"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ],
)
def test_conflicts_and_bad_forms(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        mapped(chat, **fields)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_object", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
         "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
         "response_format.json_schema.schema"),
        ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs.disable_any_whitespace"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ],
)  # fmt: skip
def test_malformed_bodies(fields: dict[str, Any], param: str) -> None:
    assert body_error(chat, **fields).param == param
