"""The Hermes tool-call parser: whole outputs, streaming (deltas reassemble to the same calls),
and the grammar that forces a call."""

from __future__ import annotations

import json
import random

import pytest

from pagoda.entrypoints.openai.tool_parsers import ParsedToolCall, get_tool_parser
from pagoda.entrypoints.openai.tool_parsers.partial_json import scan_calls
from tests.unit.tool_streams import stream

PARSER = get_tool_parser("hermes")

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "x": {"y": "}{\\""}}}'
OUTPUTS = [
    "Hello there, no tools here.",
    f"<tool_call>\n{WEATHER}\n</tool_call>",
    f"Let me check. <tool_call>\n{WEATHER}\n</tool_call>\n",
    f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
    '{"arguments": {"q": 1.5e3, "flag": true, "none": null}, "name": "search"}\n</tool_call>',
    '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "parameters": {"k": "v"}}]</tool_call>',
    '<tool_call>\n{"name": "no_args"}\n</tool_call>',
    '<tool_call>\n{"name": "str_args", "arguments": "{\\"x\\": 1}"}\n</tool_call>',
    '<tool_call>\n{"name": "unclosed", "arguments": {"n": -12}}',  # stopped at EOS before the closing tag
    'Before <tool_call>{"name": "f", "arguments": {"s": "é ✓ \\u00e9"}}</tool_call> middle '
    '<tool_call>{"name": "g", "arguments": {}}</tool_call> after. ',
    "a < b and <tool is not a tag",
    # A string argument holding the closing tag (sampled by the real model under the grammar).
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": ");25}}</tool_call> to 17", "unit": "fahrenheit"}}'
    '\n</tool_call>',
]


def _calls(text: str) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in PARSER.extract(text).calls]


def test_extract_single_call() -> None:
    out = PARSER.extract(f"<tool_call>\n{WEATHER}\n</tool_call>")
    assert out.content is None
    assert out.calls == [ParsedToolCall("get_weather", json.dumps(json.loads(WEATHER)["arguments"]))]


def test_extract_content_and_several_calls() -> None:
    out = PARSER.extract(OUTPUTS[8])
    assert out.content == "Before middle after. "
    assert _calls(OUTPUTS[8]) == [("f", '{"s": "é ✓ \\u00e9"}'), ("g", "{}")]
    assert _calls(OUTPUTS[3])[1] == ("search", '{"q": 1.5e3, "flag": true, "none": null}')


def test_closing_tag_inside_a_string_is_text() -> None:
    out = PARSER.extract(OUTPUTS[10])
    assert out.content is None
    assert _calls(OUTPUTS[10]) == [("get_weather", '{"city": ");25}}</tool_call> to 17", "unit": "fahrenheit"}')]
    escaped = '<tool_call>{"name": "f", "arguments": {"s": "a\\"</tool_call>"}}</tool_call> after'
    assert _calls(escaped) == [("f", '{"s": "a\\"</tool_call>"}')]
    assert PARSER.extract(escaped).content == "after"


def test_extract_formats() -> None:
    assert _calls(OUTPUTS[4]) == [("a", "{}"), ("b", '{"k": "v"}')]
    assert _calls(OUTPUTS[5]) == [("no_args", "{}")]
    assert _calls(OUTPUTS[6]) == [("str_args", '{"x": 1}')]
    assert _calls(OUTPUTS[7]) == [("unclosed", '{"n": -12}')]


@pytest.mark.parametrize(
    "text",
    [
        "plain text",
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # unbalanced
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}',  # cut short (max_tokens)
        '<tool_call>{"name": "f"}</tool_call><tool_call>{"name": </tool_call>',
    ],
)
def test_invalid_output_is_content(text: str) -> None:
    out = PARSER.extract(text)
    assert out.calls == [] and out.content == text


def test_truncated_output_keeps_the_complete_calls() -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    cut = call + '\n<tool_call>\n{"name": "f", "argu'
    assert PARSER.extract(cut).calls == []  # taken as text when not known to be cut short
    out = PARSER.extract(cut, truncated=True)
    assert out.content is None and [(c.name, c.arguments) for c in out.calls] == [("f", '{"a": 1}')]
    assert PARSER.extract(cut[:30], truncated=True).content == cut[:30]  # nothing complete: all text
    assert _calls(call) == [(c.name, c.arguments) for c in PARSER.extract(call, truncated=True).calls]


def _stream(text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    return stream(PARSER.streamer(), text, rng)


@pytest.mark.parametrize("text", OUTPUTS)
def test_streaming_reassembles_to_the_same_calls(text: str) -> None:
    rng = random.Random(0)
    expected = PARSER.extract(text)
    for _ in range(60):
        content, calls = _stream(text, rng)
        assert calls == [(c.name, c.arguments) for c in expected.calls]
        assert content == (expected.content or "")


def test_streaming_sends_name_before_arguments_complete() -> None:
    streamer = PARSER.streamer()
    text = '<tool_call>\n{"name": "f", "arguments": {"city": "Pa'
    deltas = [streamer.feed(ch) for ch in text]
    names = [d for delta in deltas for d in delta.calls if d.name]
    assert [d.name for d in names] == ["f"]
    args = "".join(d.arguments for delta in deltas for d in delta.calls)
    assert args == '{"city": "Pa'
    assert "".join(delta.content for delta in deltas) == ""


def test_streaming_holds_back_a_partial_tag() -> None:
    streamer = PARSER.streamer()
    assert streamer.feed("Hi <tool").content == "Hi"
    assert streamer.feed("bar").content == " <toolbar"
    assert streamer.feed(" ", final=True).content == " "


def test_scan_partial_literals() -> None:
    calls, complete = scan_calls('{"name": "f", "arguments": {"a": tru', final=False)
    assert calls[0].name == "f" and calls[0].arguments == '{"a": tru' and not complete
    calls, complete = scan_calls('{"name": "f", "arguments": 12', final=False)
    assert calls[0].arguments == "" and not complete
    calls, complete = scan_calls('{"name": "f", "arguments": x', final=False)
    assert not complete


# ---------------------------------------------------------------------- the forcing grammar
def test_constraint_admits_only_valid_calls(matcher_factory) -> None:
    schema = {
        "type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
            "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False,
    }  # fmt: skip
    one = PARSER.constraint(schema, multiple=False).grammar
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert matcher_factory(one, good)
    assert not matcher_factory(one, good.replace("get_weather", "get_time"))
    assert not matcher_factory(one, good.replace('"city"', '"town"'))
    assert not matcher_factory(one, good + "\n" + good)
    many = PARSER.constraint(schema, multiple=True).grammar
    assert matcher_factory(many, good + "\n" + good)
    assert _calls(good) == [("get_weather", '{"city": "Paris"}')]
