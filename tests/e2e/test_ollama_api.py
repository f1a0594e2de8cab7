"""Ollama's API (pagoda/entrypoints/ollama) over the fake engine: the wire format, the
options mapping, errors in Ollama's shape, and request lifetimes. The official ``ollama``
client drives it where it can; raw HTTP where the test is about the wire."""

from __future__ import annotations

import json
from typing import Any

import httpx
import ollama
import pytest

from tests.e2e.conftest import MODEL
from tests.e2e.fake_engine import FakeEngine
from tests.e2e.server_utils import RunningServer, running_server
from tests.e2e.test_server_lifecycle import assert_cleaned_up, in_background, wait_until

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def oc(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=30)


def lines(body: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def error_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    return body["error"]


# ---------------------------------------------------------------------- generation
def test_generate_stream_lines_and_final_timings(http: httpx.Client, engine: FakeEngine) -> None:
    r = http.post("/api/generate", json={"model": MODEL, "prompt": "hi", "options": {"num_predict": 5}})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    out = lines(r.text)  # stream is Ollama's default
    assert all(o["model"] == MODEL and o["created_at"].endswith("Z") for o in out)
    assert [o["done"] for o in out] == [False] * (len(out) - 1) + [True]
    assert "done_reason" not in out[0] and "total_duration" not in out[0]
    final = out[-1]
    call = engine.calls[0]
    assert final["done_reason"] == "length" and final["eval_count"] == 5
    assert final["prompt_eval_count"] == len(call.prompt_token_ids)
    assert "".join(o["response"] for o in out) == engine.tokenizer.decode(engine.script[:5])
    assert final["context"][: len(call.prompt_token_ids)] == call.prompt_token_ids
    assert final["context"][len(call.prompt_token_ids):] == engine.script[:5]
    parts = [final[k] for k in ("load_duration", "prompt_eval_duration", "eval_duration")]
    assert all(isinstance(p, int) and p >= 0 for p in parts) and final["total_duration"] >= sum(parts)


def test_generate_context_round_trip_and_raw(oc: ollama.Client, engine: FakeEngine) -> None:
    first = oc.generate(model=MODEL, prompt="hi", options={"num_predict": 3})
    assert first.done and first.context
    second = oc.generate(model=MODEL, prompt="more", context=first.context, options={"num_predict": 2})
    new = engine.calls[1].prompt_token_ids
    assert new[: len(first.context)] == list(first.context) and len(new) > len(first.context)
    assert second.prompt_eval_count == len(new)
    oc.generate(model=MODEL, prompt="1, 2, 3,", raw=True, options={"num_predict": 2})
    assert engine.calls[2].prompt_token_ids == engine.tokenizer.encode("1, 2, 3,")
    oc.generate(model=MODEL, prompt="hi", system="Be brief.", options={"num_predict": 1})
    assert "Be brief." in engine.tokenizer.decode(engine.calls[3].prompt_token_ids, skip_special_tokens=False)


def test_chat_stream_and_not(oc: ollama.Client, engine: FakeEngine) -> None:
    whole = oc.chat(model=MODEL, messages=HI, options={"num_predict": 6})
    assert whole.message.role == "assistant" and whole.done_reason == "length" and whole.eval_count == 6
    parts = list(oc.chat(model=MODEL, messages=HI, options={"num_predict": 6}, stream=True))
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert parts[-1].done and parts[-1].eval_count == 6 and not any(p.done for p in parts[:-1])
    assert engine.calls[0].prompt_token_ids == engine.calls[1].prompt_token_ids


def test_empty_prompt_loads_the_model(oc: ollama.Client, engine: FakeEngine) -> None:
    assert oc.generate(model=MODEL).done_reason == "load"
    assert oc.chat(model=MODEL, messages=[]).done_reason == "load"
    assert engine.calls == []


def test_options_map_onto_sampling_params(http: httpx.Client, engine: FakeEngine) -> None:
    options = {"num_predict": 4, "temperature": 0.3, "top_k": 7, "top_p": 0.5, "min_p": 0.1, "repeat_penalty": 1.2,
               "presence_penalty": 0.5, "frequency_penalty": -0.5, "stop": ["zzz"], "seed": 11, "num_thread": 8,
               "num_gpu": 0, "use_mmap": True, "num_batch": 32, "typical_p": 1.0, "mirostat": 0, "repeat_last_n": -1}
    r = http.post("/api/chat", json={"model": MODEL, "messages": HI, "stream": False, "options": options})
    assert r.status_code == 200, r.text
    p = engine.calls[0].params
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (4, 0.3, 7, 0.5, 0.1)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.2, 0.5, -0.5)
    assert (p.stop, p.seed) == (["zzz"], 11)
    # Absent: Ollama's defaults, and no limit but the context.
    http.post("/api/generate", json={"model": MODEL, "prompt": "hi", "stream": False})
    p = engine.calls[1].params
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (0.8, 40, 0.9, 1.0)
    assert p.max_tokens == engine.max_model_len - len(engine.calls[1].prompt_token_ids)
    # num_ctx bounds prompt + output; repeat_last_n 0 turns the penalties off.
    http.post("/api/generate", json={"model": MODEL, "prompt": "hi", "stream": False,
                                     "options": {"num_ctx": 40, "repeat_last_n": 0, "repeat_penalty": 1.5}})
    call = engine.calls[2]
    assert call.params.max_tokens == 40 - len(call.prompt_token_ids) and call.params.repetition_penalty == 1.0


