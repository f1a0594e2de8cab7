"""Fault handling: the engine-core process killed (SIGKILL) while requests are in flight.

In-flight requests must end promptly with a clean error (an SSE error event then [DONE]
for streams, a 503 for plain requests), /health must turn 503, and new requests get 503.
There is no auto-restart: the server stays up but unhealthy, for the orchestrator to replace.
SIGTERM drain is covered by tests/e2e/test_server_lifecycle.py::test_sigterm_drains_and_exits_zero.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import httpx

from pagoda.config import EngineConfig
from tests.e2e.server_utils import running_server

MODEL = "smollm2"


def _request(url: str, stream: bool, started: threading.Event, results: list[Any]) -> None:
    body = {"model": MODEL, "prompt": "Write a long story about the sea.", "max_tokens": 400,
            "ignore_eos": True, "stream": stream}
    t0 = time.monotonic()
    try:
        if stream:
            events: list[Any] = []
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        events.append(data if data == "[DONE]" else json.loads(data))
                        started.set()
            results.append(("stream", r.status_code, events, time.monotonic() - t0))
        else:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            results.append(("plain", r.status_code, r.json(), time.monotonic() - t0))
    except Exception as e:  # a hang or a dropped connection is what this test rules out
        results.append(("exception", None, repr(e), time.monotonic() - t0))


def test_engine_killed_mid_load():
    from pagoda.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_config(EngineConfig(show_progress=False, num_kv_blocks=256, max_model_len=512),
                                  log_requests=False, log_stats=False)  # fmt: skip
    with running_server(engine, served_model_name=MODEL, shutdown_engine=True) as running:
        url = running.base_url
        started = threading.Event()
        results: list[Any] = []
        threads = [threading.Thread(target=_request, args=(url, i % 2 == 0, started, results)) for i in range(4)]
        for t in threads:
            t.start()
        assert started.wait(120), "no stream started"
        time.sleep(0.3)
        os.kill(engine._proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "an in-flight request hung after the engine died"
        assert time.monotonic() - killed_at < 15
        assert len(results) == 4
        for kind, status, payload, _ in results:
            assert kind != "exception", payload
            if kind == "stream":
                assert status == 200
                assert payload[-1] == "[DONE]", payload[-3:]
                err = payload[-2]["error"]
                assert err["code"] == "engine_dead" or "engine" in err["message"].lower(), err
            else:
                assert status == 503, payload
                assert set(payload["error"]) >= {"message", "type", "param", "code"}
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=10,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 503


def test_shutdown_returns_when_the_engine_died_before_any_request():
    # No request ever ran, so no watcher noticed the death: shutdown must not wait on a
    # Shutdown message the gone core never takes (a SIGINT to `pagoda serve` then hung).
    import asyncio

    from pagoda.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_config(EngineConfig(show_progress=False, num_kv_blocks=64, max_model_len=256),
                                  log_requests=False, log_stats=False)  # fmt: skip
    os.kill(engine._proc.pid, signal.SIGKILL)
    engine._proc.join(10)
    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(engine.shutdown(), 30))
    assert time.monotonic() - t0 < 15
    assert not engine.is_healthy
