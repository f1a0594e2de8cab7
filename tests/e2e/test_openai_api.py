"""Wire format of the OpenAI-compatible API, driven by the official client and raw HTTP (fake engine)."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from pagoda import __version__
from tests.e2e.conftest import MODEL
from tests.e2e.fake_engine import FakeEngine
from tests.e2e.server_utils import sse_events

HI = [{"role": "user", "content": "Hello there"}]


def script_text(engine: FakeEngine, num_tokens: int, offset: int = 0) -> str:
    return engine.tokenizer.decode(engine.script[offset : offset + num_tokens])


def chat_prompt_ids(engine: FakeEngine, messages: list[dict[str, Any]]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------- models & misc endpoints
def test_models(client: openai.OpenAI, http: httpx.Client, engine: FakeEngine) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model" and models[0].owned_by == "pagoda" and models[0].created > 0
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == engine.max_model_len
    assert client.models.retrieve(MODEL).id == MODEL


def test_health_version_stats_openapi(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200 and http.get("/health").json() == {}
    assert http.get("/version").json() == {"version": __version__}
    stats = http.get("/v1/engine/stats").json()
    assert stats["kv_cache_usage"] == 0.25 and stats["num_running_reqs"] == 0
    assert stats["prefix_cache_hit_rate"] == 0.4 and "server_num_waiting_requests" in stats
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize"} <= set(paths)


def test_tokenize_detokenize(http: httpx.Client, engine: FakeEngine) -> None:
    out = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert out["tokens"] == engine.tokenizer.encode("Hello world")
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == engine.max_model_len
    assert http.post("/detokenize", json={"tokens": out["tokens"]}).json() == {"prompt": "Hello world"}
    chat_out = http.post("/tokenize", json={"messages": HI}).json()
    assert chat_out["tokens"] == chat_prompt_ids(engine, HI)


# ---------------------------------------------------------------------- chat
def test_chat_basic(client: openai.OpenAI, http: httpx.Client, engine: FakeEngine) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion" and resp.model == MODEL
    assert resp.system_fingerprint == f"pagoda-{__version__}"
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == script_text(engine, 5)
    assert choice.finish_reason == "length" and choice.index == 0 and choice.logprobs is None
    prompt_ids = chat_prompt_ids(engine, HI)
    assert engine.calls[0].prompt_token_ids == prompt_ids
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (
        len(prompt_ids), 5, len(prompt_ids) + 5)
    assert resp.usage.prompt_tokens_details is not None and resp.usage.prompt_tokens_details.cached_tokens == 0

    # Exactly OpenAI's keys, nulls included.
    raw = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 2}).json()
    assert set(raw) == {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
    assert set(raw["choices"][0]) == {"index", "message", "logprobs", "finish_reason"}
    assert raw["choices"][0]["message"] == {"role": "assistant", "content": script_text(engine, 2), "refusal": None}
    assert raw["usage"]["prompt_tokens_details"] == {"cached_tokens": 16 * (len(prompt_ids) // 16)}


def test_chat_default_max_tokens_fills_context(client: openai.OpenAI, engine: FakeEngine) -> None:
    engine.max_model_len = 64
    resp = client.chat.completions.create(model=MODEL, messages=HI)
    prompt_len = len(chat_prompt_ids(engine, HI))
    assert engine.calls[0].params.max_tokens == 64 - prompt_len
    assert resp.usage is not None and resp.usage.completion_tokens == 64 - prompt_len


def test_chat_n_and_params_passthrough(client: openai.OpenAI, engine: FakeEngine) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=HI, max_completion_tokens=3, n=2, temperature=0.7, top_p=0.8, seed=11,
        presence_penalty=0.1, frequency_penalty=0.2, logit_bias={"50": 2.0}, user="someone",
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 1, "ignore_eos": True,
                    "stop_token_ids": [7], "skip_special_tokens": False, "include_stop_str_in_output": True},
    )  # fmt: skip
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.message.content for c in resp.choices] == [script_text(engine, 3), script_text(engine, 3, 1)]
    assert resp.usage is not None and resp.usage.completion_tokens == 6
    p = engine.calls[0].params
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.seed) == (2, 3, 0.7, 0.8, 11)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.1, 0.2, {50: 2.0})
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens) == (5, 0.1, 1.2, 1)
    assert p.ignore_eos and p.stop_token_ids == [7] and not p.skip_special_tokens and p.include_stop_str_in_output


def test_chat_stop(client: openai.OpenAI, engine: FakeEngine) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=20, stop=[" fox", "zzz"])
    assert resp.choices[0].message.content == " The quick brown" and resp.choices[0].finish_reason == "stop"
    resp = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=20, stop=" fox",
                                          extra_body={"include_stop_str_in_output": True})  # fmt: skip
    assert resp.choices[0].message.content == " The quick brown fox"


def test_chat_logprobs(client: openai.OpenAI, engine: FakeEngine) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, logprobs=True, top_logprobs=2)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 3
    tokens = [engine.tokenizer.decode([t]) for t in engine.script[:3]]
    assert [e.token for e in lp.content] == tokens
    assert [e.logprob for e in lp.content] == [-0.25, -0.26, -0.27]
    for entry in lp.content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[1].logprob == entry.logprob - 1
    # logprobs without top_logprobs: the sampled tokens only.
    resp = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, logprobs=True)
    assert resp.choices[0].logprobs is not None and resp.choices[0].logprobs.content is not None
    assert [e.top_logprobs for e in resp.choices[0].logprobs.content] == [[], []]


def test_chat_stream_raw(http: httpx.Client, engine: FakeEngine) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["prompt_tokens"] == len(chat_prompt_ids(engine, HI))
    for i in range(2):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all(set(c) == {"index", "delta", "logprobs", "finish_reason"} for c in mine)
        # As vLLM: the last content delta carries the finish reason; no empty chunk only for it.
        assert mine[-1]["finish_reason"] == "length" and mine[-1]["delta"]["content"]
        assert all(c["finish_reason"] is None and c["delta"] for c in mine[:-1])
        assert "".join(c["delta"].get("content", "") for c in mine) == script_text(engine, 3, i)


def test_chat_stream_client(client: openai.OpenAI, engine: FakeEngine) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, stream=True, stop=" over",
                                            logprobs=True, top_logprobs=1)  # fmt: skip
    chunks = list(stream)
    assert all(c.usage is None for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == " The quick brown fox jumps"
    assert chunks[-1].choices[0].finish_reason == "stop"
    tokens = [e.token for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert len(tokens) == 6  # the stop string's token has a logprob though its text was cut


def test_chat_stream_without_usage_has_no_usage_key(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": 2, "stream": True}
    events = sse_events(http.post("/v1/chat/completions", json=body).text)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])


# ---------------------------------------------------------------------- completions
def test_completion_basic(client: openai.OpenAI, http: httpx.Client, engine: FakeEngine) -> None:
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert resp.choices[0].text == script_text(engine, 4) and resp.choices[0].finish_reason == "length"
    assert engine.calls[0].prompt_token_ids == engine.tokenizer.encode("Once upon a time")
    assert engine.calls[0].prompt == "Once upon a time"
    raw = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}).json()
    assert set(raw["choices"][0]) == {"text", "index", "logprobs", "finish_reason"}
    assert set(raw) == {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}


def test_completion_prompt_forms_and_indexing(client: openai.OpenAI, engine: FakeEngine) -> None:
    resp = client.completions.create(model=MODEL, prompt=["a b", "c"], max_tokens=2, n=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    texts = [script_text(engine, 2), script_text(engine, 2, 1)]
    assert [c.text for c in resp.choices] == texts * 2
    assert resp.usage is not None
    prompt_tokens = len(engine.tokenizer.encode("a b")) + len(engine.tokenizer.encode("c"))
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (prompt_tokens, 8)
    assert len(engine.calls) == 2 and engine.calls[0].request_id != engine.calls[1].request_id

    resp = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=1)
    assert engine.calls[-1].prompt_token_ids == [5, 6, 7] and engine.calls[-1].prompt is None
    resp = client.completions.create(model=MODEL, prompt=[[5, 6], [7]], max_tokens=1)
    assert [c.prompt_token_ids for c in engine.calls[-2:]] == [[5, 6], [7]]
    assert resp.usage is not None and resp.usage.prompt_tokens == 3


def test_completion_logprobs(client: openai.OpenAI, engine: FakeEngine) -> None:
    resp = client.completions.create(model=MODEL, prompt="x", max_tokens=3, logprobs=2)
    lp = resp.choices[0].logprobs
    assert lp is not None
    tokens = [engine.tokenizer.decode([t]) for t in engine.script[:3]]
    assert lp.tokens == tokens and lp.token_logprobs == [-0.25, -0.26, -0.27]
    assert lp.text_offset == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]
    assert lp.top_logprobs is not None
    assert all(len(d) == 2 and t in d for d, t in zip(lp.top_logprobs, tokens, strict=True))


def test_completion_stream(http: httpx.Client, engine: FakeEngine) -> None:
    body = {"model": MODEL, "prompt": ["p one", "p two"], "max_tokens": 3, "n": 2, "stream": True,
            "logprobs": 1, "stream_options": {"include_usage": True}}  # fmt: skip
    events = sse_events(http.post("/v1/completions", json=body).text)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 12
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    for index in range(4):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == script_text(engine, 3, index % 2)
        assert mine[-1]["finish_reason"] == "length"
        offsets = [o for c in mine if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        assert offsets[0] == 0 and offsets == sorted(offsets) and len(offsets) == 3


def test_completion_stream_client(client: openai.OpenAI, engine: FakeEngine) -> None:
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="x", max_tokens=5, stream=True) if c.choices)  # fmt: skip
    assert text == script_text(engine, 5)


def test_cached_tokens_reported(client: openai.OpenAI) -> None:
    prompt = "word " * 40
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 16 * (second.usage.prompt_tokens // 16) > 0
