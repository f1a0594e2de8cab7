"""Anthropic's Messages API over the real engine and the default model, driven by the official
anthropic SDK: the same greedy text as /v1/chat/completions, streaming, token counting, a tool
round trip, typed errors, and a disconnect that gives every KV block back."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from pagoda.config import EngineConfig
from tests.e2e.server_utils import RunningServer, real_engine_server

MODEL = "smollm2"
KEY = "sk-real"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # this SDK version takes sampling fields through extra_body
TOOLS = [{"name": "get_weather", "description": "Get the current weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]  # fmt: skip


@pytest.fixture(scope="module")
def real_server() -> Iterator[RunningServer]:
    config = EngineConfig(show_progress=False, num_kv_blocks=512, max_model_len=2048)
    with real_engine_server(config, served_model_name=MODEL, api_key=KEY) as (_, running):
        yield running


@pytest.fixture
def ac(real_server: RunningServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=real_server.base_url, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def _stats(running: RunningServer) -> dict:
    return httpx.get(f"{running.base_url}/v1/engine/stats", headers={"x-api-key": KEY}, timeout=10).json()


def test_greedy_text_equals_chat_completions(real_server: RunningServer, ac: anthropic.Anthropic) -> None:
    m = ac.messages.create(model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY)
    with openai.OpenAI(base_url=f"{real_server.base_url}/v1", api_key=KEY, max_retries=0) as oc:
        chat = oc.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0)
    assert [b.type for b in m.content] == ["text"] and "Paris" in m.content[0].text
    assert m.content[0].text == chat.choices[0].message.content
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    with ac.messages.stream(model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    assert types[0] == "message_start" and types[-1] == "message_stop" and "content_block_stop" in types


def test_count_tokens_is_the_chat_template_length(real_server: RunningServer, ac: anthropic.Anthropic) -> None:
    system = "You answer in one word."
    counted = ac.messages.count_tokens(model=MODEL, system=system, messages=ASK)
    templated = [{"role": "system", "content": system}, *ASK]
    r = httpx.post(f"{real_server.base_url}/tokenize", json={"model": MODEL, "messages": templated}, timeout=30)
    assert counted.input_tokens == r.json()["count"] > 10
    m = ac.messages.create(model=MODEL, system=system, max_tokens=1, messages=ASK)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted.input_tokens


def test_forced_tool_use_round_trip(ac: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = ac.messages.create(model=MODEL, max_tokens=64, messages=ask, tools=TOOLS,
                           tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)  # fmt: skip
    assert m.stop_reason == "tool_use"
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input, dict) and isinstance(use.input["city"], str)
    follow_up = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": json.dumps({"temperature_c": 18})}]}]  # fmt: skip
    answer = ac.messages.create(model=MODEL, max_tokens=24, messages=follow_up, tools=TOOLS, extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content


def test_typed_errors(real_server: RunningServer, ac: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError):
        ac.post("/v1/messages", body={"model": MODEL, "messages": ASK}, cast_to=object)  # no max_tokens
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=real_server.base_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.BadRequestError, match="context length"):
        ac.messages.create(model=MODEL, max_tokens=4000, messages=ASK)


def test_disconnect_mid_stream_frees_blocks(real_server: RunningServer) -> None:
    body = {"model": MODEL, "max_tokens": 1000, "stream": True,
            "messages": [{"role": "user", "content": "Write a very long essay about the sea."}]}
    url, headers = f"{real_server.base_url}/v1/messages", {"x-api-key": KEY}
    with httpx.Client(timeout=60) as http, http.stream("POST", url, json=body, headers=headers) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i >= 12:  # message_start, the block's start, a ping, a few deltas
                break
    deadline = time.monotonic() + 30
    while True:
        stats = _stats(real_server)
        if stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0 and stats["kv_cache_usage"] == 0:
            break
        assert time.monotonic() < deadline, f"engine not idle: {stats}"
        time.sleep(0.1)
    assert stats["num_free_blocks"] == stats["num_blocks"]
