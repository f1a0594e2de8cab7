"""Tool calls on the wire, with a scripted fake engine: message.tool_calls, finish_reason, and
streamed delta.tool_calls chunks in OpenAI's order, through the real server and openai client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai

from tests.e2e.conftest import MODEL
from tests.e2e.fake_engine import FakeEngine
from tests.e2e.server_utils import sse_events

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]
EOS = 2  # <|im_end|>


def script(engine: FakeEngine, text: str) -> dict[str, Any]:
    """Make the engine say ``text`` then stop; the request fields that let it finish with "stop"."""
    engine.script = engine.tokenizer.encode(text, add_special_tokens=False) + [EOS]
    return {"max_tokens": len(engine.script) + 1, "extra_body": {"stop_token_ids": [EOS]}}


def test_non_streaming_tool_call(client: openai.OpenAI, engine: FakeEngine) -> None:
    kwargs = script(engine, CALL)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, **kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # The tools went into the prompt (SmolLM2's template ignores them: a Hermes system prompt).
    assert "<tools>" in engine.calls[0].prompt and "get_weather" in engine.calls[0].prompt


def test_tool_choice_none_leaves_text_alone(client: openai.OpenAI, engine: FakeEngine) -> None:
    kwargs = script(engine, CALL)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", **kwargs)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == CALL
    assert r.choices[0].message.tool_calls is None and "<tools>" not in engine.calls[0].prompt


def test_content_without_calls(client: openai.OpenAI, engine: FakeEngine) -> None:
    kwargs = script(engine, "It is sunny.")
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, **kwargs)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "It is sunny."
    assert r.choices[0].message.tool_calls is None


def test_streaming_deltas(http: httpx.Client, engine: FakeEngine) -> None:
    kwargs = script(engine, "Checking. " + CALL)
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "stream": True, "max_tokens": kwargs["max_tokens"],
            **kwargs["extra_body"]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    events = [e for e in sse_events(r.text) if e != "[DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Checking."
    pieces = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    head = pieces[0]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in pieces[1:])
    assert len(pieces) > 2, "arguments arrive in several fragments"
    arguments = "".join(p["function"]["arguments"] for p in pieces)
    assert json.loads(arguments) == {"city": "Paris"}
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finishes == ["tool_calls"]


def test_round_trip_messages_are_rendered(client: openai.OpenAI, engine: FakeEngine) -> None:
    kwargs = script(engine, "It is sunny in Paris.")
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
    ]  # fmt: skip
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **kwargs)
    assert r.choices[0].message.content == "It is sunny in Paris."
    prompt = engine.calls[0].prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<|im_start|>user\n<tool_response>\n{"sky": "sunny"}\n</tool_response><|im_end|>' in prompt


def test_forced_call_is_constrained(client: openai.OpenAI, engine: FakeEngine) -> None:
    kwargs = script(engine, CALL)
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **kwargs,
    )
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    grammar = engine.calls[0].params.structured_outputs.grammar
    assert grammar.startswith("start: call\n") and "<tool_call>" in grammar


def test_auto_parser_reads_the_format_the_template_writes(caplog, monkeypatch) -> None:
    """--tool-call-parser auto on a model whose template writes Mistral's [TOOL_CALLS]: the
    server logs the parser it chose and reads the model's calls in that format."""
    import logging

    from tests.e2e.server_utils import running_server

    engine = FakeEngine()
    # (The fake engines share one tokenizer: the template goes back after the test.)
    monkeypatch.setattr(engine.tokenizer, "chat_template", (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}"
        "[/AVAILABLE_TOOLS]{% endif %}{# calls: [TOOL_CALLS][...] #}"))
    with caplog.at_level(logging.INFO), running_server(engine, tool_call_parser="auto") as running:
        assert any("tool-call parser: mistral" in r.getMessage() for r in caplog.records)
        text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
        engine.script = engine.tokenizer.encode(text, add_special_tokens=False) + [EOS]
        with openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="x", max_retries=0) as client:
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                               tools=TOOLS, max_tokens=len(engine.script) + 1,
                                               extra_body={"stop_token_ids": [EOS]})
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert r.choices[0].finish_reason == "tool_calls"


def test_tool_requests_decode_special_tokens(client: openai.OpenAI, engine: FakeEngine) -> None:
    """A parser reads its markers from the text, and some formats' markers are special tokens
    (Mistral's [TOOL_CALLS], Llama 3's <|python_tag|>): with tools, the text keeps special tokens
    unless the request says otherwise; the EOS that ends the output is still not in it."""
    kwargs = script(engine, CALL)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, **kwargs)
    assert r.choices[0].message.content is None and r.choices[0].message.tool_calls
    client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                   **{**kwargs, "extra_body": {**kwargs.get("extra_body", {}),
                                                               "skip_special_tokens": True}})
    client.chat.completions.create(model=MODEL, messages=ASK, **kwargs)
    assert [c.params.skip_special_tokens for c in engine.calls] == [False, True, True]
