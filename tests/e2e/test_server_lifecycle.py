"""Request lifetimes: client disconnects, timeouts, the queue bound, graceful shutdown (fake engine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import MODEL
from tests.e2e.fake_engine import FakeEngine
from tests.e2e.server_utils import RunningServer, running_server, sse_events

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HI = [{"role": "user", "content": "hi"}]
LONG_CHAT = {"model": MODEL, "messages": HI, "max_tokens": 400}


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    return thread, result


def assert_cleaned_up(server: RunningServer) -> None:
    state = server.server.state
    assert wait_until(lambda: not state.groups and state.num_waiting == 0 and state.num_active_http == 0)


@pytest.fixture
def slow_engine() -> FakeEngine:
    return FakeEngine(step_delay=0.02)


# ---------------------------------------------------------------------- client disconnects
def test_disconnect_mid_stream_aborts(slow_engine: FakeEngine) -> None:
    with running_server(slow_engine) as s, httpx.Client(base_url=s.base_url) as http:
        with http.stream("POST", "/v1/chat/completions", json={**LONG_CHAT, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if '"content":" ' in line)
        # Leaving the block closes the connection mid-stream.
        assert slow_engine.abort_event.wait(5)
        assert slow_engine.aborted == [slow_engine.calls[0].request_id] and slow_engine.finished == []
        assert_cleaned_up(s)


def test_disconnect_while_waiting_aborts(slow_engine: FakeEngine) -> None:
    with running_server(slow_engine) as s:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{s.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 400}, timeout=0.3)
        assert slow_engine.abort_event.wait(5)
        assert slow_engine.finished == []
        # Also a stream whose client leaves before the first token.
        slow_engine.abort_event.clear()
        slow_engine.hold_first_token = True
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{s.base_url}/v1/completions", json={"prompt": "x", "stream": True}, timeout=0.3)
        assert slow_engine.abort_event.wait(5) and len(slow_engine.aborted) == 2
        assert_cleaned_up(s)


# ---------------------------------------------------------------------- request timeout
def test_request_timeout(slow_engine: FakeEngine) -> None:
    with running_server(slow_engine, request_timeout=0.3) as s, httpx.Client(base_url=s.base_url) as http:
        r = http.post("/v1/chat/completions", json=LONG_CHAT)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        events = sse_events(http.post("/v1/chat/completions", json={**LONG_CHAT, "stream": True}).text)
        assert events[-2]["error"]["code"] == "request_timeout" and events[-1] == "[DONE]"
        assert len(slow_engine.aborted) == 2 and slow_engine.finished == []
        # A quick request is unaffected.
        assert http.post("/v1/chat/completions", json={**LONG_CHAT, "max_tokens": 2}).status_code == 200
        assert_cleaned_up(s)


# ---------------------------------------------------------------------- queue bound
def test_max_num_queued_requests(engine: FakeEngine) -> None:
    engine.hold_first_token = True
    with running_server(engine, max_num_queued_requests=1) as s, httpx.Client(base_url=s.base_url) as http:
        thread, result = in_background(lambda: httpx.post(f"{s.base_url}/v1/chat/completions",
                                                          json={**LONG_CHAT, "max_tokens": 3}, timeout=30))  # fmt: skip
        assert wait_until(lambda: len(engine.calls) == 1)
        r = http.post("/v1/chat/completions", json={**LONG_CHAT, "max_tokens": 3})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert http.get("/v1/engine/stats").json()["server_num_waiting_requests"] == 1
        # More prompts than could ever be queued: not a matter of retrying.
        r = http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        engine.hold_first_token = False
        thread.join(10)
        assert result[0].status_code == 200
        # Started requests no longer count against the bound.
        assert http.post("/v1/chat/completions", json={**LONG_CHAT, "max_tokens": 3}).status_code == 200
        assert_cleaned_up(s)


# ---------------------------------------------------------------------- graceful shutdown
def test_drain_lets_requests_finish(slow_engine: FakeEngine) -> None:
    with running_server(slow_engine, shutdown_timeout=10) as s:
        thread, result = in_background(lambda: httpx.post(
            f"{s.base_url}/v1/chat/completions", json={**LONG_CHAT, "max_tokens": 25, "stream": True}, timeout=30))
        assert slow_engine.started_event.wait(5)
        s.begin_shutdown()
        assert wait_until(lambda: s.server.state.draining)
        r = httpx.post(f"{s.base_url}/v1/chat/completions", json=LONG_CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        assert httpx.get(f"{s.base_url}/health").status_code == 503
        thread.join(10)
        events = sse_events(result[0].text)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        s.thread.join(10)
        assert not s.thread.is_alive()  # the server stopped by itself once drained
    assert slow_engine.aborted == []


def test_drain_timeout_aborts_the_rest(slow_engine: FakeEngine) -> None:
    with running_server(slow_engine, shutdown_timeout=0.3) as s:
        stream, stream_result = in_background(lambda: httpx.post(
            f"{s.base_url}/v1/chat/completions", json={**LONG_CHAT, "stream": True}, timeout=30))
        plain, plain_result = in_background(lambda: httpx.post(
            f"{s.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 400}, timeout=30))
        assert wait_until(lambda: len(slow_engine.calls) == 2) and slow_engine.started_event.wait(5)
        s.begin_shutdown()
        stream.join(10)
        plain.join(10)
        events = sse_events(stream_result[0].text)
        assert events[-2]["error"]["code"] == "server_shutting_down" and events[-1] == "[DONE]"
        assert plain_result[0].status_code == 503
        s.thread.join(10)
        assert not s.thread.is_alive()
    assert len(slow_engine.aborted) == 2 and slow_engine.finished == []


def test_sigterm_drains_and_exits_zero() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.fake_server_main", "--step-delay", "0.02", "--shutdown-timeout", "10"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("PORT "), line + (proc.stderr.read() if proc.stderr else "")
        base = f"http://127.0.0.1:{int(line.split()[1])}"
        started = threading.Event()

        def stream() -> list[Any]:
            body = {**LONG_CHAT, "max_tokens": 30, "stream": True}
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as r:
                chunks = []
                for chunk in r.iter_text():
                    chunks.append(chunk)
                    started.set()
                return sse_events("".join(chunks))

        thread, result = in_background(stream)
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: httpx.get(f"{base}/health").status_code == 503)
        r = httpx.post(f"{base}/v1/chat/completions", json=LONG_CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        thread.join(20)
        assert result[0][-1] == "[DONE]" and result[0][-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(20) == 0
        assert "ENGINE SHUTDOWN True ABORTED 0 FINISHED 1" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
