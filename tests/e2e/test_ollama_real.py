"""Ollama's API over the real engine-core process and the default model, driven by the
official ``ollama`` client, checked against pagoda's own OpenAI endpoints."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import ollama
import openai
import pytest

from pagoda.config import EngineConfig
from tests.e2e.server_utils import real_engine_server

MODEL = "smollm2"
GREEDY = {"temperature": 0, "seed": 7}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                                 "parameters": CITY}}  # fmt: skip
# One earlier call and its result, so that the small model follows the pattern.
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "content": "sunny, 24 C", "tool_name": "get_weather"},
    {"role": "assistant", "content": "It is sunny in Rome, 24 C."},
    {"role": "user", "content": "What is the weather in Paris?"},
]  # fmt: skip


@pytest.fixture(scope="module")
def real_server():
    config = EngineConfig(show_progress=False, num_kv_blocks=256, max_model_len=2048)
    with real_engine_server(config, served_model_name=MODEL) as (engine, running):
        yield engine, running


@pytest.fixture
def oc(real_server) -> ollama.Client:
    return ollama.Client(host=real_server[1].base_url, timeout=120)


@pytest.fixture
def oai(real_server):
    with openai.OpenAI(base_url=f"{real_server[1].base_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def _wait_idle(engine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.num_unfinished_requests:
        assert time.monotonic() < deadline, "the engine still has unfinished requests"
        time.sleep(0.05)


def test_chat_matches_openai_chat(oc: ollama.Client, oai: openai.OpenAI, real_server) -> None:
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three fruits."}]
    ours = oc.chat(model=MODEL, messages=messages, stream=False, options={**GREEDY, "num_predict": 16})
    theirs = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, **GREEDY)
    assert ours.message.content == theirs.choices[0].message.content and ours.message.content
    assert ours.eval_count == theirs.usage.completion_tokens
    assert ours.prompt_eval_count == theirs.usage.prompt_tokens
    assert ours.done_reason == theirs.choices[0].finish_reason
    assert 0 < ours.prompt_eval_duration + ours.eval_duration <= ours.total_duration
    parts = list(oc.chat(model=f"{MODEL}:latest", messages=messages, stream=True, options={**GREEDY, "num_predict": 16}))
    assert "".join(p.message.content or "" for p in parts) == ours.message.content
    assert parts[-1].done and parts[-1].eval_count == ours.eval_count
    _wait_idle(real_server[0])


def test_generate_matches_openai(oc: ollama.Client, oai: openai.OpenAI) -> None:
    raw = oc.generate(model=MODEL, prompt="Monday, Tuesday, Wednesday,", raw=True, options={**GREEDY, "num_predict": 8})
    comp = oai.completions.create(model=MODEL, prompt="Monday, Tuesday, Wednesday,", max_tokens=8, **GREEDY)
    assert raw.response == comp.choices[0].text and "Thursday" in raw.response
    assert raw.eval_count == comp.usage.completion_tokens and raw.prompt_eval_count == comp.usage.prompt_tokens
    # Templated: one user turn, as the chat endpoint renders it.
    templated = list(oc.generate(model=MODEL, prompt="What is the capital of France?", stream=True,
                                 options={**GREEDY, "num_predict": 12}))  # fmt: skip
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                       max_tokens=12, **GREEDY)  # fmt: skip
    text = "".join(p.response for p in templated)
    assert text == chat.choices[0].message.content and "Paris" in text
    final = templated[-1]
    assert final.eval_count == chat.usage.completion_tokens
    assert len(final.context) == final.prompt_eval_count + final.eval_count


def test_format_json_and_schema(oc: ollama.Client) -> None:
    free = oc.generate(model=MODEL, prompt='Reply with a JSON object whose key "animal" is "cat".', format="json",
                       options={**GREEDY, "num_predict": 96})  # fmt: skip
    assert free.done_reason == "stop", free.response
    assert isinstance(json.loads(free.response), dict)
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    r = oc.chat(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], format=person,
                options={**GREEDY, "num_predict": 48})  # fmt: skip
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), person)


def _openai_shaped(messages: list[dict]) -> list[dict]:
    """The same conversation as the OpenAI API spells it (arguments as JSON text, call ids)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": json.dumps(c["function"]["arguments"])}}
                               for i, c in enumerate(m["tool_calls"])]  # fmt: skip
        if m["role"] == "tool":
            m = {"role": "tool", "content": m["content"], "tool_call_id": "call_0"}
        out.append(m)
    return out


def test_tools_and_tool_history_match_openai(oc: ollama.Client, oai: openai.OpenAI, real_server) -> None:
    """Tools, an Ollama-shaped call and its result reach the model as the OpenAI endpoint
    writes them: the same greedy text. (The 135M model answers rather than calling a tool
    here; the fake engine's tests cover parsing calls into Ollama's shape.)"""
    history = FEW_SHOT + [{"role": "assistant", "content": "",
                           "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                          {"role": "tool", "content": "rainy, 12 C", "tool_name": "get_weather"}]  # fmt: skip
    ours = oc.chat(model=MODEL, messages=history, tools=[WEATHER_TOOL], options={**GREEDY, "num_predict": 24})
    theirs = oai.chat.completions.create(model=MODEL, messages=_openai_shaped(history), tools=[WEATHER_TOOL],
                                         max_tokens=24, **GREEDY)  # fmt: skip
    assert ours.message.content == (theirs.choices[0].message.content or "")
    assert ours.prompt_eval_count == theirs.usage.prompt_tokens
    assert not ours.message.tool_calls and not theirs.choices[0].message.tool_calls
    assert "rain" in ours.message.content.lower() or "12" in ours.message.content
    _wait_idle(real_server[0])


def test_models_and_errors(oc: ollama.Client, real_server) -> None:
    assert [m.model for m in oc.list().models] == [f"{MODEL}:latest"]
    shown = oc.show(MODEL)
    assert shown.details.family == "llama" and shown.details.parameter_size == "134.52M"
    assert shown.modelinfo["llama.context_length"] == 8192
    assert oc.ps().models[0].context_length == 2048
    assert httpx.get(f"{real_server[1].base_url}/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat(model="llama3", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        oc.generate(model=MODEL, prompt="hi", options={"num_ctx": 4})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error


def test_disconnect_mid_stream_aborts(real_server) -> None:
    engine, running = real_server
    _wait_idle(engine)
    aborted = engine.metrics.request_aborted
    # Counting on: a raw prompt the model continues far past the first line.
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6,", "raw": True, "options": {"num_predict": 1000, **GREEDY}}
    with httpx.Client(base_url=running.base_url, timeout=60) as http, http.stream("POST", "/api/generate", json=body) as r:
        assert json.loads(next(r.iter_lines()))["done"] is False
    _wait_idle(engine)
    deadline = time.monotonic() + 30
    while True:  # the core let go of it: aborted, nothing running, every KV block free
        stats = httpx.get(f"{running.base_url}/v1/engine/stats", timeout=10).json()
        idle = stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0 and stats["kv_cache_usage"] == 0
        if idle and engine.metrics.request_aborted == aborted + 1:
            break
        assert time.monotonic() < deadline, (stats, engine.metrics.request_aborted)
        time.sleep(0.1)