def test_format_and_logprobs(http: httpx.Client, engine: FakeEngine) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for fmt in ("json", schema):
        r = http.post("/api/generate", json={"model": MODEL, "prompt": "hi", "stream": False, "format": fmt,
                                             "options": {"num_predict": 1}})
        assert r.status_code == 200, r.text
    assert engine.calls[0].params.structured_outputs.json_object
    assert json.loads(engine.calls[1].params.structured_outputs.json) == schema
    r = http.post("/api/chat", json={"model": MODEL, "messages": HI, "stream": False, "logprobs": True,
                                     "top_logprobs": 2, "options": {"num_predict": 3}})
    logprobs = r.json()["logprobs"]
    assert len(logprobs) == 3 and all(len(lp["top_logprobs"]) == 2 and lp["logprob"] < 0 for lp in logprobs)
    assert "".join(lp["token"] for lp in logprobs) == r.json()["message"]["content"]


# ---------------------------------------------------------------------- models
def test_tags_show_ps_version_root(oc: ollama.Client, http: httpx.Client) -> None:
    listed = oc.list().models
    assert [m.model for m in listed] == [f"{MODEL}:latest"]
    details = listed[0].details
    assert details.format == "gguf" and details.family == "llama" and details.quantization_level == "Q4_1"
    assert details.parameter_size.endswith("M") and listed[0].size > 1_000_000 and len(listed[0].digest) == 64
    shown = oc.show(f"{MODEL}:latest")
    assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["tokenizer.ggml.tokens"] is None
    assert shown.template and "tools" in shown.capabilities and "num_ctx" in shown.parameters
    verbose = http.post("/api/show", json={"model": MODEL, "verbose": True}).json()
    assert len(verbose["model_info"]["tokenizer.ggml.tokens"]) > 1000
    running = oc.ps().models
    assert running[0].name == f"{MODEL}:latest" and running[0].context_length == 512
    assert http.get("/api/version").json()["version"]
    assert http.get("/").text == "Ollama is running" and http.head("/").status_code == 200


