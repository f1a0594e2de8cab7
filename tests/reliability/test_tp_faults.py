"""A tensor-parallel worker killed (SIGKILL) while requests are in flight (and, by
tests/model/test_pipeline_parallel.py, a pipeline stage's worker).

The engine core (rank 0) must notice at its next collective (gloo reports the
closed connection at once) or from the worker's exit status, end the
in-flight requests with an error, and the server must turn /health red.
Nothing may hang: every wait here is bounded.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from pagoda.config import EngineConfig
from tests.e2e.server_utils import running_server
from tests.reliability.test_faults import MODEL, _request


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


@pytest.mark.slow   # (CI time)
def test_tp_worker_killed_mid_load():
    kill_worker_mid_load(tensor_parallel_size=2)


def kill_worker_mid_load(**parallel) -> None:
    """A server on an engine with one worker (``parallel``: TP=2 or PP=2): SIGKILL it while
    two requests stream; both end with an error, /health turns 503, the core exits."""
    from pagoda.engine.async_llm import AsyncLLM

    config = EngineConfig(show_progress=False, num_kv_blocks=256, max_model_len=512, distributed_timeout=20.0,
                          **parallel)
    engine = AsyncLLM.from_config(config, log_requests=False, log_stats=False)
    with running_server(engine, served_model_name=MODEL, shutdown_engine=True) as running:
        url = running.base_url
        workers = _children(engine._proc.pid)
        assert len(workers) == 1, workers
        started = threading.Event()
        results: list[Any] = []
        threads = [threading.Thread(target=_request, args=(url, i % 2 == 0, started, results)) for i in range(2)]
        for t in threads:
            t.start()
        assert started.wait(120), "no stream started"
        time.sleep(0.3)
        os.kill(workers[0], signal.SIGKILL)
        killed_at = time.monotonic()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), f"an in-flight request hung after a worker died ({parallel})"
        assert time.monotonic() - killed_at < 15
        for kind, status, payload, _ in results:
            assert kind != "exception", payload
            if kind == "stream":
                assert status == 200 and payload[-1] == "[DONE]", payload[-3:]
                assert "error" in payload[-2], payload[-2]
            else:
                assert status == 503, payload
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503
        assert "worker" in health.json()["error"]["message"] or "peer" in health.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503
    # The engine core exits (it reported dead) and leaves no worker behind.
    engine._proc.join(15)
    assert not engine._proc.is_alive()
