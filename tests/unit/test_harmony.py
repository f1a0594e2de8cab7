"""GPT-OSS's Harmony format (pagoda/reasoning/harmony.py, the ``openai_gptoss`` reasoning
parser, the ``openai`` tool parser): prompts rendered as the Harmony specification writes them
(its examples are the fixtures here), outputs read into reasoning, content and calls, the same
in every chunking of a stream, malformed outputs kept as text, and the grammars that force a
call or a format. Compared with the ``openai-harmony`` library and GPT-OSS's own chat template
where those are on the machine."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import pytest

from pagoda.reasoning.harmony import (
    CALL,
    END,
    MARKERS,
    RETURN,
    START,
    HarmonyMessage,
    HarmonyRenderError,
    HarmonyStreamParser,
    collect,
    is_harmony,
    parse,
    render_prompt,
)
from pagoda.entrypoints.openai.tool_parsers import choose_tool_parser, get_tool_parser
from pagoda.reasoning import count_reasoning_tokens, get_reasoning_parser
from pagoda.sampling_params import StructuredOutputsParams
from tests.harmony_tokenizer import harmony_tokenizer
from tests.unit.conftest import grammar_acceptor
from tests.unit.tool_streams import stream

REASONING = get_reasoning_parser("openai_gptoss")
TOOLS = get_tool_parser("openai")
OFFICIAL_TEMPLATE = os.path.expanduser("~/.cache/pagoda-bench/src/llama_cpp_python-0.3.36/vendor/llama.cpp/"
                                       "models/templates/openai-gpt-oss-120b.jinja")  # fmt: skip

# ---------------------------------------------------------------------- the specification's examples
FORMAT = {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}
SPEC_TOOLS = [
    {"type": "function", "function": {"name": "get_location", "description": "Gets the location of the user."}},
    {"type": "function", "function": {
        "name": "get_current_weather", "description": "Gets the current weather in the provided location.",
        "parameters": {"type": "object", "required": ["location"], "properties": {
            "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
            "format": FORMAT}}}},
    {"type": "function", "function": {
        "name": "get_multiple_weathers", "description": "Gets the current weather in the provided list of locations.",
        "parameters": {"type": "object", "required": ["locations"], "properties": {
            "locations": {"type": "array", "items": {"type": "string"},
                          "description": 'List of city and state, e.g. ["San Francisco, CA", "New York, NY"]'},
            "format": FORMAT}}}},
]  # fmt: skip
SYSTEM = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
          "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: {effort}\n\n"
          "# Valid channels: analysis, commentary, final. Channel must be included for every message.{note}<|end|>")
FUNCTIONS_NOTE = "\nCalls to these tools must go to the commentary channel: 'functions'."
SPEC_DEVELOPER = (
    "<|start|>developer<|message|># Instructions\n\nUse a friendly tone.\n\n# Tools\n\n## functions\n\n"
    "namespace functions {\n\n"
    "// Gets the location of the user.\ntype get_location = () => any;\n\n"
    "// Gets the current weather in the provided location.\ntype get_current_weather = (_: {\n"
    "// The city and state, e.g. San Francisco, CA\nlocation: string,\n"
    'format?: "celsius" | "fahrenheit", // default: celsius\n}) => any;\n\n'
    "// Gets the current weather in the provided list of locations.\ntype get_multiple_weathers = (_: {\n"
    '// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]\nlocations: string[],\n'
    'format?: "celsius" | "fahrenheit", // default: celsius\n}) => any;\n\n'
    "} // namespace functions<|end|>"
)
ASK_SF = {"role": "user", "content": "What is the weather like in SF?"}
THOUGHT = "Need to use function get_weather."
WEATHER_CALL = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"location":"San Francisco"}'}}  # fmt: skip


def render(messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return render_prompt(messages, today="2025-06-28", **kwargs)


def test_renders_the_specifications_function_calling_prompt() -> None:
    prompt = render([{"role": "system", "content": "Use a friendly tone."}, ASK_SF], tools=SPEC_TOOLS,
                    reasoning_effort="high")  # fmt: skip
    want = SYSTEM.format(effort="high", note=FUNCTIONS_NOTE) + SPEC_DEVELOPER
    assert prompt == want + "<|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant"


def test_a_plain_conversation_has_no_developer_message_and_drops_earlier_reasoning() -> None:
    # The specification's "Handling reasoning output in subsequent sampling".
    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4.",
         "reasoning_content": 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'},
        {"role": "user", "content": "What about 9 / 2?"},
    ]  # fmt: skip
    assert render(messages) == SYSTEM.format(effort="medium", note="") + (
        "<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|end|>"
        "<|start|>user<|message|>What about 9 / 2?<|end|><|start|>assistant")


def test_tool_results_keep_the_reasoning_of_the_turn_being_continued() -> None:
    # The specification's complete tool-call example (the call's header as vLLM and the model's template write it).
    messages = [{"role": "developer", "content": "Use a friendly tone."}, ASK_SF,
                {"role": "assistant", "content": None, "reasoning": THOUGHT, "tool_calls": [WEATHER_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true, "temperature": 20}'}]
    turn = ("<|start|>user<|message|>What is the weather like in SF?<|end|>"
            f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"location":"San Francisco"}<|call|>'
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
            '{"sunny": true, "temperature": 20}<|end|>')  # fmt: skip
    prompt = render(messages, tools=SPEC_TOOLS, reasoning_effort="high")
    assert prompt == SYSTEM.format(effort="high", note=FUNCTIONS_NOTE) + SPEC_DEVELOPER + turn + "<|start|>assistant"
    # Once the turn ended in a final answer, its reasoning is dropped; the call and its result stay.
    later = render(messages + [{"role": "assistant", "content": "Sunny, 20°C."},
                               {"role": "user", "content": "Tomorrow?"}], tools=SPEC_TOOLS, reasoning_effort="high")
    assert THOUGHT not in later
    assert later.endswith(turn.replace(f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|>", "")
                          + "<|start|>assistant<|channel|>final<|message|>Sunny, 20°C.<|end|>"
                          "<|start|>user<|message|>Tomorrow?<|end|><|start|>assistant")  # fmt: skip


def test_preambles_several_calls_and_their_results() -> None:
    calls = [{"id": "a", "function": {"name": "f", "arguments": {"x": 1}}},
             {"id": "b", "function": {"name": "g", "arguments": ""}}]
    messages = [{"role": "user", "content": "Go."},
                {"role": "assistant", "content": "Calling both.", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "b", "content": "B"},
                {"role": "tool", "tool_call_id": "a", "content": "A"}]  # fmt: skip
    prompt = render(messages)
    assert prompt.endswith(
        "<|start|>assistant<|channel|>commentary<|message|>Calling both.<|end|>"
        '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"x": 1}<|call|>'
        "<|start|>assistant to=functions.g<|channel|>commentary json<|message|>{}<|call|>"
        "<|start|>functions.g to=assistant<|channel|>commentary<|message|>B<|end|>"
        "<|start|>functions.f to=assistant<|channel|>commentary<|message|>A<|end|><|start|>assistant")
    # A built-in tool's call (as the parser returns it: named by its recipient) goes back as that tool's.
    builtin = render([{"role": "user", "content": "Run it."},
                      {"role": "assistant", "tool_calls": [{"id": "p", "function": {"name": "python",
                                                                                     "arguments": "print(4)"}}]},
                      {"role": "tool", "tool_call_id": "p", "content": "4"}])  # fmt: skip
    assert builtin.endswith("<|start|>assistant to=python<|channel|>analysis code<|message|>print(4)<|call|>"
                            "<|start|>python to=assistant<|channel|>analysis<|message|>4<|end|><|start|>assistant")


def test_instructions_and_system_messages() -> None:
    prompt = render([{"role": "system", "content": "One."}, {"role": "developer", "content": [
        {"type": "text", "text": "Two"}, {"type": "text", "text": "parts."}]}, {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Later."}], instructions="Zero.", model_identity="You are Pagoda.")
    assert prompt.startswith("<|start|>system<|message|>You are Pagoda.\nKnowledge cutoff: 2024-06\n")
    assert "<|start|>developer<|message|># Instructions\n\nZero.\n\nOne.\n\nTwo\nparts.<|end|>" in prompt
    assert prompt.endswith("<|start|>user<|message|>Hi<|end|>"
                           "<|start|>developer<|message|># Instructions\n\nLater.<|end|><|start|>assistant")


def test_a_continued_last_message_keeps_its_reasoning() -> None:
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hel", "reasoning_content": "Greet."}]
    prompt = render(messages, add_generation_prompt=False)
    assert prompt.endswith("<|start|>assistant<|channel|>analysis<|message|>Greet.<|end|>"
                           "<|start|>assistant<|channel|>final<|message|>Hel<|end|>")


@pytest.mark.parametrize("messages, error", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text only"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c", "content": "r"}], "must follow"),
    ([{"role": "robot", "content": "x"}], "robot"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], "function name"),
])  # fmt: skip
def test_what_cannot_be_rendered(messages: list[dict[str, Any]], error: str) -> None:
    with pytest.raises(HarmonyRenderError, match=error):
        render(messages)
    with pytest.raises(HarmonyRenderError, match="effort"):
        render([{"role": "user", "content": "x"}], reasoning_effort="max")


def test_schemas_as_typescript() -> None:
    parameters = {"type": "object", "required": ["filter"], "properties": {
        "filter": {"type": "object", "required": ["min"], "properties": {
            "min": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}},
        "ids": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": ["string", "integer"]}}}},
        "flag": {"type": "boolean", "default": False},
        "name": {"type": "string", "nullable": True, "title": "Name", "examples": ["Ann"], "default": "x"},
        "loose": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "either": {"description": "A or 1", "default": 1, "oneOf": [{"type": "string", "description": "a name"},
                                                                    {"type": "integer", "default": 2}]},
    }}  # fmt: skip
    prompt = render([], tools=[{"type": "function", "function": {"name": "search", "parameters": parameters}},
                               {"type": "function", "function": {"name": "ping", "description": "Two\nlines.",
                                                                 "parameters": {"type": "object", "properties": {}}}}])
    assert ("namespace functions {\n\ntype search = (_: {\n"
            "filter: {\n    min: number,\n    tags?: string[],\n    },\n"
            "ids?: {\n    id?: string | number,\n    }[],\n"
            "flag?: boolean, // default: false\n"
            '// Name\n//\n// Examples:\n// - "Ann"\nname?: string | null, // default: "x"\n'
            "loose?: any,\n"
            # (the first alternative's own description gives way to the property's, above it)
            "// A or 1\n// default: 1\neither?:\n | string\n | number // default: 2\n,\n"
            "}) => any;\n\n// Two\n// lines.\ntype ping = () => any;\n\n} // namespace functions") in prompt


# ---------------------------------------------------------------------- reading outputs
SPEC_ANSWER = ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
               "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.")  # fmt: skip
SPEC_CALL = (f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>commentary "
             'to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}')
PLAN = "**Action plan**:\n1. Generate an HTML file\n2. Generate a JavaScript for the Node.js server\n---\nStep by step"
SPEC_PREAMBLE = (f"<|channel|>analysis<|message|>Long thought.<|end|><|start|>assistant<|channel|>commentary"
                 f"<|message|>{PLAN}<|end|><|start|>assistant<|channel|>commentary to=functions.generate_file"
                 '<|constrain|>json<|message|>{"template": "basic_html", "path": "index.html"}')  # fmt: skip
TWO_CALLS = (' to=functions.a<|channel|>commentary json<|message|>{"x": 1}<|call|>'
             "<|start|>assistant to=functions.b<|channel|>commentary json<|message|>")
SEARCH = ('<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>analysis to=browser.search '
          '<|constrain|>json<|message|>{"query":"pagoda"}')  # fmt: skip

# (output, cut short, (reasoning, content, calls)) with the tool parser reading the content
CASES = [
    (SPEC_ANSWER, False, ('User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.", [])),
    (SPEC_CALL, False, (THOUGHT, None, [("get_weather", '{"location":"San Francisco"}')])),
    (SPEC_PREAMBLE, False, ("Long thought.", PLAN,
                            [("generate_file", '{"template": "basic_html", "path": "index.html"}')])),
    (TWO_CALLS, False, (None, None, [("a", '{"x": 1}'), ("b", "{}")])),
    (SEARCH, False, ("Look it up.", None, [("browser.search", '{"query":"pagoda"}')])),
    ("<|channel|>analysis to=python code<|message|>print(2 + 2)", False, (None, None, [("python", "print(2 + 2)")])),
    # Several analysis messages and answers: each part joined with newlines.
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
     "<|start|>assistant<|channel|>final<|message|>c<|end|><|start|>assistant<|channel|>final<|message|>d",
     False, ("a\nb", "c\nd", [])),
    # GPT-OSS-20B's stray "<|channel|>commentary" before the real channel.
    ("<|channel|>commentary to=assistant<|channel|>final<|message|>ok", False, (None, "ok", [])),
    # Cut short: a reasoning cut is reasoning so far; a call cut is no call.
    ("<|channel|>analysis<|message|>Let me th", True, ("Let me th", None, [])),
    (SPEC_CALL[:-10], True, (THOUGHT, None, [])),
    (SPEC_ANSWER.split("<|start|>")[0] + "<|start|>assistant<|channel|>fi", True,
     ('User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', None, [])),
    # Malformed: kept as the text it is.
    ("Just text, no channels.", False, (None, "Just text, no channels.", [])),
    ("Sure<|channel|>final<|message|>x", False, (None, "Sure<|channel|>final<|message|>x", [])),
    ("<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>yo", False,
     (None, "<|start|>user<|message|>hi\nyo", [])),
    ("<|channel|>final<|message|>a <|en b <|", False, (None, "a <|en b <|", [])),
    ("", False, (None, None, [])),
]


def read(text: str, cut: bool) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    split = REASONING.for_tools(True).extract(text)
    extracted = TOOLS.extract(split.content or "", truncated=cut)
    return split.reasoning, extracted.content, [(c.name, c.arguments) for c in extracted.calls]


@pytest.mark.parametrize("text, cut, want", CASES)
def test_outputs_are_read_into_reasoning_content_and_calls(text: str, cut: bool, want: tuple) -> None:
    assert read(text, cut) == want
    # Without tools (tool_choice none, or none offered) the calls are left out: the content is text alone.
    split = REASONING.extract(text)
    assert (split.reasoning, split.content) == want[:2]


def test_messages_of_an_output() -> None:
    assert parse(SPEC_CALL) == [
        HarmonyMessage("analysis", None, None, THOUGHT),
        HarmonyMessage("commentary", "functions.get_weather", "json", '{"location":"San Francisco"}'),
    ]
    [cut] = parse('<|channel|>final<|message|>{"a', cut=True)
    assert (cut.channel, cut.content, cut.complete) == ("final", '{"a', False)
    [malformed] = parse("Hello.")
    assert (malformed.well_formed, malformed.channel, malformed.content) == (False, None, "Hello.")
    assert parse("<|channel|>analys") == [] and parse("   ") == []   # a header cut short is markup, not text


def _chunkings(text: str, rng: random.Random) -> list[list[str]]:
    """``text`` cut at every offset into two pieces, and in random pieces of 1..7 characters."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(20):
        pieces, i = [], 0
        while i < len(text):
            step = rng.randint(1, 7)
            pieces.append(text[i:i + step])
            i += step
        out.append(pieces)
    return out