def test_model_management_is_refused(oc: ollama.Client, http: httpx.Client) -> None:
    for call in (lambda: oc.pull(MODEL), lambda: oc.push(MODEL), lambda: oc.copy(MODEL, "x"),
                 lambda: oc.create(model="x", from_=MODEL)):  # fmt: skip
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 403 and "serves the model it was started with" in e.value.error
    assert "serves the model" in error_of(http.request("DELETE", "/api/delete", json={"model": MODEL}), 403)


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("body, status, words", [
    ({"model": "nope", "prompt": "hi"}, 404, "model 'nope' not found"),
    ({"model": f"{MODEL}:7b", "prompt": "hi"}, 404, "not found"),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": MODEL, "prompt": "hi", "options": {"bogus": 1}}, 400, "options.bogus"),
    ({"model": MODEL, "prompt": "hi", "template": "{{ .Prompt }}"}, 400, "template"),
    ({"model": MODEL, "prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ({"model": MODEL, "prompt": "hi", "images": ["aGk="]}, 400, "images"),
    ({"model": MODEL, "prompt": "hi", "think": True}, 400, "think"),
    ({"model": MODEL, "prompt": "hi", "raw": True, "system": "s"}, 400, "raw"),
    ({"model": MODEL, "prompt": "hi", "keep_alive": "soon"}, 400, "keep_alive"),
    ({"model": MODEL, "prompt": "hi", "format": "xml"}, 400, "format"),
    ({"model": MODEL, "prompt": "hi", "format": {"type": "nonsense"}}, 400, "format"),
    ({"model": MODEL, "prompt": "hi", "context": [10**9]}, 400, "out of vocabulary"),
    ({"model": MODEL, "prompt": "hi", "options": {"num_predict": 0}}, 400, "num_predict"),
    ({"model": MODEL, "prompt": "hi", "options": {"num_ctx": 5}}, 400, "num_ctx"),
    ({"model": MODEL, "prompt": "hi", "options": {"temperature": -1}}, 400, "options.temperature"),
    ({"model": MODEL, "prompt": "hi", "options": {"mirostat": 2}}, 400, "mirostat"),
    ({"model": MODEL, "prompt": "hi", "options": {"repeat_last_n": 64, "repeat_penalty": 1.1}}, 400, "repeat_last_n"),
    ({"model": MODEL, "prompt": "hi", "options": {"num_predict": 600}}, 200, ""),
    ({"model": MODEL, "prompt": "hi " * 600}, 400, "context length"),
])
def test_bad_generate_requests(http: httpx.Client, engine: FakeEngine, body: dict, status: int, words: str) -> None:
    r = http.post("/api/generate", json={"stream": False, **body})
    if status == 200:  # num_predict beyond the context: bounded by it, as Ollama does
        assert r.status_code == 200 and engine.calls[0].params.max_tokens < 600
        return
    assert words in error_of(r, status)
    assert engine.calls == []


def test_bad_chat_requests_raise_response_error(oc: ollama.Client, engine: FakeEngine) -> None:
    cases = [({"model": "nope", "messages": HI}, 404),
             ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
             ({"model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400),
             ({"model": MODEL, "messages": HI, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400),
             ({"model": MODEL, "messages": HI, "think": "high"}, 400)]  # fmt: skip
    for kwargs, status in cases:
        with pytest.raises(ollama.ResponseError) as e:
            oc.chat(**kwargs)
        assert e.value.status_code == status and isinstance(e.value.error, str)
    assert engine.calls == []


def test_ollama_readme_curl_calls_are_read_whatever_the_content_type(http: httpx.Client, engine: FakeEngine) -> None:
    """Ollama's documentation calls the API as ``curl URL -d '{...}'``: a form content type
    (or none) carrying JSON. Ollama reads the JSON; so does pagoda on /api/*."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": 2}})
    for headers in ({"content-type": "application/x-www-form-urlencoded"}, {"content-type": "text/plain"}, {}):
        r = http.post("/api/generate", content=body, headers=headers)
        assert r.status_code == 200, (headers, r.text)
        assert r.json()["done"] is True and r.json()["eval_count"] == 2
    chat = json.dumps({"model": MODEL, "messages": HI, "stream": False, "options": {"num_predict": 1}})
    r = http.post("/api/chat", content=chat, headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["message"]["role"] == "assistant"
    # not JSON at all: Ollama's error shape, naming the problem
    assert "JSON" in error_of(http.post("/api/generate", content="model=x",
                                        headers={"content-type": "application/x-www-form-urlencoded"}), 400)
    # the OpenAI routes keep vLLM's behaviour: JSON only with its content type
    r = http.post("/v1/completions", content=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}),
                  headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]


def test_routing_errors_in_ollama_shape(http: httpx.Client) -> None:
    assert "/api/nothing" in error_of(http.post("/api/nothing", json={}), 404)
    assert "not allowed" in error_of(http.get("/api/chat"), 405)
    assert http.get("/v1/nothing").json()["error"]["code"] == "not_found"  # the OpenAI shape stays


def test_engine_errors(http: httpx.Client, engine: FakeEngine) -> None:
    engine.overloaded = True
    assert "full" in error_of(http.post("/api/chat", json={"model": MODEL, "messages": HI}), 429)
    engine.overloaded = False
    engine.fail_after_steps = 2
    out = lines(http.post("/api/chat", json={"model": MODEL, "messages": HI, "options": {"num_predict": 10}}).text)
    assert out[-1].keys() == {"error"} and "engine" in out[-1]["error"] and out[0]["message"]["content"]
    assert "engine" in error_of(http.post("/api/generate", json={"model": MODEL, "prompt": "x", "stream": False}), 503)


def test_auth_and_body_limit() -> None:
    engine = FakeEngine()
    with running_server(engine, api_key="sekrit", max_body_bytes=2000) as s:
        anonymous = ollama.Client(host=s.base_url)
        with pytest.raises(ollama.ResponseError) as e:
            anonymous.list()
        assert e.value.status_code == 401 and "API key" in e.value.error
        keyed = ollama.Client(host=s.base_url, headers={"Authorization": "Bearer sekrit"})
        assert keyed.list().models and keyed.generate(model=MODEL, prompt="hi", options={"num_predict": 1}).done
        assert httpx.get(f"{s.base_url}/").status_code == 200  # the probe stays open
        big = {"model": MODEL, "prompt": "x" * 5000}
        r = httpx.post(f"{s.base_url}/api/generate", json=big, headers={"Authorization": "Bearer sekrit"})
        assert "larger than the limit" in error_of(r, 413)


def test_drain_answers_503_in_ollama_shape() -> None:
    engine = FakeEngine(step_delay=0.02)
    with running_server(engine, shutdown_timeout=10) as s:
        thread, result = in_background(lambda: httpx.post(
            f"{s.base_url}/api/generate", json={"model": MODEL, "prompt": "hi", "options": {"num_predict": 25}},
            timeout=30))  # fmt: skip
        assert engine.started_event.wait(5)
        s.begin_shutdown()
        assert wait_until(lambda: s.server.state.draining)
        r = httpx.post(f"{s.base_url}/api/chat", json={"model": MODEL, "messages": HI})
        assert "shutting down" in error_of(r, 503)
        thread.join(10)
        assert lines(result[0].text)[-1]["eval_count"] == 25  # the one in flight finished


def test_disconnect_mid_stream_aborts() -> None:
    engine = FakeEngine(step_delay=0.02)
    with running_server(engine) as s, httpx.Client(base_url=s.base_url) as http:
        with http.stream("POST", "/api/chat", json={"model": MODEL, "messages": HI}) as r:
            assert json.loads(next(r.iter_lines()))["done"] is False
        assert engine.abort_event.wait(5)
        assert engine.aborted == [engine.calls[0].request_id] and engine.finished == []
        assert wait_until(lambda: engine.num_unfinished_requests == 0)
        assert_cleaned_up(s)


def test_tool_calls_shape(http: httpx.Client, engine: FakeEngine) -> None:
    """The fake engine cannot call a tool; what it writes goes back as content, and a
    conversation holding Ollama-shaped calls and results is written into the prompt."""
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}  # fmt: skip
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}]  # fmt: skip
    r = http.post("/api/chat", json={"model": MODEL, "messages": messages, "tools": [tool], "stream": False,
                                     "options": {"num_predict": 3}})
    assert r.status_code == 200, r.text
    assert r.json()["message"]["content"] == engine.tokenizer.decode(engine.script[:3])
    prompt = engine.tokenizer.decode(engine.calls[0].prompt_token_ids, skip_special_tokens=False)
    assert "get_weather" in prompt and '"city": "Paris"' in prompt and "sunny, 21 C" in prompt


def test_tool_calls_parsed_into_ollama_shape(oc: ollama.Client, http: httpx.Client, engine: FakeEngine) -> None:
    """The fake engine made to write two calls in the tool parser's format (Hermes)."""
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>')  # fmt: skip
    engine.script = engine.tokenizer.encode(text, add_special_tokens=False)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    kwargs: dict[str, Any] = {"model": MODEL, "messages": HI, "tools": [tool],
                              "options": {"num_predict": len(engine.script)}}  # fmt: skip
    whole = oc.chat(**kwargs)
    expected = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})]
    assert [(c.function.name, dict(c.function.arguments)) for c in whole.message.tool_calls] == expected
    assert whole.message.content == ""
    parts = list(oc.chat(**kwargs, stream=True))
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == expected
    assert "<tool_call>" not in "".join(p.message.content or "" for p in parts)
    # Each call arrives whole, in its own line, numbered.
    raw = lines(http.post("/api/chat", json=kwargs).text)
    with_calls = [line["message"]["tool_calls"] for line in raw if line["message"].get("tool_calls")]
    assert [[c["function"]["index"] for c in calls] for calls in with_calls] == [[0], [1]]
    assert all(c["id"].startswith("call_") for calls in with_calls for c in calls)


def test_lora_adapter_is_a_model(tmp_path) -> None:
    import dataclasses

    engine = FakeEngine()
    engine.config = dataclasses.replace(engine.config, enable_lora=True)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with running_server(engine) as s:
        s.call(engine.add_lora("tuned", str(adapter)))
        oc = ollama.Client(host=s.base_url, timeout=30)
        listed = {m.model: m for m in oc.list().models}
        assert set(listed) == {f"{MODEL}:latest", "tuned:latest"}
        assert listed["tuned:latest"].details.parent_model == f"{MODEL}:latest"
        assert listed["tuned:latest"].digest != listed[f"{MODEL}:latest"].digest
        assert f"ADAPTER {adapter}" in oc.show("tuned").modelfile
        assert [m.name for m in oc.ps().models] == [f"{MODEL}:latest", "tuned:latest"]
        r = oc.generate(model="tuned:latest", prompt="hi", options={"num_predict": 2})
        assert r.model == "tuned:latest" and r.eval_count == 2
