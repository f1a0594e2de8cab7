"""Prefill-decode disaggregation end to end: one prefill and two decode instances of the
bundled model (real servers and engine-core processes on loopback) behind `pagoda router`.

Greedy answers through the router equal the same request served colocated (the prefill
instance answers plain requests itself), streamed or not, over shared memory and over TCP;
every KV block is free again on both sides after a request, after a client disconnect
mid-stream, and after a decode instance is killed: a stream it was serving ends with an
error event, and the next request is retried on the other decode instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from pagoda.config import EngineConfig
from pagoda.entrypoints.kv_transfer.router import PDRouter, build_router_app
from tests.e2e.server_utils import running_server, sse_events

MODEL = "smollm2"
PROMPT = ("The lighthouse keeper kept a log of every ship that passed the rocks. On the first page he wrote "
          "the names of the boats, their flags and the weather, and on the second page ")   # ~40 tokens
LONG_PROMPT = PROMPT * 3   # past a 64-token block boundary


def _config(role: str, **kv) -> EngineConfig:
    return EngineConfig(show_progress=False, num_kv_blocks=48, max_model_len=1024, kv_role=role,
                        kv_transfer_config=kv or None)


@pytest.fixture(scope="module")
def instances():
    """(prefill, decode over shm, decode over tcp): (engine, base url) each."""
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.engine.core_proc import start_core_process

    configs = [_config("prefill", timeout_s=20), _config("decode", transport="shm"),
               _config("decode", transport="tcp")]
    cores = [start_core_process(c) for c in configs]   # the three load at once
    engines = [AsyncLLM.from_config(c, core=core, log_requests=False, log_stats=False)
               for c, core in zip(configs, cores)]  # fmt: skip
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(running_server(e, served_model_name=MODEL, shutdown_engine=True)).base_url
                for e in engines]  # fmt: skip
        yield list(zip(engines, urls))


@contextlib.contextmanager
def serve_router(prefill: list[str], decode: list[str], **kw):
    router = PDRouter(prefill, decode, **kw)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_router_app(router), log_level="warning"))
    errors: list[BaseException] = []

    async def main() -> None:
        try:
            await router.start(30)
            await server.serve(sockets=[sock])
        finally:
            await router.close()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert not errors and thread.is_alive(), errors
        assert time.monotonic() < deadline, "router did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", router
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


def _complete(url: str, prompt: str = PROMPT, **kw) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, **kw}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _stream_text(url: str, path: str, body: dict) -> tuple[str, dict | None, list]:
    r = httpx.post(f"{url}{path}", json={**body, "stream": True, "stream_options": {"include_usage": True}},
                   timeout=120)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e.get("choices")]
    if path.endswith("chat/completions"):
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
    return text, events[-2].get("usage"), events


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/engine/stats", timeout=10).json()


def _wait_all_free(*urls: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = [_stats(u) for u in urls]
        if all(s["num_free_blocks"] == s["num_blocks"] and s["num_running_reqs"] == 0 for s in stats):
            return
        assert time.monotonic() < deadline, f"blocks still held: {stats}"
        time.sleep(0.2)


@pytest.mark.parametrize("decode", [1, 2], ids=["shm", "tcp"])
def test_greedy_answers_equal_colocated(instances, decode):
    (_, p_url), (_, d_url) = instances[0], instances[decode]
    with serve_router([p_url], [d_url]) as (url, router):
        for prompt in (PROMPT, LONG_PROMPT):
            want = _complete(p_url, prompt).json()           # the prefill instance, serving it whole
            got = _complete(url, prompt).json()
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"] == "length"
            assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
            assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == 12
        text, usage, _ = _stream_text(url, "/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT,
                                                                "max_tokens": 12, "temperature": 0})
        assert text == want["choices"][0]["text"]
        assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] == want["usage"]["prompt_tokens"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours of the sea."}],
                "max_tokens": 10, "temperature": 0}
        want_chat = httpx.post(f"{p_url}/v1/chat/completions", json=chat, timeout=120).json()
        text, usage, events = _stream_text(url, "/v1/chat/completions", chat)
        assert text == want_chat["choices"][0]["message"]["content"]
        assert usage["completion_tokens"] == want_chat["usage"]["completion_tokens"]
        assert events[0]["choices"][0]["delta"].get("role") == "assistant"   # one ordinary stream
        assert router.counts["succeeded"] == 4 and router.counts["retries"] == 0
    _wait_all_free(p_url, d_url)


def test_logprobs_grammar_and_stop_strings_equal_colocated(instances):
    """The first token's logprobs come from the prefill instance; a grammar constrains both halves;
    a stop string is matched across the first token and the rest."""
    (_, p_url), (_, d_url) = instances[0], instances[1]
    with serve_router([p_url], [d_url]) as (url, _):
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Is the sea blue?"}], "max_tokens": 6,
                "temperature": 0, "logprobs": True, "top_logprobs": 2}
        want = httpx.post(f"{p_url}/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]
        got = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]
        assert got["message"]["content"] == want["message"]["content"]
        assert [(t["token"], round(t["logprob"], 3), [a["token"] for a in t["top_logprobs"]])
                for t in got["logprobs"]["content"]] == [
            (t["token"], round(t["logprob"], 3), [a["token"] for a in t["top_logprobs"]])
            for t in want["logprobs"]["content"]]
        for extra in ({"structured_outputs": {"choice": ["maybe so", "no way at all"]}}, {"stop": [" of"]}):
            want = _complete(p_url, **extra).json()["choices"][0]
            got = _complete(url, **extra).json()["choices"][0]
            assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"]), extra
    _wait_all_free(p_url, d_url)


def test_router_refuses_what_it_cannot_split(instances):
    (_, p_url), (_, d_url) = instances[0], instances[1]
    with serve_router([p_url], [d_url]) as (url, _):
        r = _complete(url, n=2, temperature=1.0)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        r = _complete(url, prompt_logprobs=1)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
        r = _complete(url, max_tokens=-3)        # the prefill instance's own 400, passed on
        assert r.status_code == 400
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == MODEL
    _wait_all_free(p_url, d_url)


def test_client_disconnect_mid_stream_frees_both_sides(instances):
    (_, p_url), (_, d_url) = instances[0], instances[1]
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with serve_router([p_url], [d_url]) as (url, _):
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                for i, _ in enumerate(resp.iter_lines()):
                    if i >= 6:
                        break
            assert _stats(d_url)["num_free_blocks"] < _stats(d_url)["num_blocks"]   # it was decoding
        _wait_all_free(p_url, d_url)


def test_a_killed_decode_instance(instances):
    """Runs last: it kills the shm decode instance's engine."""
    (_, p_url), (d_engine, d_url), (_, d2_url) = instances
    with serve_router([p_url], [d_url, d2_url]) as (url, router):
        body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
        # A stream the instance is serving when it dies ends with an error event.
        router.instances[2].in_flight += 100        # make the router pick the shm instance for it
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
                lines = resp.iter_lines()
                for _ in range(4):
                    next(lines)
                os.kill(d_engine._proc.pid, signal.SIGKILL)
                rest = "\n".join(lines)
        router.instances[2].in_flight -= 100
        errors = [e for e in sse_events(rest + "\n\n") if isinstance(e, dict) and "error" in e] if rest else []
        assert errors, rest[-500:]
        # The next request tries the dead instance first (it looks least busy), gets a 503
        # before anything was sent, and is retried on the other one.
        router.instances[2].served += 100
        want = _complete(p_url).json()["choices"][0]["text"]
        r = _complete(url)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        assert router.counts["retries"] == 1
        _wait_all_free(p_url, d2_url)
    # With only the dead instance, the request fails, and the prefill side frees its blocks.
    with serve_router([p_url], [d_url]) as (url, router):
        r = _complete(url)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_instance_pair"
        assert "decode instance" in r.json()["error"]["message"]
        _wait_all_free(p_url, timeout=5)   # released by the router, well before the 20 s timeout