@pytest.mark.parametrize("text, cut, want", CASES)
def test_streams_add_up_to_the_finished_parse_in_every_chunking(text: str, cut: bool, want: tuple) -> None:
    rng = random.Random(7)
    finished = parse(text, cut)
    for keep_calls in (False, True):
        split = REASONING.for_tools(keep_calls).extract(text)
        for pieces in _chunkings(text, rng):
            parser, deltas = HarmonyStreamParser(), []
            streamer, reasoning, content = REASONING.for_tools(keep_calls).streamer(), "", ""
            for k, piece in enumerate(pieces):
                deltas += parser.feed(piece, final=k == len(pieces) - 1)
                d = streamer.feed(piece, final=k == len(pieces) - 1)
                reasoning, content = reasoning + d.reasoning, content + d.content
            assert collect(deltas, cut) == finished, pieces
            assert (reasoning or None, content or None) == (split.reasoning, split.content), pieces
    content = REASONING.for_tools(True).extract(text).content or ""
    if not cut:   # (a streamer cannot know that the output will be cut short: it sends what it reads)
        for _ in range(20):
            streamed, calls = stream(TOOLS.streamer(), content, rng)
            assert ((streamed or None), calls) == want[1:]


def test_anything_is_read_without_an_error() -> None:
    """Random outputs of markers, header words and text: each is read (into something), and the
    streams still add up to the finished parse."""
    rng = random.Random(3)
    atoms = [*MARKERS, "assistant", " to=functions.f", " to=python", " json", "analysis", "final", "commentary",
             "Hi", "{", '"', " ", "\n", "<|", "user", "to", "<"]  # fmt: skip
    for _ in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 14)))
        finished = parse(text)
        parser = HarmonyStreamParser()
        pieces = _chunkings(text, rng)[-1]
        deltas = [d for k, p in enumerate(pieces) for d in parser.feed(p, final=k == len(pieces) - 1)]
        assert collect(deltas) == finished, text
        for cut in (False, True):
            read(text, cut)
            TOOLS.extract_cut(REASONING.for_tools(True).extract(text).content or "")


