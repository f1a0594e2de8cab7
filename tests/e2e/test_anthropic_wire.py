"""Anthropic's Messages API on the wire, with a scripted fake engine behind the real server and
the official anthropic SDK: content blocks, stop reasons, thinking, tool use, the SSE events in
Anthropic's order, errors in its shape and the SDK's typed exceptions, and aborts."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.e2e.conftest import MODEL
from tests.e2e.fake_engine import FakeEngine
from tests.e2e.server_utils import RunningServer, running_server
from tests.e2e.test_tool_calls_wire import CALL

KEY = "sk-test"
EOS = 2  # <|im_end|>
HI = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def _shared_server() -> Iterator[tuple[FakeEngine, RunningServer]]:
    engine = FakeEngine(max_model_len=4096)  # room for thinking budgets (>= 1024 tokens)
    with running_server(engine, reasoning_parser="qwen3", api_key=KEY) as running:
        yield engine, running


@pytest.fixture
def ac(server: RunningServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=30) as c:
        yield c


def say(engine: FakeEngine, text: str) -> int:
    """Make the engine say ``text`` then end its turn; a max_tokens that leaves room for all of it."""
    engine.script = engine.tokenizer.encode(text, add_special_tokens=False) + [EOS]
    return len(engine.script) + 5


def sse(body: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each event, checking that the ``event:`` line names the data's type."""
    events = []
    for block in body.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert name_line.startswith("event: ") and data["type"] == name
        events.append((name, data))
    return events


def test_text_message(ac: anthropic.Anthropic, engine: FakeEngine) -> None:
    m = ac.messages.create(model=MODEL, max_tokens=say(engine, "It is sunny."), messages=HI,
                           system=[{"type": "text", "text": "Be brief."}], metadata={"user_id": "u1"},
                           extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40})  # fmt: skip
    # (This SDK version has no sampling keyword arguments; the API still takes the fields.)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "It is sunny."
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    call = engine.calls[0]
    assert call.prompt.startswith("<|im_start|>system\nBe brief.")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(call.prompt_token_ids)
    assert m.usage.output_tokens == len(engine.script)
    params = call.params
    assert (params.temperature, params.top_p, params.top_k) == (0.5, 0.9, 40)


def test_max_tokens_and_stop_sequences(ac: anthropic.Anthropic, engine: FakeEngine) -> None:
    say(engine, "One two three four five.")
    m = ac.messages.create(model=MODEL, max_tokens=2, messages=HI)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    m = ac.messages.create(model=MODEL, max_tokens=50, messages=HI, stop_sequences=["four", "nine"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "four"
    assert m.content[0].text == "One two three "


def test_thinking_blocks(ac: anthropic.Anthropic, engine: FakeEngine) -> None:
    max_tokens = say(engine, "<think>Look it up.</think>\n\nSunny.") + 2000
    thinking = {"type": "enabled", "budget_tokens": 1024}
    m = ac.messages.create(model=MODEL, max_tokens=max_tokens, messages=HI, thinking=thinking)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Look it up." and m.content[1].text == "\n\nSunny."
    # Disabled: the reasoning is not the answer, and is not shown.
    m = ac.messages.create(model=MODEL, max_tokens=max_tokens, messages=HI, thinking={"type": "disabled"})
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "\n\nSunny."
    with ac.messages.stream(model=MODEL, max_tokens=max_tokens, messages=HI, thinking=thinking) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds[0] == "thinking_delta" and kinds[-1] == "text_delta" and "thinking_delta" not in kinds[kinds.index("text_delta"):]
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == "Look it up."


def test_tool_use_and_result(ac: anthropic.Anthropic, engine: FakeEngine) -> None:
    max_tokens = say(engine, "Let me check.\n" + CALL)
    m = ac.messages.create(model=MODEL, max_tokens=max_tokens, messages=HI, tools=TOOLS)
    assert m.stop_reason == "tool_use"
    text, use = m.content
    assert text.type == "text" and text.text == "Let me check."
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id.startswith("toolu_")
    assert "get_weather" in engine.calls[0].prompt  # the tools went into the prompt
    # The round trip: the call and its result go back into the prompt.
    say(engine, "It is sunny.")
    follow_up = HI + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                    "content": "18 C, clear"}]}]  # fmt: skip
    m2 = ac.messages.create(model=MODEL, max_tokens=20, messages=follow_up, tools=TOOLS)
    assert m2.content[0].text == "It is sunny." and m2.stop_reason == "end_turn"
    prompt = engine.calls[1].prompt
    assert "18 C, clear" in prompt and '"city": "Paris"' in prompt


