"""tools / tool_choice checks, the schema a forced call must match, and tools in the prompt."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.tool_parsers import get_tool_parser
from pagoda.entrypoints.openai.tools import call_schema, prompt_inputs, template_renders_tools
from pagoda.tokenizer import Tokenizer

PARSER = get_tool_parser("hermes")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def plan_error(**fields: Any) -> APIError:
    with pytest.raises(APIError) as info:
        chat(**fields).tool_plan()
    assert info.value.status == 400
    return info.value


def test_modes() -> None:
    assert chat().tool_plan().mode == "none" and not chat().tool_plan().active
    assert chat(tools=[WEATHER]).tool_plan().mode == "auto"
    assert chat(tools=[WEATHER], tool_choice="none").tool_plan().active is False
    plan = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}).tool_plan()
    assert plan.mode == "named" and plan.named == "get_time" and plan.forced
    plan = chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).tool_plan()
    assert plan.mode == "required" and not plan.parallel


def test_errors() -> None:
    assert plan_error(tool_choice="required").param == "tool_choice"
    assert plan_error(tool_choice={"type": "function", "function": {"name": "f"}}).param == "tool_choice"
    err = plan_error(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.param == "tool_choice" and "nope" in err.message
    assert plan_error(tools=[WEATHER, WEATHER]).param == "tools"
    err = plan_error(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    assert err.param == "response_format"


def test_tool_choice_shapes_are_validated() -> None:
    from pydantic import ValidationError

    for bad in ("sometimes", {"type": "function"}, {"type": "function", "function": {"name": 3}}):
        with pytest.raises(ValidationError):
            chat(tools=[WEATHER], tool_choice=bad)
    with pytest.raises(ValidationError):
        chat(tools=[{"type": "function", "function": {"name": "has space"}}])
    with pytest.raises(ValidationError):
        chat(tools=[{"type": "retrieval", "function": {"name": "f"}}])


def test_call_schema_and_constraint() -> None:
    plan = chat(tools=[WEATHER, TIME], tool_choice="required").tool_plan()
    schema = call_schema(plan.tools[0])
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"] == WEATHER["function"]["parameters"]
    assert call_schema(plan.tools[1])["properties"]["arguments"]["additionalProperties"] is False
    grammar = plan.constraint(PARSER).grammar
    assert grammar is not None and "anyOf" in grammar and 'start: call ("\\n" call)*' in grammar
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    grammar = named.tool_plan().constraint(PARSER).grammar
    assert "get_time" not in grammar and "anyOf" not in grammar and grammar.startswith("start: call\n")
    assert chat(tools=[WEATHER]).tool_plan().constraint(PARSER) is None


# ---------------------------------------------------------------------- the prompt
PLAIN = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NATIVE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
)
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rainy"},
]  # fmt: skip


def tokenizer(template: str) -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    return Tokenizer(Backend(WordLevel({"<unk>": 0}, unk_token="<unk>")), chat_template=template)


def test_probe() -> None:
    assert not template_renders_tools(tokenizer(PLAIN))
    assert template_renders_tools(tokenizer(NATIVE))


def test_written_in_hermes_style_when_the_template_cannot() -> None:
    tok = tokenizer(PLAIN)
    plan = chat(tools=[WEATHER]).tool_plan()
    messages, tools = prompt_inputs(tok, HISTORY, plan, PARSER)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER) in messages[0]["content"]
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    assert messages[3]["content"] == (
        "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response>"
    )
    text = tok.apply_chat_template(messages, tools=tools)
    assert text.endswith("<|assistant|>") and "<tool_response>" in text
    # Without tools in play the history is still written; no system prompt is added.
    messages, _ = prompt_inputs(tok, HISTORY[1:], chat(tools=[WEATHER], tool_choice="none").tool_plan(), PARSER)
    assert messages[0]["role"] == "user" and "<tool_call>" in messages[1]["content"]
    # Nothing to do with tools: the messages as they are.
    assert prompt_inputs(tok, USER, chat().tool_plan(), PARSER) == (USER, None)


def test_native_template_gets_tools_and_argument_objects() -> None:
    tok = tokenizer(NATIVE)
    messages, tools = prompt_inputs(tok, HISTORY, chat(tools=[WEATHER]).tool_plan(), PARSER)
    assert tools == [WEATHER]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert HISTORY[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # not modified
    text = tok.apply_chat_template(messages, tools=tools)
    assert text.startswith("TOOLS:get_weather;") and 'CALL get_weather {"city": "Paris"}' in text
