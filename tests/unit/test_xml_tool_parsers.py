"""The XML-argument tool-call formats (``--tool-call-parser glm45 | glm47 | minimax_m2``): whole
outputs with values typed by the request's tool schemas, streaming in every chunking (the
deltas add up to the non-streamed calls and content), outputs cut short, malformed outputs
left as content, and the grammars that force a call accepting what ``render_calls`` writes."""

from __future__ import annotations

import json
import random

import pytest

from pagoda.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from tests.unit.tool_streams import check_extract, stream

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "configure", "parameters": {
        "type": "object", "properties": {
            "label": {"type": "string"}, "ratio": {"type": "number"}, "on": {"type": "boolean"},
            "opts": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
            "note": {"type": ["string", "null"]}}}}},
]


def glm45(name: str, pairs: list[tuple[str, str]]) -> str:
    """A call as GLM-4.5's template writes it."""
    return (f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in pairs)
            + "</tool_call>")


def glm47(name: str, pairs: list[tuple[str, str]]) -> str:
    """... and as GLM-4.7's does (no newlines)."""
    pairs_text = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in pairs)
    return f"<tool_call>{name}{pairs_text}</tool_call>"


def minimax(*invokes: tuple[str, list[tuple[str, str]]]) -> str:
    """One MiniMax-M2 block of calls, as its template writes them."""
    body = "".join(f'<invoke name="{n}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in pairs)
                   + "</invoke>\n" for n, pairs in invokes)
    return f"<minimax:tool_call>\n{body}</minimax:tool_call>"


WEATHER = [("city", "Paris"), ("days", "3")]
CONFIG = [("label", "1234"), ("ratio", "1.5"), ("on", "true"), ("opts", '{"a": [1, {"b": null}]}'),
          ("tags", '["x", "y"]'), ("note", "null"), ("extra", "not json <b>")]
CONFIG_ARGS = ('{"label": "1234", "ratio": 1.5, "on": true, "opts": {"a": [1, {"b": null}]}, "tags": ["x", "y"], '
               '"note": null, "extra": "not json <b>"}')
WEATHER_ARGS = '{"city": "Paris", "days": 3}'
CODE = "def f(x):\n    return x < 2 and {'a': 1}\n"   # a string value: raw text, newlines and all

# (parser, output, expected content, expected calls as (name, arguments JSON); None: all content)
CASES = [
    ("glm45", "Let me check.\n" + glm45("get_weather", WEATHER), "Let me check.", [("get_weather", WEATHER_ARGS)]),
    ("glm45", glm45("get_weather", WEATHER) + "\n" + glm45("configure", CONFIG), None,
     [("get_weather", WEATHER_ARGS), ("configure", CONFIG_ARGS)]),
    ("glm45", "\n" + glm45("ping", []), None, [("ping", "{}")]),
    ("glm45", glm45("configure", [("label", CODE)]), None, [("configure", json.dumps({"label": CODE}))]),
    ("glm45", glm47("get_weather", WEATHER) + glm47("ping", []), None, [("get_weather", WEATHER_ARGS), ("ping", "{}")]),
    ("glm47", glm47("get_weather", WEATHER) + glm47("configure", CONFIG), None,
     [("get_weather", WEATHER_ARGS), ("configure", CONFIG_ARGS)]),
    ("glm47", "Sure. " + glm45("get_weather", WEATHER), "Sure.", [("get_weather", WEATHER_ARGS)]),
    ("glm45", "No tools here, a < b.", "No tools here, a < b.", []),
    ("minimax_m2", "Checking.\n" + minimax(("get_weather", WEATHER), ("configure", CONFIG)), "Checking.",
     [("get_weather", WEATHER_ARGS), ("configure", CONFIG_ARGS)]),
    ("minimax_m2", minimax(("get_weather", WEATHER)) + "\n" + minimax(("ping", [])), None,
     [("get_weather", WEATHER_ARGS), ("ping", "{}")]),
    ("minimax_m2", minimax(("configure", [("label", "\n" + CODE + "\n")])), None,
     [("configure", json.dumps({"label": CODE}))]),
    ("minimax_m2", "<minimax:tool_call>\n<invoke name='ping'>\n</invoke>", None, [("ping", "{}")]),  # stopped at EOS
    ("minimax_m2", "No tools.", "No tools.", []),
    # Malformed: the whole output is the content.
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</tool_call>", None, None),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n", None, None),
    ("glm45", '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>', None, None),   # Hermes' JSON
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>Paris\n</tool_call>", None, None),
    ("glm45", glm45("ping", []) + " and then some text", None, None),
    ("glm47", "<tool_call>get_weather<arg_key></arg_key><arg_value>x</arg_value></tool_call>", None, None),
    ("minimax_m2", "<minimax:tool_call>\n</minimax:tool_call>", None, None),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">1</invoke>\n</minimax:tool_call>',
     None, None),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">1</parameter>\n', None, None),
    ("minimax_m2", "<minimax:tool_call>\n<invoke>\n</invoke>\n</minimax:tool_call>", None, None),
    ("minimax_m2", minimax(("ping", [])) + "\nDone.", None, None),
]


