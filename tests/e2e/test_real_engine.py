"""The real server over the real engine-core process and the default model,
driven by the official openai client."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from pagoda.config import EngineConfig
from tests.e2e.server_utils import real_engine_server, running_server

MODEL = "smollm2"
LONG_SYSTEM = (
    "You are the help desk of a small hardware store. You know the opening hours "
    "(nine to six on weekdays, ten to four on Saturdays), the return policy (thirty days "
    "with a receipt), and where things are: paint in aisle three, tools in aisle five, "
    "garden supplies outside. Answer in one short sentence."
)


@pytest.fixture(scope="module")
def real_server():
    with real_engine_server(served_model_name=MODEL) as (engine, running):
        yield engine, running


@pytest.fixture
def client(real_server):
    _, running = real_server
    with openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def _stats(running) -> dict:
    return httpx.get(f"{running.base_url}/v1/engine/stats", timeout=10).json()


def _wait_idle(running, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(running)
        if stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0 and stats["kv_cache_usage"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {stats}")
        time.sleep(0.1)


def test_models_and_health(real_server, client):
    _, running = real_server
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{running.base_url}/health").status_code == 200


def test_chat_and_completions(real_server, client):
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0,
    )
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.completion_tokens <= 16
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    comp = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0)
    assert comp.object == "text_completion"
    assert comp.choices[0].finish_reason == "length"
    assert "5" in comp.choices[0].text
    _wait_idle(real_server[1])


def test_streaming_matches_non_streaming(real_server, client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name three fruits."}],
                  max_tokens=24, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])


def test_n_logprobs_stop_and_seed(real_server, client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=12, temperature=1.0, n=2, seed=123, logprobs=True, top_logprobs=2,
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    for choice in r.choices:
        content = choice.logprobs.content
        assert len(content) == r.usage.completion_tokens // 2 or len(content) <= 12
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=12, temperature=1.0, n=2, seed=123,
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    base = client.completions.create(model=MODEL, prompt="Monday, Tuesday, Wednesday,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    word = text[len(text) // 2:len(text) // 2 + 3]
    assert word.strip()
    stopped = client.completions.create(model=MODEL, prompt="Monday, Tuesday, Wednesday,", max_tokens=12,
                                        temperature=0, stop=[word])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(word)]


def test_cached_tokens_rise_on_repeated_system_prompt(real_server, client):
    def ask(q):
        return client.chat.completions.create(
            model=MODEL, max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": q}],
        ).usage
    first = ask("When do you open on Saturday?")
    second = ask("Where is the paint?")
    assert second.prompt_tokens_details.cached_tokens >= 64
    assert second.prompt_tokens_details.cached_tokens > (first.prompt_tokens_details.cached_tokens or 0)


def test_concurrent_streams_are_batched(real_server, client):
    _, running = real_server
    seen: list[int] = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            seen.append(_stats(running)["step_batch_size"])
            time.sleep(0.05)

    def one(i):
        stream = client.completions.create(model=MODEL, prompt=f"Story number {i}:", max_tokens=16,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in stream if c.choices)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            texts = list(pool.map(one, range(32)))
    finally:
        done.set()
        poller.join()
    assert len(texts) == 32 and all(texts)
    assert max(seen) > 1
    _wait_idle(running)


def test_disconnect_mid_stream_frees_blocks(real_server):
    engine, running = real_server
    body = {"model": MODEL, "prompt": "Write a very long essay about the sea.", "max_tokens": 1000,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{running.base_url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for i, _ in enumerate(resp.iter_lines()):
                if i >= 6:
                    break
        # Leaving the block closed the connection mid-stream.
    stats = _wait_idle(running)
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_engine_crash_gives_503():
    from pagoda.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_config(EngineConfig(show_progress=False, num_kv_blocks=256, max_model_len=1024))
    with running_server(engine, served_model_name=MODEL, shutdown_engine=True) as running:
        url = running.base_url
        assert httpx.get(f"{url}/health").status_code == 200
        os.kill(engine._proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while httpx.get(f"{url}/health").status_code == 200:
            assert time.monotonic() < deadline, "health stayed 200 after the engine died"
            time.sleep(0.1)
        start = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}, timeout=10)
        assert r.status_code == 503
        assert time.monotonic() - start < 2
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}


def test_pagoda_serve_cli_starts_and_stops(tmp_path):
    """What `make serve` runs: the CLI on the bundled model; SIGTERM to the group exits 0."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--port", str(port),
         "--kv-cache-memory", "256MiB", "--max-model-len", "2048"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "w"),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        assert r.json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
        # SIGTERM to the whole process group, as systemd or `timeout` send it:
        # the engine core must outlive the server's drain, and all exit 0.
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stalled_engine_turns_health_red_and_recovers():
    """A frozen engine loop (SIGSTOP) while requests are in flight: /health
    goes 503 within the stall timeout, and back to 200 when it resumes."""
    from pagoda.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_config(EngineConfig(show_progress=False, num_kv_blocks=256, max_model_len=1024),
                                  stall_timeout=1.0)
    with running_server(engine, served_model_name=MODEL, shutdown_engine=True) as running:
        url = running.base_url
        result: dict = {}

        def long_request():
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True})
            result["status"] = r.status_code
            result["tokens"] = r.json()["usage"]["completion_tokens"]

        worker = threading.Thread(target=long_request)
        worker.start()
        deadline = time.monotonic() + 30
        while _stats(running)["num_running_reqs"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(engine._proc.pid, signal.SIGSTOP)
        try:
            time.sleep(1.5)
            assert httpx.get(f"{url}/health").status_code == 503
        finally:
            os.kill(engine._proc.pid, signal.SIGCONT)
        worker.join(120)
        assert result == {"status": 200, "tokens": 64}
        assert httpx.get(f"{url}/health").status_code == 200
