"""Every error status, always in OpenAI's error shape (fake engine behind the real server)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL
from tests.e2e.fake_engine import FakeEngine
from tests.e2e.server_utils import running_server, sse_events

HI = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": HI, "max_tokens": 2}


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


# ---------------------------------------------------------------------- 400
def test_malformed_json(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert error_of(r, 400)["code"] == "invalid_json"
    r = http.post("/v1/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert error_of(r, 400)["type"] == "invalid_request_error"
    # Without a JSON content type the body is not parsed (a CSRF guard); the message says what to send.
    r = http.post("/v1/chat/completions", content=b'{"messages": []}', headers={"content-type": "text/plain"})
    assert "application/json" in error_of(r, 400)["message"]


def test_unknown_field(http: httpx.Client) -> None:
    err = error_of(http.post("/v1/completions", json={"prompt": "x", "prompt_logprob": 1}), 400)
    assert err["param"] == "prompt_logprob" and "prompt_logprob" in err["message"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"logit_bias": {"999999": 1}}, None),  # out of the vocabulary: the engine's check
        ({"tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools.[0].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        # A text-only model: the image part is named.
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                    {"type": "image_url", "image_url": {"url": "u"}}]}]},
         "messages.[0].content.[1]"),
        ({"max_tokens": 100000}, "max_tokens"),
        ({"max_completion_tokens": 100000}, "max_completion_tokens"),
        ({"seed": 2**70}, "seed"),  # beyond 64 bits: a 400 naming the bound, not a 500
    ],
)
def test_chat_bad_params(http: httpx.Client, engine: FakeEngine, extra: dict[str, Any], param: str | None) -> None:
    err = error_of(http.post("/v1/chat/completions", json={**CHAT, **extra}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert engine.calls == []


def test_chat_bad_temperature_with_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HI, temperature=-1)  # type: ignore[arg-type]
    assert info.value.status_code == 400 and info.value.param == "temperature"
    assert "temperature" in info.value.message


@pytest.mark.parametrize(
    "extra, param",
    [({"suffix": "end"}, "suffix"), ({"best_of": 0}, "best_of"),
     ({"prompt": ""}, None), ({"prompt": []}, "prompt"), ({"prompt": [[1, 2], [99999999]]}, None),
     ({"logprobs": 21}, "logprobs")],
)  # fmt: skip
def test_completion_bad_params(http: httpx.Client, extra: dict[str, Any], param: str | None) -> None:
    err = error_of(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", **extra}), 400)
    assert err["param"] == param
    if param == "suffix":
        assert param in err["message"] and "not supported" in err["message"]


def test_context_overflow(http: httpx.Client, engine: FakeEngine) -> None:
    engine.max_model_len = 32
    err = error_of(http.post("/v1/completions", json={"prompt": "word " * 40}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt" and "32" in err["message"]
    err = error_of(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a " * 40}]}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"


def test_bad_chat_template_input(http: httpx.Client) -> None:
    # Any role name goes to the template (as in vLLM), but it must be a non-empty string.
    for role in (5, ""):
        err = error_of(http.post("/v1/chat/completions", json={"messages": [{"role": role, "content": "x"}]}), 400)
        assert err["param"] == "messages.[0].role"


# ---------------------------------------------------------------------- 401
def test_api_key(engine: FakeEngine) -> None:
    with running_server(engine, api_key="sekret") as s, httpx.Client(base_url=s.base_url) as http:
        err = error_of(http.post("/v1/chat/completions", json=CHAT), 401)
        assert err["code"] == "invalid_api_key"
        bad = http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"})
        assert error_of(bad, 401)["code"] == "invalid_api_key"
        assert error_of(http.get("/v1/models"), 401)["code"] == "invalid_api_key"
        assert http.get("/health").status_code == 200  # probes need no key
        assert http.get("/version").status_code == 200
        ok = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="sekret", max_retries=0)
        assert ok.chat.completions.create(model=MODEL, messages=HI, max_tokens=1).choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="wrong", max_retries=0).models.list()


# ---------------------------------------------------------------------- 404 / 405
def test_unknown_model(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=HI)
    assert info.value.code == "model_not_found" and info.value.param == "model"
    assert error_of(http.post("/v1/completions", json={"model": "x", "prompt": "p"}), 404)["code"] == "model_not_found"
    assert error_of(http.post("/tokenize", json={"model": "x", "prompt": "p"}), 404)["code"] == "model_not_found"
    assert error_of(http.get("/v1/models/other"), 404)["code"] == "model_not_found"


def test_unknown_route_and_method(http: httpx.Client) -> None:
    err = error_of(http.post("/v1/nope", json={}), 404)
    assert "/v1/nope" in err["message"]
    error_of(http.get("/nothing/here"), 404)
    err = error_of(http.get("/v1/chat/completions"), 405)
    assert err["code"] == "method_not_allowed"


# ---------------------------------------------------------------------- 413
def test_body_too_large(engine: FakeEngine) -> None:
    with running_server(engine, max_body_bytes=2000) as s, httpx.Client(base_url=s.base_url) as http:
        big = {"model": MODEL, "prompt": "x" * 3000}
        assert error_of(http.post("/v1/completions", json=big), 413)["code"] == "request_too_large"

        def chunked():  # no Content-Length: the limit is enforced while reading
            for _ in range(10):
                yield b" " * 500

        r = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert error_of(r, 413)["code"] == "request_too_large"
    with running_server(engine, max_body_bytes=2000) as s, httpx.Client(base_url=s.base_url) as http:
        assert http.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 1}).status_code == 200
    assert engine.calls and len(engine.calls) == 1


# ---------------------------------------------------------------------- 429 / 503 / 500
def test_engine_overloaded(http: httpx.Client, client: openai.OpenAI, engine: FakeEngine) -> None:
    engine.overloaded = True
    r = http.post("/v1/chat/completions", json=CHAT)
    assert error_of(r, 429)["type"] == "rate_limit_error" and r.headers["retry-after"] == "3"
    r = http.post("/v1/chat/completions", json={**CHAT, "stream": True})  # before the stream starts
    assert error_of(r, 429)["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="x")


def test_engine_dead(http: httpx.Client, engine: FakeEngine) -> None:
    engine.dead = True
    assert error_of(http.post("/v1/chat/completions", json=CHAT), 503)["code"] == "engine_dead"
    assert error_of(http.post("/v1/completions", json={"prompt": "x", "stream": True}), 503)["code"] == "engine_dead"
    assert error_of(http.get("/health"), 503)["code"] == "engine_dead"


def test_engine_dies_mid_stream(http: httpx.Client, client: openai.OpenAI, engine: FakeEngine) -> None:
    engine.fail_after_steps = 2
    events = sse_events(http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10, "stream": True}).text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead"
    assert any(e.get("choices") and e["choices"][0]["delta"].get("content") for e in events[:-2])
    with pytest.raises(openai.APIError):
        list(client.completions.create(model=MODEL, prompt="x", max_tokens=10, stream=True))
    # Not streaming: the whole request fails.
    assert error_of(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 10}), 503)["code"] == "engine_dead"


def test_internal_error_is_generic_500(
    http: httpx.Client, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("secret internals")

    engine.validate_request = broken  # type: ignore[method-assign]
    err = error_of(http.post("/v1/chat/completions", json=CHAT), 500)
    assert err["type"] == "server_error" and "secret" not in err["message"]
    assert "secret internals" in caplog.text  # the traceback went to the log


def test_internal_endpoints_can_require_the_api_key():
    from tests.e2e.fake_engine import FakeEngine
    from tests.e2e.server_utils import running_server

    with running_server(FakeEngine(), api_key="secret", api_key_on_internal_endpoints=True) as running:
        for path in ("/metrics", "/dashboard"):
            r = httpx.get(f"{running.base_url}{path}")
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
            ok = httpx.get(f"{running.base_url}{path}", headers={"Authorization": "Bearer secret"})
            assert ok.status_code == 200
        assert httpx.get(f"{running.base_url}/health").status_code == 200


def test_per_request_list_limits_are_400():
    from tests.e2e.fake_engine import FakeEngine
    from tests.e2e.server_utils import running_server

    with running_server(FakeEngine()) as running:
        url = f"{running.base_url}/v1/completions"
        for extra, param in (({"stop": ["x"] * 65}, "stop"),
                             ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
                             ({"stop_token_ids": list(range(1025))}, "stop_token_ids")):
            r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, **extra})
            assert r.status_code == 400, extra
            assert param in r.json()["error"]["message"]