def _parser(name: str):
    return get_tool_parser(name).for_tools(TOOLS)


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_extract(name, text, content, calls) -> None:
    check_extract(_parser(name), text, content, calls)


def _chunkings(text: str):
    """Every split into two pieces (an empty one included), and one character at a time."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text) + [""]


def _streamed(streamer, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The content and calls (name, arguments) that feeding ``pieces`` sends; names once, in order."""
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        delta = streamer.feed(piece, final=k == len(pieces) - 1)
        content += delta.content
        for d in delta.calls:
            if d.name is not None:
                assert d.index == len(calls), "names come once, in order"
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    assert streamer.num_calls == len(calls)
    return content, [tuple(calls[k]) for k in sorted(calls)]


@pytest.mark.parametrize("name, text, content, calls", [c for c in CASES if c[3] is not None])
def test_streaming_in_every_chunking_adds_up_to_extract(name, text, content, calls) -> None:
    parser = _parser(name)
    for pieces in _chunkings(text):
        assert _streamed(parser.streamer(), pieces) == (content or "", calls), pieces
    rng = random.Random(7)
    for _ in range(20):   # random pieces of 1..7 characters
        got_content, got_calls = stream(parser.streamer(), text, rng, max_step=7)
        assert (got_content, got_calls) == (content or "", calls)


@pytest.mark.parametrize("name, text", [
    ("glm45", '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'),
    ("glm45", "Hi <tool_call>"),
    ("minimax_m2", "Well, <minimax:tool_call>\n</minimax:tool_call>"),
    ("minimax_m2", "<minimax:tool_call>\n<invoke>\n</invoke>\n</minimax:tool_call>"),
])
def test_streaming_blocks_that_hold_no_call_end_as_the_whole_content(name, text) -> None:
    for pieces in _chunkings(text):
        assert _streamed(_parser(name).streamer(), pieces) == (text, [])
    assert _parser(name).extract(text).content == text


def test_streaming_sends_the_name_first_then_a_parameter_at_a_time() -> None:
    streamer = _parser("glm45").streamer()
    assert streamer.feed("Let me see <tool_").content == "Let me see"   # a partial tag, and the space, wait
    delta = streamer.feed("call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par")
    assert delta.content == "" and [(d.name, d.arguments) for d in delta.calls] == [("get_weather", "")]
    assert streamer.feed("is</arg_value>\n<arg_key>days").calls[0].arguments == '{"city": "Paris"'
    assert streamer.feed("</arg_key>\n<arg_value>3").calls == []   # (the value may go on: 3, 30, ...)
    assert streamer.feed("</arg_value>\n").calls[0].arguments == ', "days": 3'
    assert streamer.feed("</tool_call>", final=True).calls[0].arguments == "}"
    assert streamer.num_calls == 1

    streamer = _parser("minimax_m2").streamer()
    delta = streamer.feed('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="days">')
    assert [(d.name, d.arguments) for d in delta.calls] == [("get_weather", "")]
    assert streamer.feed("4</parameter>\n").calls[0].arguments == '{"days": 4'
    delta = streamer.feed('</invoke>\n<invoke name="ping"></invoke></minimax:tool_call>', final=True)
    assert [(d.index, d.name, d.arguments) for d in delta.calls] == [(0, None, "}"), (1, "ping", "{}")]


def test_values_are_typed_by_the_schema_only_when_the_request_has_tools() -> None:
    text = glm45("get_weather", [("city", "1234"), ("days", "3")])
    typed = _parser("glm45").extract(text).calls[0]
    untyped = get_tool_parser("glm45").extract(text).calls[0]
    assert json.loads(typed.arguments) == {"city": "1234", "days": 3}
    assert json.loads(untyped.arguments) == {"city": 1234, "days": 3}   # no schema: JSON where it parses
    # A value that does not parse as its type is kept as text rather than failing the call.
    bad = _parser("minimax_m2").extract(minimax(("get_weather", [("days", "three")])))
    assert json.loads(bad.calls[0].arguments) == {"days": "three"}
    # ["string", "null"]: null is null, anything else the text as written.
    note = _parser("glm47").extract(glm47("configure", [("note", '"quoted"')])).calls[0]
    assert json.loads(note.arguments) == {"note": '"quoted"'}


