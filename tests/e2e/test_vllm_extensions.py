"""vLLM's extensions that its users' clients send, on the wire (fake engine, real HTTP server):
/v1/chat/completions/batch, truncation_side, the Responses API's sampling extras, logprobs and
enable_response_messages, per-request metrics (--enable-per-request-metrics), whole-vocabulary
logprobs under --max-logprobs -1, and /version."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pagoda import __version__
from tests.e2e.fake_engine import FakeEngine
from tests.e2e.server_utils import running_server, sse_events

HI = [{"role": "user", "content": "Hello there"}]
BYE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Goodbye now"}]
METRIC_FIELDS = {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"}


def error_of(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def responses_events(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


# ---------------------------------------------------------------------- /v1/chat/completions/batch
def test_batch_chat_answers_each_conversation_as_chat_would(http: httpx.Client, engine: FakeEngine) -> None:
    singles = [http.post("/v1/chat/completions", json={"messages": m, "max_tokens": 3}).json() for m in (HI, BYE)]
    single_prompts = [c.prompt_token_ids for c in engine.calls]
    r = http.post("/v1/chat/completions/batch", json={"messages": [HI, BYE], "max_tokens": 3, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice, single in zip(body["choices"], singles, strict=True):
        assert choice["message"] == single["choices"][0]["message"]
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 3
    batch_calls = engine.calls[2:]
    # Each conversation is its own engine request, with the prompt chat renders for it.
    assert [c.prompt_token_ids for c in batch_calls] == single_prompts
    assert [c.request_id.rsplit("-", 1)[1] for c in batch_calls] == ["0", "1"]
    assert [c["prompt_token_ids"] for c in body["choices"]] == single_prompts
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(len(p) for p in single_prompts) and usage["completion_tokens"] == 6
    assert "prompt_token_ids" not in body and "metrics" not in body


def test_batch_chat_shares_the_other_fields(http: httpx.Client, engine: FakeEngine) -> None:
    r = http.post("/v1/chat/completions/batch", json={
        "messages": [HI, HI + [{"role": "assistant", "content": "Hi!"}]], "max_tokens": 2, "temperature": 0.5,
        "top_k": 7, "logprobs": True, "top_logprobs": 2, "echo": True, "prompt_logprobs": 1,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert all(c.params.top_k == 7 and c.params.temperature == 0.5 for c in engine.calls)
    assert all(len(c["logprobs"]["content"]) == 2 for c in choices)
    assert all(len(t["top_logprobs"]) == 2 for c in choices for t in c["logprobs"]["content"])
    # echo: the last message comes first where it has the reply's role (not in the first one).
    assert choices[1]["message"]["content"].startswith("Hi!") and not choices[0]["message"]["content"].startswith("Hi!")
    assert all(c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) > 1 for c in choices)


@pytest.mark.parametrize(("fields", "param"), [
    ({"stream": True}, "stream"),
    ({"n": 2}, "n"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"thinking_token_budget": 5}, "thinking_token_budget"),
    ({"kv_transfer_params": {"do_remote_decode": True, "transfer_id": "x"}}, "kv_transfer_params"),
    ({"messages": []}, "messages"),
    ({"messages": [[]]}, "messages.[0]"),
    ({"messages": HI}, "messages.[0]"),   # one conversation, not a list of them
    ({"messages": [HI, [{"role": "user", "content": "word " * 600}]]}, "messages"),
])  # fmt: skip
def test_batch_chat_refusals(http: httpx.Client, engine: FakeEngine, fields: dict[str, Any], param: str) -> None:
    err = error_of(http.post("/v1/chat/completions/batch", json={"messages": [HI, BYE], "max_tokens": 2, **fields}))
    assert err["param"] == param
    if param == "stream":
        assert "/v1/chat/completions/batch" in err["message"]
    if "word " in json.dumps(fields):
        assert err["message"].startswith("Conversation 1 (messages[1]): ")  # which one is too long
    assert engine.calls == []


# ---------------------------------------------------------------------- truncation_side
def test_truncation_side_keeps_the_first_or_the_last_tokens(http: httpx.Client, engine: FakeEngine) -> None:
    prompt = list(range(1000, 1020))
    for side, kept in ((None, prompt[-5:]), ("left", prompt[-5:]), ("right", prompt[:5])):
        extra = {} if side is None else {"truncation_side": side}
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 5, **extra})
        assert r.status_code == 200, r.text
        assert engine.calls[-1].prompt_token_ids == kept
    full = http.post("/tokenize", json={"messages": HI}).json()["tokens"]
    r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "truncate_prompt_tokens": 4,
                                                "truncation_side": "right"})  # fmt: skip
    assert r.status_code == 200 and engine.calls[-1].prompt_token_ids == full[:4]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/score"])
def test_truncation_side_without_truncation_is_a_400(http: httpx.Client, path: str) -> None:
    body = {"/v1/completions": {"prompt": "x"}, "/v1/chat/completions": {"messages": HI},
            "/v1/embeddings": {"input": "x"}, "/v1/score": {"text_1": "a", "text_2": "b"}}[path]  # fmt: skip
    err = error_of(http.post(path, json={**body, "truncation_side": "right"}))
    assert err["param"] == "truncation_side" and "truncate_prompt_tokens" in err["message"]
    assert error_of(http.post(path, json={**body, "truncation_side": "middle"}))["param"] == "truncation_side"


def test_embedding_truncation_side(engine: FakeEngine) -> None:
    """(Through EmbeddingServing.prepare_input; the fake engine generates, so its check is skipped.)"""
    from pagoda.entrypoints.openai.request_group import ServerState
    from pagoda.entrypoints.openai.serving_embedding import EmbeddingServing
    from pagoda.pooling import PoolingParams

    engine.validate_pooling_request = lambda *args, **kwargs: None
    serving = EmbeddingServing(engine, ServerState(), "m", None)
    ids = list(range(100, 110))
    for side, kept in ((None, ids[-3:]), ("left", ids[-3:]), ("right", ids[:3])):
        sub = serving.prepare_input("e", 0, 1, ids, PoolingParams(), 3, None, side)
        assert sub.prompt_token_ids == kept


# ---------------------------------------------------------------------- /v1/responses
def test_responses_take_vllm_sampling_extras(http: httpx.Client, engine: FakeEngine) -> None:
    r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "top_k": 5, "min_p": 0.1,
                                         "repetition_penalty": 1.2, "temperature": 0.7})  # fmt: skip
    assert r.status_code == 200, r.text
    params = engine.calls[-1].params
    assert (params.top_k, params.min_p, params.repetition_penalty) == (5, 0.1, 1.2)
    err = error_of(http.post("/v1/responses", json={"input": "hi", "repetition_penalty": -1}))
    assert err["param"] == "repetition_penalty"


def test_responses_output_text_logprobs(http: httpx.Client, engine: FakeEngine) -> None:
    body = {"input": "hi", "max_output_tokens": 3, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    response = r.json()
    assert engine.calls[-1].params.logprobs == 2 and response["top_logprobs"] == 2
    logprobs = response["output"][0]["content"][0]["logprobs"]
    assert len(logprobs) == 3
    for entry in logprobs:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]   # the fake engine's sampled token ranks first
    # The same on the chat route, token for token.
    chat = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 3, "logprobs": True,
                                                   "top_logprobs": 2}).json()  # fmt: skip
    assert [e["token"] for e in logprobs] == [e["token"] for e in chat["choices"][0]["logprobs"]["content"]]
    # Streamed: the deltas carry them (without bytes), the done event and the final response all of them.
    events = responses_events(http.post("/v1/responses", json={**body, "stream": True}))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert sum(len(d["logprobs"]) for d in deltas) == 3
    assert all("bytes" not in lp for d in deltas for lp in d["logprobs"])
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    assert [lp["token"] for lp in done["logprobs"]] == [e["token"] for e in logprobs]
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["logprobs"] == logprobs
    # Without the include, no logprobs are computed and none sent.
    plain = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}).json()
    assert plain["output"][0]["content"][0]["logprobs"] == [] and engine.calls[-1].params.logprobs is None


def test_responses_logprobs_refusals(http: httpx.Client) -> None:
    err = error_of(http.post("/v1/responses", json={"input": "hi", "top_logprobs": 2}))
    assert err["param"] == "top_logprobs" and "message.output_text.logprobs" in err["message"]
    err = error_of(http.post("/v1/responses", json={"input": "hi", "top_logprobs": 21,
                                                    "include": ["message.output_text.logprobs"]}))  # fmt: skip
    assert err["param"] == "top_logprobs" and "20" in err["message"]


def test_responses_enable_response_messages(http: httpx.Client, engine: FakeEngine) -> None:
    body = {"input": "hi", "max_output_tokens": 3, "enable_response_messages": True}
    response = http.post("/v1/responses", json=body).json()
    call = engine.calls[-1]
    [prompt] = response["input_messages"]
    assert prompt["type"] == "raw_message_tokens" and prompt["tokens"] == call.prompt_token_ids
    assert prompt["message"] == call.prompt   # the prompt as the chat template rendered it
    [output] = response["output_messages"]
    assert output["message"] == response["output"][0]["content"][0]["text"] and len(output["tokens"]) == 3
    final = responses_events(http.post("/v1/responses", json={**body, "stream": True}))[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["output_messages"][0]["tokens"] == output["tokens"]
    plain = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1}).json()
    assert "input_messages" not in plain and "output_messages" not in plain


# ---------------------------------------------------------------------- per-request metrics
@pytest.fixture(scope="module")
def metrics_http() -> Iterator[httpx.Client]:
    with running_server(FakeEngine(), enable_per_request_metrics=True) as s, \
            httpx.Client(base_url=s.base_url, timeout=30) as http:  # fmt: skip
        yield http


def _check_metrics(metrics: dict[str, Any], tokens: int) -> None:
    assert set(metrics) == METRIC_FIELDS
    for name in ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms"):
        assert metrics[name] >= 0, name
    assert metrics["tokens_per_second"] > 0
    if tokens > 1:
        assert metrics["mean_itl_ms"] == pytest.approx(metrics["generation_time_ms"] / (tokens - 1))
    else:
        assert metrics["mean_itl_ms"] is None


def test_per_request_metrics(metrics_http: httpx.Client) -> None:
    chat = metrics_http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 3}).json()
    _check_metrics(chat["metrics"], 3)
    one = metrics_http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).json()
    _check_metrics(one["metrics"], 1)
    response = metrics_http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}).json()
    _check_metrics(response["metrics"], 2)
    # Streamed: on the usage chunk (chat, completions), in response.completed's response (here incomplete).
    events = sse_events(metrics_http.post("/v1/chat/completions", json={
        "messages": HI, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}).text)  # fmt: skip
    assert [e for e in events[:-2] if "metrics" in e] == []
    _check_metrics(events[-2]["metrics"], 2)
    events = sse_events(metrics_http.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}).text)  # fmt: skip
    _check_metrics(events[-2]["metrics"], 2)
    final = responses_events(metrics_http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                                                      "stream": True}))[-1]  # fmt: skip
    _check_metrics(final["response"]["metrics"], 2)


def test_no_per_request_metrics_where_they_are_not_one_streams(metrics_http: httpx.Client, http: httpx.Client) -> None:
    """None for n > 1, several prompts, a batch; none without the flag (the key left out)."""
    for path, body in (("/v1/chat/completions", {"messages": HI, "n": 2, "temperature": 1.0}),
                       ("/v1/completions", {"prompt": ["a", "b"]}),
                       ("/v1/chat/completions/batch", {"messages": [HI, BYE]})):  # fmt: skip
        r = metrics_http.post(path, json={**body, "max_tokens": 2})
        assert r.status_code == 200 and "metrics" not in r.json(), path
    assert "metrics" not in http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2}).json()
    # A stream without a usage chunk has nowhere to carry them (as vLLM).
    events = sse_events(metrics_http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2,
                                                                        "stream": True}).text)  # fmt: skip
    assert all("metrics" not in e for e in events[:-1])


# ---------------------------------------------------------------------- whole-vocabulary logprobs, /version
def test_minus_one_logprobs_under_max_logprobs_minus_one(http: httpx.Client, engine: FakeEngine) -> None:
    """-1 asks for the whole vocabulary: a 400 under the default bound, accepted (and handed
    to the engine as -1) with --max-logprobs -1, on every route that has logprobs."""
    requests = [("/v1/completions", {"prompt": "x", "logprobs": -1}),
                ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}),
                ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": -1}),
                ("/v1/responses", {"input": "hi", "top_logprobs": -1, "include": ["message.output_text.logprobs"]})]
    for path, body in requests:
        err = error_of(http.post(path, json={**body, "max_tokens": 1} if "input" not in body else body))
        assert "whole vocabulary" in err["message"], path
    engine.config = dataclasses.replace(engine.config, max_logprobs=-1)
    for path, body in requests:
        r = http.post(path, json={**body, "max_tokens": 1} if "input" not in body else {**body, "max_output_tokens": 1})
        assert r.status_code == 200, r.text
        params = engine.calls[-1].params
        assert -1 in (params.logprobs, params.prompt_logprobs), path


def test_version_is_vllms_shape(http: httpx.Client) -> None:
    assert http.get("/version").json() == {"version": __version__}


# ---------------------------------------------------------------------- kv_transfer_params.prompt_token_ids
@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "Hello there"}),
                                        ("/v1/chat/completions", {"messages": HI})])
def test_a_decode_instance_takes_the_prefill_instances_prompt(http: httpx.Client, engine: FakeEngine,
                                                              path: str, body: dict) -> None:  # fmt: skip
    ids = [1001, 1002, 1003, 1004, 1005, 1006, 1007]
    transfer = {"do_remote_prefill": True, "transfer_id": "t1", "remote_address": "tcp://127.0.0.1:9",
                "prompt_token_ids": ids}
    r = http.post(path, json={**body, "max_tokens": 2, "return_token_ids": True, "kv_transfer_params": transfer})
    assert r.status_code == 200, r.text
    assert engine.calls[-1].prompt_token_ids == ids and r.json()["usage"]["prompt_tokens"] == len(ids)
    err = error_of(http.post(path, json={**body, "kv_transfer_params": {**transfer, "prompt_token_ids": []}}))
    assert "prompt_token_ids must be a non-empty list" in err["message"]
