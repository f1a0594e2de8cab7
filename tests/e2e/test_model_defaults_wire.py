"""A model's own defaults (an Ollama model's params and system layers, pagoda/hub/stores.py)
apply in every dialect where a request leaves the field unset, and the request's own
fields win: chat, Ollama, Anthropic and Responses, over the fake engine."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import pytest

from pagoda.hub.stores import ModelDefaults
from tests.e2e.conftest import MODEL
from tests.e2e.fake_engine import FakeEngine
from tests.e2e.server_utils import RunningServer, running_server

DEFAULTS = ModelDefaults(sampling={"temperature": 0.25, "top_k": 7, "stop": ["STOP"]}, system="Be brief.")
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def _shared_server() -> Iterator[tuple[FakeEngine, RunningServer]]:
    engine = FakeEngine()
    with running_server(engine, model_defaults=DEFAULTS) as running:
        yield engine, running


def _last(engine: FakeEngine):
    call = engine.calls[-1]
    return call.params, call.prompt or ""


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 2}),
    ("/api/chat", {"model": MODEL, "messages": HI, "stream": False, "options": {"num_predict": 2}}),
    ("/v1/messages", {"model": MODEL, "messages": HI, "max_tokens": 2}),
    ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "store": False}),
])
def test_defaults_where_the_request_is_silent(server: RunningServer, engine: FakeEngine, route: str, body: dict) -> None:
    r = httpx.post(f"{server.base_url}{route}", json=body, timeout=30)
    assert r.status_code == 200, r.text
    params, prompt = _last(engine)
    assert (params.temperature, params.top_k, params.stop) == (0.25, 7, ["STOP"])
    assert "Be brief." in prompt  # the default system prompt


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0.9}),
    ("/api/chat", {"model": MODEL, "messages": HI, "stream": False, "options": {"num_predict": 2, "temperature": 0.9}}),
    ("/v1/messages", {"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0.9}),
    ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "store": False, "temperature": 0.9}),
])
def test_the_request_wins(server: RunningServer, engine: FakeEngine, route: str, body: dict) -> None:
    r = httpx.post(f"{server.base_url}{route}", json=body, timeout=30)
    assert r.status_code == 200, r.text
    params, _ = _last(engine)
    assert params.temperature == 0.9 and params.top_k == 7


def test_a_system_message_replaces_the_default(server: RunningServer, engine: FakeEngine) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    client.messages.create(model=MODEL, max_tokens=2, system="Answer in French.", messages=HI)
    _, prompt = _last(engine)
    assert "Answer in French." in prompt and "Be brief." not in prompt