def test_streamed_tool_use_events_in_order(http: httpx.Client, engine: FakeEngine) -> None:
    body = {"model": MODEL, "max_tokens": say(engine, "Checking.\n" + CALL), "messages": HI, "tools": TOOLS,
            "stream": True}
    r = http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"] and names.count("ping") == 1
    starts = [d for n, d in events if n == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use"]
    assert [s["index"] for s in starts] == [0, 1]
    assert starts[1]["content_block"]["name"] == "get_weather" and starts[1]["content_block"]["input"] == {}
    deltas = [d for n, d in events if n == "content_block_delta"]
    assert "".join(d["delta"]["text"] for d in deltas if d["index"] == 0) == "Checking."
    pieces = [d["delta"]["partial_json"] for d in deltas if d["index"] == 1]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris"}
    assert [d["delta"]["type"] for d in deltas if d["index"] == 1] == ["input_json_delta"] * len(pieces)
    assert [d["index"] for n, d in events if n == "content_block_stop"] == [0, 1]
    # Each block is stopped before the next one starts.
    assert names.index("content_block_stop") < names.index("content_block_start", 2)
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(engine.script)


def test_forced_tool_choice_constrains_the_output(ac: anthropic.Anthropic, engine: FakeEngine) -> None:
    max_tokens = say(engine, CALL)
    m = ac.messages.create(model=MODEL, max_tokens=max_tokens, messages=HI, tools=TOOLS,
                           tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    assert [b.type for b in m.content] == ["tool_use"] and m.stop_reason == "tool_use"
    grammar = engine.calls[0].params.structured_outputs.grammar
    assert "get_weather" in grammar and "</think>" in grammar  # a reasoning section may come first
    with pytest.raises(anthropic.BadRequestError, match="Thinking may not be enabled"):
        ac.messages.create(model=MODEL, max_tokens=2000, messages=HI, tools=TOOLS, tool_choice={"type": "any"},
                           thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip


def test_count_tokens_matches_the_prompt(ac: anthropic.Anthropic, engine: FakeEngine) -> None:
    counted = ac.messages.count_tokens(model=MODEL, messages=HI, system="Be brief.", tools=TOOLS)
    ac.messages.create(model=MODEL, max_tokens=1, messages=HI, system="Be brief.", tools=TOOLS)
    assert counted.input_tokens == len(engine.calls[0].prompt_token_ids)
    assert ac.messages.count_tokens(model=MODEL, messages=HI).input_tokens < counted.input_tokens


@pytest.mark.parametrize("body,status,param", [
    ({"messages": HI}, 400, "max_tokens"),
    ({"max_tokens": 5, "messages": HI, "frequency_penalty": 1}, 400, "frequency_penalty"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, 400, "image"),
    ({"max_tokens": 5, "messages": HI + [{"role": "assistant", "content": "The"}]}, 400, "prefill"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": []}]}, 400, "empty"),
    ({"max_tokens": 5, "messages": HI, "temperature": 1.5}, 400, "temperature"),
    ({"max_tokens": 5, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 100}}, 400, "budget_tokens"),
    ({"max_tokens": 1500, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 2000}}, 400,
     "budget_tokens"),
    ({"max_tokens": 5, "messages": HI, "tool_choice": {"type": "tool", "name": "nope"}}, 400, "tool_choice"),
    ({"max_tokens": 5, "messages": HI, "model": "claude-nope"}, 404, "claude-nope"),
])  # fmt: skip
def test_errors_in_anthropic_shape(http: httpx.Client, body: dict[str, Any], status: int, param: str) -> None:
    r = http.post("/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": KEY})
    assert r.status_code == status
    error = r.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert param in error["error"]["message"]


def test_sdk_raises_typed_errors(server: RunningServer, ac: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError):
        ac.post("/v1/messages", body={"model": MODEL, "messages": HI}, cast_to=object)
    with pytest.raises(anthropic.NotFoundError):
        ac.messages.create(model="claude-nope", max_tokens=5, messages=HI)
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with wrong, pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model=MODEL, max_tokens=5, messages=HI)
    assert info.value.body["error"]["type"] == "authentication_error"
    # A Bearer token works too; the OpenAI routes keep their own error shape.
    with anthropic.Anthropic(base_url=server.base_url, auth_token=KEY, max_retries=0) as bearer:
        assert bearer.messages.count_tokens(model=MODEL, messages=HI).input_tokens > 0
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and "error" in r.json() and "type" not in r.json()


def test_thinking_without_a_reasoning_parser_is_refused(engine: FakeEngine) -> None:
    with running_server(engine) as plain, anthropic.Anthropic(base_url=plain.base_url, api_key="x",
                                                              max_retries=0) as ac:  # fmt: skip
        with pytest.raises(anthropic.BadRequestError, match="reasoning parser"):
            ac.messages.create(model=MODEL, max_tokens=2000, messages=HI,
                               thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip
        assert not engine.calls


def test_disconnect_mid_stream_aborts_the_engine_request(server: RunningServer, engine: FakeEngine) -> None:
    engine.step_delay = 0.02
    body = {"model": MODEL, "max_tokens": 500, "messages": HI, "stream": True}
    url, headers = f"{server.base_url}/v1/messages", {"x-api-key": KEY}
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=body, headers=headers) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i >= 12:
                break
    assert engine.abort_event.wait(10), "the engine request was not aborted"
    deadline = time.monotonic() + 10
    while engine._running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.aborted == [engine.calls[0].request_id] and not engine.finished and engine._running == 0


def test_engine_failure_mid_stream_is_an_error_event(http: httpx.Client, engine: FakeEngine) -> None:
    engine.fail_after_steps = 3
    body = {"model": MODEL, "max_tokens": 50, "messages": HI, "stream": True}
    r = http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    assert r.status_code == 200  # the headers went out with the first token
    events = sse(r.text)
    assert [n for n, _ in events][:3] == ["message_start", "content_block_start", "ping"]
    name, data = events[-1]
    assert name == "error" and data["error"]["type"] == "overloaded_error" and "engine" in data["error"]["message"]
    assert "message_stop" not in [n for n, _ in events]
