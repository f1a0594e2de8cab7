"""The tool-call formats beside Hermes (``--tool-call-parser mistral | llama3_json | granite |
deepseek_v3 | deepseek_v31 | kimi_k2``): whole outputs, streaming (deltas reassemble to the
same calls and content), outputs cut short, and the grammars that force a call."""

from __future__ import annotations

import json
import random

import pytest

from pagoda.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from tests.unit.tool_streams import check_extract, stream

WEATHER = {"city": "Paris", "days": [1, 2], "x": {"y": "}{\\\"[TOOL_CALLS]"}}

# (parser, output, expected content, expected calls as (name, arguments JSON))
DS_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
DS31_CALL = "<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"
KIMI_CALL = "<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


def _section(fmt: str, begin: str, end: str, calls: list[tuple[str, str]]) -> str:
    return begin + "".join(fmt.format(name=n, args=a, i=i) for i, (n, a) in enumerate(calls)) + end


QC = ("Let me see.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n"
      "<parameter=days>\n{days}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n"
      '<parameter=q>\na <b> "c"\n</parameter>\n<parameter=filters>\n{{"x": [1]}}\n</parameter>\n</function>\n'
      "</tool_call>")
DS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
KIMI = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
TWO = [("get_weather", json.dumps(WEATHER)), ("search", '{"q": "<｜tool▁call▁end｜>", "n": 3}')]

CASES = [
    ("deepseek_v3", "Let me check." + _section(DS_CALL, *DS, TWO), "Let me check.", TWO),
    ("deepseek_v3", "No tools.", "No tools.", []),
    ("deepseek_v3", _section(DS_CALL, *DS, TWO)[:-len(DS[1])], None, TWO),   # stopped at EOS before the end
    ("deepseek_v3", DS[0] + "<｜tool▁call▁begin｜>nonsense<｜tool▁call▁end｜>" + DS[1], None, None),
    ("deepseek_v31", _section(DS31_CALL, *DS, TWO), None, TWO),
    ("kimi_k2", "Sure. " + _section(KIMI_CALL, *KIMI, TWO), "Sure.", TWO),
    ("kimi_k2", _section(KIMI_CALL, *KIMI, [("f", "{}")]), None, [("f", "{}")]),
    ("granite", '<|tool_call|>[{"name": "f", "arguments": {"a": [1, 2]}}]', None, [("f", '{"a": [1, 2]}')]),
    ("qwen3_coder", QC.format(city="Paris", days="3"), "Let me see.",
     [("get_weather", '{"city": "Paris", "days": 3}'), ("search", '{"q": "a <b> \\"c\\"", "filters": {"x": [1]}}')]),
    ("qwen3_coder", "<tool_call>\n<function=f>\n</function>\n</tool_call>", None, [("f", "{}")]),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>", None, [("f", '{"x": 1}')]),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=x>\n1\n</function>\n</tool_call>", None, None),
    ("mistral", "Hello there, no tools here.", "Hello there, no tools here.", []),
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}]', None,
     [("get_weather", json.dumps(WEATHER))]),
    ("mistral", 'Let me look. [TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": 1.5}}]',
     "Let me look.", [("a", "{}"), ("b", '{"k": 1.5}')]),
    ("mistral", '[TOOL_CALLS] [{"name": "no_args"}]', None, [("no_args", "{}")]),
    ("mistral", '[TOOL_CALLS][{"name": "broken", "arguments": {"a": }]', None, None),   # not calls: content
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"n": -1}}; {"name": "b", "parameters": {}}', None,
     [("a", '{"n": -1}'), ("b", "{}")]),
    ("llama3_json", "  The answer is 4.", "  The answer is 4.", []),
    ("llama3_json", 'Sure: {"name": "a", "parameters": {}}', 'Sure: {"name": "a", "parameters": {}}', []),
    ("llama3_json", '{"name": "a", "parameters": {}} and more', None, None),
]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_extract(name, text, content, calls) -> None:
    check_extract(get_tool_parser(name), text, content, calls)