def test_a_forced_call_cut_short_keeps_its_arguments_so_far() -> None:
    content = REASONING.for_tools(True).extract(SPEC_CALL[:-5]).content or ""
    cut = TOOLS.extract_cut(content)
    assert cut.content is None
    assert [(c.name, c.arguments) for c in cut.calls] == [("get_weather", '{"location":"San Franci')]


# ---------------------------------------------------------------------- the reasoning section
def test_reasoning_section_and_thinking_budget() -> None:
    text = "<|channel|>analysis<|message|>Hm"
    assert REASONING.in_reasoning(text) and REASONING.reasoning_end(text) is None
    closed = text + REASONING.end_of_reasoning
    assert not REASONING.in_reasoning(closed) and REASONING.reasoning_end(closed) == len(text) + len(END)
    split = REASONING.extract(closed + "4")
    assert (split.reasoning, split.content) == ("Hm", "4")
    assert not REASONING.in_reasoning("<|channel|>final<|message|>Hm") and REASONING.reasoning_end("Hi") is None
    tok = harmony_tokenizer()
    ids = tok.encode(SPEC_ANSWER, add_special_tokens=False)
    first = tok.encode(SPEC_ANSWER.split(END)[0] + END, add_special_tokens=False)
    assert count_reasoning_tokens(REASONING, ids, lambda t: tok.decode(t, skip_special_tokens=False)) == len(first)


