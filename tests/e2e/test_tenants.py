"""Priority, cache_salt and tenants at the HTTP edge (fake engine behind the real server)."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from pagoda.config import EngineConfig
from pagoda.tenants import TenantSpec
from tests.e2e.fake_engine import FakeEngine
from tests.e2e.server_utils import DEFAULT_MODEL_NAME, running_server
from tests.e2e.test_openai_errors import error_of

BODY = {"model": DEFAULT_MODEL_NAME, "prompt": "Hello", "max_tokens": 2}


def test_priority_and_cache_salt_reach_the_engine_or_get_400() -> None:
    engine = FakeEngine()
    engine.config = EngineConfig()  # fcfs
    with running_server(engine) as server, httpx.Client(base_url=server.base_url, timeout=30) as http:
        err = error_of(http.post("/v1/completions", json={**BODY, "priority": 3}), 400)
        assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"]
        assert not engine.calls
        assert http.post("/v1/completions", json={**BODY, "priority": 0}).status_code == 200
        r = http.post("/v1/chat/completions", json={"model": DEFAULT_MODEL_NAME, "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": "hi"}],
                                                    "cache_salt": "tenant-a-secret"})  # fmt: skip
        assert r.status_code == 200 and engine.calls[-1].cache_salt == "tenant-a-secret"
        assert error_of(http.post("/v1/completions", json={**BODY, "cache_salt": ""}), 400)["param"] == "cache_salt"
        assert error_of(http.post("/v1/completions", json={**BODY, "priority": "1"}), 400)["param"] == "priority"
        engine.config = EngineConfig(scheduling_policy="priority")
        assert http.post("/v1/completions", json={**BODY, "priority": -2}).status_code == 200
        assert engine.calls[-1].priority == -2
        # Without API keys, X-Tenant names the tenant.
        assert http.post("/v1/completions", json=BODY, headers={"X-Tenant": "team-7"}).status_code == 200
        assert engine.calls[-1].tenant == "team-7"
        assert http.post("/v1/completions", json=BODY).status_code == 200 and engine.calls[-1].tenant is None
        err = error_of(http.post("/v1/completions", json=BODY, headers={"X-Tenant": "a b"}), 400)
        assert err["param"] == "X-Tenant"


def test_api_keys_name_the_tenant_and_bound_its_queue() -> None:
    keys = {"sk-alice": TenantSpec("alice", weight=2, max_queued=1), "sk-bob": TenantSpec("bob")}
    engine = FakeEngine()
    with running_server(engine, api_keys=keys) as server:
        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=30)

        out = client("sk-alice").completions.create(model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=2)
        assert out.choices and engine.calls[-1].tenant == "alice"
        # The header cannot override the key's tenant.
        client("sk-bob").completions.create(model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=2,
                                            extra_headers={"X-Tenant": "alice"})  # fmt: skip
        assert engine.calls[-1].tenant == "bob"
        with pytest.raises(openai.AuthenticationError):
            client("sk-mallory").completions.create(model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=2)
        # alice may have one request waiting for its first token; bob is not affected.
        engine.hold_first_token = True
        first = threading.Thread(target=lambda: client("sk-alice").completions.create(
            model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=2))
        first.start()
        deadline = time.monotonic() + 10
        while engine._running < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError, match="tenant 'alice'"):
            client("sk-alice").completions.create(model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=2)
        bob = threading.Thread(target=lambda: client("sk-bob").completions.create(
            model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=2))
        bob.start()
        while engine._running < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine._running == 2
        engine.hold_first_token = False
        first.join(10)
        bob.join(10)
        assert not first.is_alive() and not bob.is_alive()
        assert server.server.state.num_waiting_by_tenant == {} and server.server.state.num_waiting == 0
        client("sk-alice").completions.create(model=DEFAULT_MODEL_NAME, prompt="Hi", max_tokens=2)