def _stream(name: str, text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    return stream(get_tool_parser(name).streamer(), text, rng, max_step=5)


@pytest.mark.parametrize("name, text, content, calls", [c for c in CASES if c[3] is not None])
def test_streaming_reassembles_the_same_calls(name, text, content, calls) -> None:
    rng = random.Random(7)
    for _ in range(5):
        got_content, got_calls = _stream(name, text, rng)
        assert got_content.strip() == (content or "").strip()
        assert got_calls == calls


def test_streaming_holds_back_a_partial_marker_and_sends_names_first() -> None:
    streamer = get_tool_parser("mistral").streamer()
    assert streamer.feed("Hi [TOOL_").content == "Hi "
    delta = streamer.feed('CALLS][{"name": "f", "arguments": {"a": 1')
    assert delta.content == "" and delta.calls[0].name == "f" and delta.calls[0].arguments == '{"a": 1'
    assert streamer.feed('}}]', final=True).calls[0].arguments == "}"
    assert streamer.num_calls == 1


def test_cut_short_keeps_the_complete_calls() -> None:
    parser = get_tool_parser("mistral")
    text = '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"q": "unfini'
    out = parser.extract(text, truncated=True)
    assert [(c.name, c.arguments) for c in out.calls] == [("a", "{}")]
    cut = parser.extract_cut(text)
    assert [(c.name, c.arguments) for c in cut.calls] == [("a", "{}"), ("b", '{"q": "unfini')]


def test_calls_render_as_the_parser_reads_them() -> None:
    call = [{"function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]
    for name in ("mistral", "llama3_json", "granite", "deepseek_v3", "deepseek_v31", "kimi_k2", "qwen3_coder"):
        parser = get_tool_parser(name)
        out = parser.extract(parser.render_calls(None, call))
        assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", {"city": "Oslo"})]
    assert set(TOOL_PARSERS) >= {"hermes", "mistral", "llama3_json", "granite", "deepseek_v3", "deepseek_v31",
                                 "kimi_k2", "qwen3_coder"}


def test_constraints_admit_only_valid_calls(matcher_factory) -> None:
    from pagoda.entrypoints.openai.tools import ChatTool, call_schema

    tools = [ChatTool.model_validate({"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}) for n in ("f", "g")]
    schema = {"anyOf": [call_schema(t, f"#/anyOf/{i}/properties/arguments") for i, t in enumerate(tools)]}
    mistral = get_tool_parser("mistral")
    good = '[TOOL_CALLS][{"name": "f", "arguments": {"city": "Paris"}}]'
    assert matcher_factory(mistral.constraint(schema, multiple=False).grammar, good)
    assert not matcher_factory(mistral.constraint(schema, multiple=False).grammar, good.replace('"f"', '"h"'))
    two = '[TOOL_CALLS][{"name": "f", "arguments": {"city": "Paris"}}, {"name": "g", "arguments": {"city": "Rome"}}]'
    assert matcher_factory(mistral.constraint(schema, multiple=True).grammar, two)
    assert not matcher_factory(mistral.constraint(schema, multiple=False).grammar, two)
    llama = get_tool_parser("llama3_json")
    good = '{"name": "g", "parameters": {"city": "Paris"}}'
    assert matcher_factory(llama.constraint(schema, multiple=False).grammar, good)
    assert not matcher_factory(llama.constraint(schema, multiple=False).grammar,
                               good.replace("parameters", "arguments"))
    assert matcher_factory(llama.constraint(schema, multiple=True).grammar, good + "; " + good)
    assert [c.name for c in llama.extract(good + "; " + good).calls] == ["g", "g"]


def test_delimited_constraints_admit_only_valid_calls(matcher_factory) -> None:
    from pagoda.entrypoints.openai.tools import ChatTool, call_schema

    tool = ChatTool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    schema = call_schema(tool)
    for name, fmt, section in (("kimi_k2", KIMI_CALL, KIMI), ("deepseek_v3", DS_CALL, DS)):
        parser = get_tool_parser(name)
        good = _section(fmt, *section, [("f", '{"city": "Paris"}')])
        assert matcher_factory(parser.constraint(schema, multiple=False).grammar, good), name
        assert not matcher_factory(parser.constraint(schema, multiple=False).grammar, good.replace('"city"', '"x"'))
        two = _section(fmt, *section, [("f", '{"city": "Paris"}')] * 2).replace(":1<", ":0<")
        assert matcher_factory(parser.constraint(schema, multiple=True).grammar, two), name
        assert [c.name for c in parser.extract(two).calls] == ["f", "f"]


@pytest.mark.parametrize("template, want", [
    ("{% for m in messages %}<tool_call>{{ m }}</tool_call>{% endfor %}", "hermes"),
    ("{{ '[TOOL_CALLS]' + tool_calls|tojson }}", "mistral"),
    ('{{- "<|python_tag|>" + tool_call.name }} "parameters"', "llama3_json"),
    ("<|tool_call|>{{ tools }}", "granite"),
    ("{{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n```json\\n'}}", "deepseek_v3"),
    ("{{'<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + arguments}}", "deepseek_v31"),
    ("<|tool_calls_section_begin|>{{ calls }}", "kimi_k2"),
    # GLM's templates write "<tool_call>" too: their argument tags must win over Hermes'.
    ("{{ '\\n<tool_call>' + tc.name }}\n<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}</arg_value>\n</tool_call>",
     "glm45"),
    ("{{- '<tool_call>' ~ tc.name -}}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value></tool_call>", "glm47"),
    ("{%- set toolcall_begin_token = '<minimax:tool_call>' -%}<invoke name=\"{{ name }}\">", "minimax_m2"),
    ("{{ messages }}", "hermes"),
    (None, "hermes"),
])
def test_auto_picks_the_parser_the_template_writes(template, want) -> None:
    from pagoda.entrypoints.openai.tool_parsers import choose_tool_parser

    name, why = choose_tool_parser(template)
    assert name == want and why


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}


def test_qwen3_coder_types_values_by_the_tools_schema() -> None:
    """A string parameter stays text even when it reads as JSON; a number is a number."""
    parser = get_tool_parser("qwen3_coder").for_tools([WEATHER_TOOL])
    out = parser.extract(QC.format(city="1234", days="3"))
    assert json.loads(out.calls[0].arguments) == {"city": "1234", "days": 3}
    untyped = get_tool_parser("qwen3_coder").extract(QC.format(city="1234", days="3"))
    assert json.loads(untyped.calls[0].arguments) == {"city": 1234, "days": 3}
    streamer = parser.streamer()
    text, args = QC.format(city="1234", days="3"), ""
    for i in range(0, len(text), 3):
        for d in streamer.feed(text[i:i + 3], final=i + 3 >= len(text)).calls:
            if d.index == 0:
                args += d.arguments
    assert args == out.calls[0].arguments


def test_qwen3_coder_constraint_admits_only_valid_calls(matcher_factory) -> None:
    from pagoda.entrypoints.openai.tools import ChatTool, call_schema

    schema = call_schema(ChatTool.model_validate(WEATHER_TOOL))
    parser = get_tool_parser("qwen3_coder")
    good = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    grammar = parser.constraint(schema, multiple=False).grammar
    assert matcher_factory(grammar, good)
    assert matcher_factory(grammar, good.replace("<parameter=days>\n3\n</parameter>\n", ""))
    assert not matcher_factory(grammar, good.replace("3", "three"))
    assert not matcher_factory(grammar, good.replace("<parameter=city>\nParis\n</parameter>\n", ""))
    assert [c.name for c in parser.extract(good).calls] == ["get_weather"]
