"""vLLM's extras on the real engine and the default model: the chat template through /tokenize,
prompt caching in usage, truncation, forced tool calls cut by max_tokens, vllm: metric names."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.config import EngineConfig
from tests.e2e.server_utils import running_server, sse_events

MODEL = "smollm2"
SYSTEM = ("You are the help desk of a small hardware store: paint in aisle three, tools in aisle five, "
          "garden supplies outside. Answer in one short sentence.")  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}  # fmt: skip


@pytest.fixture(scope="module")
def real():
    from pagoda.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_config(EngineConfig(show_progress=False, num_kv_blocks=512, max_model_len=1024))
    with running_server(engine, served_model_name=MODEL, shutdown_engine=True) as running, \
            httpx.Client(base_url=running.base_url, timeout=120) as http:  # fmt: skip
        yield engine, http


def _chat(http: httpx.Client, **body) -> dict:
    r = http.post("/v1/chat/completions", json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_cached_tokens_are_the_prefix_cache_hits(real) -> None:
    _, http = real
    # Long enough for full KV blocks (64 tokens each on the CPU): only those are cached.
    messages = [{"role": "system", "content": " ".join([SYSTEM] * 4)}, {"role": "user", "content": "Paint?"}]
    first = _chat(http, messages=messages, max_tokens=2)
    before = http.get("/v1/engine/stats").json()["prefix_cache_hits"]
    second = _chat(http, messages=messages, max_tokens=2)
    hits = http.get("/v1/engine/stats").json()["prefix_cache_hits"] - before
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"]
    assert cached == hits > 0 and cached < second["usage"]["prompt_tokens"]


def test_tokenize_matches_what_chat_runs(real) -> None:
    engine, http = real
    messages = [{"role": "user", "content": "Name a colour."}]
    tokens = http.post("/tokenize", json={"messages": messages, "return_token_strs": True}).json()
    out = _chat(http, messages=messages, max_tokens=3, return_token_ids=True)
    assert tokens["tokens"] == out["prompt_token_ids"] and tokens["count"] == out["usage"]["prompt_tokens"]
    assert "".join(tokens["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n") == engine.tokenizer.decode(
        tokens["tokens"], skip_special_tokens=False)
    assert engine.tokenizer.decode(out["choices"][0]["token_ids"]) == out["choices"][0]["message"]["content"]
    cut = _chat(http, messages=messages, max_tokens=3, return_token_ids=True, truncate_prompt_tokens=5)
    assert cut["prompt_token_ids"] == tokens["tokens"][-5:] and cut["usage"]["prompt_tokens"] == 5


def test_continue_final_message_continues_the_answer(real) -> None:
    _, http = real
    messages = [{"role": "user", "content": "Count from one to ten in words."},
                {"role": "assistant", "content": "one, two, three,"}]  # fmt: skip
    out = _chat(http, messages=messages, max_tokens=6, continue_final_message=True, add_generation_prompt=False)
    text = out["choices"][0]["message"]["content"]
    assert text.lstrip().lower().startswith("four"), text


def test_forced_tool_call_cut_by_max_tokens(real) -> None:
    _, http = real
    body = {"messages": [{"role": "user", "content": "Weather in Paris for the next three days?"}],
            "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 20}  # fmt: skip
    choice = _chat(http, **body)["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"]["content"]
    (call,) = choice["message"]["tool_calls"]
    arguments = call["function"]["arguments"]
    assert call["function"]["name"] == "get_weather" and arguments.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)  # cut: the JSON generated so far, as vLLM returns it
    complete = _chat(http, **{**body, "max_tokens": 60})["choices"][0]
    assert complete["finish_reason"] == "tool_calls"
    assert complete["message"]["tool_calls"][0]["function"]["arguments"].startswith(arguments)
    # Streaming: the same call in pieces, then finish_reason "length" on the last chunk.
    with http.stream("POST", "/v1/chat/completions", json={**body, "temperature": 0, "stream": True}) as r:
        chunks = [e for e in sse_events(r.read().decode()) if e != "[DONE]"]
    pieces = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert pieces[0]["function"]["name"] == "get_weather"
    assert "".join(p["function"]["arguments"] for p in pieces) == arguments
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_vllm_metric_names_on_the_real_engine(real) -> None:
    _, http = real
    client = openai.OpenAI(base_url=f"{str(http.base_url).rstrip('/')}/v1", api_key="x", max_retries=0)
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in ("prompt_tokens", "generation_tokens", "request_success", "time_to_first_token_seconds",
                 "e2e_request_latency_seconds", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc", "inter_token_latency_seconds"):
        ours, theirs = families[f"pagoda:{name}"], families[f"vllm:{name}"]
        assert ours.type == theirs.type
        assert [(s.name.split(":", 1)[1], s.labels, s.value) for s in ours.samples] == [
            (s.name.split(":", 1)[1], s.labels, s.value) for s in theirs.samples]
    # pagoda's tokens per step are not vLLM's iteration_tokens_total (prompts counted when their
    # first token comes out): not exported under vLLM's name.
    assert "pagoda:iteration_tokens_total" in families and "vllm:iteration_tokens_total" not in families
    generated = next(s for s in families["vllm:generation_tokens"].samples if s.name.endswith("_total"))
    assert generated.value >= 3 and generated.labels == {"model_name": MODEL}
    assert any(s.labels.get("finished_reason") == "length" and s.value >= 1
               for s in families["vllm:request_success"].samples)