# ---------------------------------------------------------------------- forcing grammars
@pytest.fixture(scope="module")
def accepts():
    """accepts(grammar, text): whether a grammar admits ``text`` as the Harmony markers' special tokens."""
    return grammar_acceptor(harmony_tokenizer())


def test_the_forcing_grammar_admits_calls_as_written_and_rendered(accepts) -> None:
    from pagoda.entrypoints.openai.tools import ChatTool, call_schema

    tools = [ChatTool.model_validate({"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}})
        for n in ("get_weather", "other")]  # fmt: skip
    schema = {"anyOf": [call_schema(t, f"#/anyOf/{i}/properties/arguments") for i, t in enumerate(tools)]}
    grammar = REASONING.constrain(TOOLS.constraint(schema, multiple=True)).grammar
    assert accepts(grammar, SPEC_CALL)                                          # as GPT-OSS writes it
    assert accepts(grammar, SPEC_CALL.split(END, 1)[1].removeprefix(START + "assistant"))   # no reasoning first
    rendered = render([ASK_SF, {"role": "assistant", "tool_calls": [WEATHER_CALL]}], add_generation_prompt=False)
    written = rendered.rsplit("<|start|>assistant", 1)[1].removesuffix(CALL)   # the renderer's form of a call
    assert written.startswith(" to=functions.get_weather") and accepts(grammar, written)
    preamble = f"<|channel|>commentary<|message|>{PLAN}<|end|><|start|>assistant"
    assert accepts(grammar, preamble + SPEC_CALL.split("<|start|>assistant", 1)[1])
    assert not accepts(grammar, SPEC_CALL.replace("get_weather", "nope"))
    assert not accepts(grammar, SPEC_CALL.replace('"location"', '"city"'))
    assert not accepts(grammar, SPEC_ANSWER)   # a final answer is no call
    [call] = TOOLS.extract(TOOLS.render_calls(None, [WEATHER_CALL])).calls
    assert (call.name, call.arguments) == ("get_weather", '{"location":"San Francisco"}')


def test_a_format_applies_to_the_final_message_after_free_reasoning(accepts) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = REASONING.constrain(StructuredOutputsParams(json=json.dumps(schema))).grammar
    assert accepts(grammar, '<|channel|>analysis<|message|>Count.<|end|><|start|>assistant<|channel|>final<|message|>'
                            '{"n": 4}')
    assert accepts(grammar, '<|channel|>final<|message|>{"n": 4}')
    assert not accepts(grammar, '<|channel|>final<|message|>{"n": "four"}')
    assert not accepts(grammar, '{"n": 4}')


# ---------------------------------------------------------------------- which models, which tokens
def test_harmony_models_are_recognized_and_stop_at_return_and_call() -> None:
    tok = harmony_tokenizer()
    assert is_harmony(tok) and is_harmony(harmony_tokenizer(chat_template=None))   # by the template, the vocabulary
    from pagoda.config import EngineConfig
    from pagoda.tokenizer import load_tokenizer

    assert not is_harmony(load_tokenizer(EngineConfig()))
    assert tok.eos_token_ids == {tok.token_to_id(RETURN), tok.token_to_id(CALL)}
    assert choose_tool_parser("{{ '<|start|>assistant<|channel|>final<|message|>' }}")[0] == "openai"
    if os.path.isfile(OFFICIAL_TEMPLATE):
        with open(OFFICIAL_TEMPLATE) as f:
            assert choose_tool_parser(f.read())[0] == "openai"


def test_a_gguf_harmony_vocabulary_ends_generation_at_return_and_call_not_end() -> None:
    """llama.cpp lists <|end|> among the texts that end generation; in GPT-OSS's vocabulary it only
    ends a message, and a reply would stop after its reasoning."""
    from pagoda.tokenizer import Tokenizer

    tokens = ["a", "b", "<|endoftext|>", RETURN, "<|start|>", END, "<|message|>", "<|channel|>", CALL]
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-4o", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": [1, 1] + [3] * 7, "tokenizer.ggml.merges": [],
                "tokenizer.ggml.eos_token_id": 3}  # fmt: skip
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert tok.eos_token_ids == {2, 3, 8} and 5 in tok.all_special_ids
    without = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.tokens": [*tokens[:8], "<|x|>"]})
    assert 5 in without.eos_token_ids   # (elsewhere, e.g. Phi-3, <|end|> does end the turn)


# ---------------------------------------------------------------------- the references, where they are here
def test_the_prompt_matches_gpt_oss_s_own_chat_template() -> None:
    """Where the two agree by design: tools, instructions, earlier answers, a call with its
    reasoning. (The template JSON-quotes tool results, writes a call's content as analysis and
    a comma after a parameter's default, where the Harmony renderer follows the specification
    and OpenAI's own renderer, as vLLM does.)"""
    if not os.path.isfile(OFFICIAL_TEMPLATE):
        pytest.skip(f"GPT-OSS's chat template is not on this machine ({OFFICIAL_TEMPLATE})")
    with open(OFFICIAL_TEMPLATE) as f:
        tok = harmony_tokenizer(chat_template=f.read())
    messages = [{"role": "system", "content": "Use a friendly tone."}, {"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "4", "thinking": "Easy."}, ASK_SF,
                {"role": "assistant", "thinking": THOUGHT, "tool_calls": [{"type": "function", "function": {
                    "name": "get_current_weather", "arguments": {"location": "San Francisco", "format": "celsius"}}}]}]
    tools = json.loads(json.dumps(SPEC_TOOLS).replace(', "default": "celsius"', ""))
    for effort in ("low", "high"):
        theirs = tok.apply_chat_template(messages, tools=tools, reasoning_effort=effort)
        assert render_prompt(messages, tools=tools, reasoning_effort=effort) == theirs


def test_matches_the_openai_harmony_library() -> None:
    harmony = pytest.importorskip("openai_harmony", reason="the openai-harmony library is not installed")
    try:
        encoding = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:  # noqa: BLE001 (whatever stops it fetching its vocabulary file)
        pytest.skip(f"openai-harmony cannot load its vocabulary file, which it downloads at run time: {e}")
    Message, Role = harmony.Message, harmony.Role
    system = harmony.SystemContent.new().with_reasoning_effort(harmony.ReasoningEffort.HIGH) \
        .with_conversation_start_date("2025-06-28")  # fmt: skip
    developer = harmony.DeveloperContent.new().with_instructions("Use a friendly tone.").with_function_tools([
        harmony.ToolDescription.new(t["function"]["name"], t["function"]["description"],
                                    parameters=t["function"].get("parameters")) for t in SPEC_TOOLS[1:]])
    conversation = harmony.Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, system), Message.from_role_and_content(Role.DEVELOPER, developer),
        Message.from_role_and_content(Role.USER, ASK_SF["content"]),
        Message.from_role_and_content(Role.ASSISTANT, THOUGHT).with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, '{"location":"San Francisco"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("json"),
        Message.from_author_and_content(harmony.Author.new(Role.TOOL, "functions.get_weather"), '{"sunny": true}')
        .with_channel("commentary").with_recipient("assistant"),
    ])  # fmt: skip
    theirs = encoding.decode_utf8(encoding.render_conversation_for_completion(conversation, Role.ASSISTANT))
    messages = [{"role": "system", "content": "Use a friendly tone."}, ASK_SF,
                {"role": "assistant", "reasoning_content": THOUGHT, "tool_calls": [WEATHER_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true}'}]
    assert render(messages, tools=SPEC_TOOLS[1:], reasoning_effort="high") == theirs
    for text in (SPEC_ANSWER, SPEC_CALL, SPEC_PREAMBLE):
        tokens = encoding.encode(text, allowed_special="all")
        parsed = encoding.parse_messages_from_completion_tokens(tokens, Role.ASSISTANT)
        ours = parse(text)
        assert [(m.channel, m.recipient, m.content[0].text) for m in parsed] == \
            [(m.channel, m.recipient, m.content) for m in ours]  # fmt: skip