@pytest.mark.parametrize("name, text", [(c[0], c[1]) for c in CASES if c[3]])
def test_every_prefix_reads_without_raising(name, text) -> None:
    """An output cut anywhere: its complete calls or all content, never an exception."""
    parser = _parser(name)
    for i in range(len(text) + 1):
        prefix = text[:i]
        out = parser.extract(prefix)
        assert out.calls or out.content == (prefix or None)
        cut_short = parser.extract(prefix, truncated=True)
        assert all(json.loads(c.arguments) is not None for c in cut_short.calls)
        assert cut_short.calls or cut_short.content == (prefix or None)
        parser.extract_cut(prefix)


def test_cut_short_keeps_the_complete_calls() -> None:
    parser = _parser("glm45")
    text = glm45("get_weather", WEATHER) + "\n<tool_call>configure\n<arg_key>ratio</arg_key>\n<arg_value>2</arg_value>"
    assert parser.extract(text).calls == []
    out = parser.extract(text, truncated=True)
    assert [(c.name, c.arguments) for c in out.calls] == [("get_weather", WEATHER_ARGS)]
    cut = parser.extract_cut(text)   # a forced call cut by max_tokens: its arguments as far as they got
    assert [(c.name, c.arguments) for c in cut.calls] == [("get_weather", WEATHER_ARGS), ("configure", '{"ratio": 2')]
    mm = _parser("minimax_m2").extract(minimax(("get_weather", WEATHER))[:-30], truncated=True)
    assert mm.calls == [] and mm.content is not None


@pytest.mark.parametrize("name", ["glm45", "glm47", "minimax_m2"])
def test_calls_render_as_the_parser_reads_them(name) -> None:
    args = {"city": "Oslo", "days": 2, "deep": {"a": [True, None]}, "code": CODE}
    calls = [{"function": {"name": "get_weather", "arguments": json.dumps(args)}},
             {"function": {"name": "ping", "arguments": {}}}]
    parser = _parser(name)
    text = parser.render_calls("Calling.", calls)
    out = parser.extract(text)
    assert out.content == "Calling."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", args), ("ping", {})]
    assert "<tools>" in parser.system_prompt(TOOLS) and "get_weather" in parser.system_prompt(TOOLS)
    assert "42" in parser.render_results(["42"])
    assert name in TOOL_PARSERS


def _schema(names: list[str]) -> dict:
    from pagoda.entrypoints.openai.tools import ChatTool, call_schema

    tools = [ChatTool.model_validate(t) for t in TOOLS if t["function"]["name"] in names]
    if len(tools) == 1:
        return call_schema(tools[0])
    return {"anyOf": [call_schema(t, f"#/anyOf/{i}/properties/arguments") for i, t in enumerate(tools)]}


@pytest.mark.parametrize("name", ["glm45", "glm47", "minimax_m2"])
def test_forcing_grammar_accepts_the_rendered_calls_and_only_valid_ones(matcher_factory, name) -> None:
    parser = get_tool_parser(name)
    weather = {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}
    config = {"function": {"name": "configure", "arguments": {
        "label": "a b", "ratio": 0.5, "on": False, "opts": {"k": [1]}, "tags": ["x"], "note": None}}}
    one = parser.constraint(_schema(["get_weather"]), multiple=False).grammar
    assert matcher_factory(one, parser.render_calls(None, [weather]))
    only_city = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert matcher_factory(one, parser.render_calls(None, [only_city]))   # days is optional
    no_city = {"function": {"name": "get_weather", "arguments": {"days": 3}}}
    assert not matcher_factory(one, parser.render_calls(None, [no_city]))   # city is required
    assert not matcher_factory(one, parser.render_calls(None, [weather]).replace(">3<", ">three<"))
    assert not matcher_factory(one, parser.render_calls(None, [weather]).replace("get_weather", "get_time"))
    assert not matcher_factory(one, parser.render_calls(None, [weather, weather]))   # one call only
    both = parser.constraint(_schema(["get_weather", "configure"]), multiple=True).grammar
    text = parser.render_calls(None, [config, weather])
    assert matcher_factory(both, text)
    assert [c.name for c in parser.for_tools(TOOLS).extract(text).calls] == ["configure", "get_weather"]
    assert json.loads(parser.for_tools(TOOLS).extract(text).calls[0].arguments) == config["function"]["arguments"]


def test_forcing_grammar_resolves_references_to_the_parameters_defs(matcher_factory) -> None:
    from pagoda.entrypoints.openai.tools import ChatTool, call_schema

    tool = ChatTool.model_validate({"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "$defs": {"Item": {"type": "object", "properties": {"n": {"type": "integer"}},
                                             "required": ["n"], "additionalProperties": False}},
        "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"]}}})
    parser = get_tool_parser("minimax_m2")
    grammar = parser.constraint(call_schema(tool), multiple=False).grammar
    good = parser.render_calls(None, [{"function": {"name": "add", "arguments": {"item": {"n": 1}}}}])
    assert matcher_factory(grammar, good)
    assert not matcher_factory(grammar, good.replace('{"n": 1}', '{"n": "1"}'))
