"""Data parallelism: two engine-core replicas behind one server (the bundled model).

A repeated prefix lands on the replica that cached it (its prefix-cache hit
counter moves, the other's does not); under concurrent load both replicas
serve; after one replica's engine is killed, new requests go to the other and
/health says degraded, not dead.
"""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagoda.config import EngineConfig
from tests.e2e.server_utils import running_server

MODEL = "smollm2"
_PREFIX = "You are a careful assistant. " * 12


def _metric(text: str, name: str, engine: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(f"pagoda:{name}") and f'engine="{engine}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _complete(url: str, prompt: str, max_tokens: int = 2) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def _wait_metrics(url: str, cond, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        if cond(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.3)


@pytest.fixture(scope="module")
def dp_server():
    from pagoda.engine.dp_client import DataParallelLLM

    config = EngineConfig(show_progress=False, num_kv_blocks=128, max_model_len=512, data_parallel_size=2)
    engine = DataParallelLLM.from_config(config, log_requests=False, log_stats=False)
    with running_server(engine, served_model_name=MODEL, shutdown_engine=True) as running:
        yield engine, running.base_url


def test_dp_routes_repeated_prefix_to_the_caching_replica(dp_server):
    engine, url = dp_server
    assert _complete(url, _PREFIX + "First question?").status_code == 200
    text = _wait_metrics(url, lambda t: _metric(t, "request_success_total", "0")
                         + _metric(t, "request_success_total", "1") >= 1)
    first = 0 if _metric(text, "request_success_total", "0") >= 1 else 1
    other = str(1 - first)
    for q in ("Second?", "Third one?", "And a fourth?"):
        assert _complete(url, _PREFIX + q).status_code == 200
    text = _wait_metrics(url, lambda t: _metric(t, "prefix_cache_hits_total", str(first)) > 0)
    assert _metric(text, "request_success_total", str(first)) == 4
    assert _metric(text, "request_success_total", other) == 0
    # The prefix (~100 tokens, several full blocks) was a hit three times, on that replica only.
    assert _metric(text, "prefix_cache_hits_total", str(first)) >= 3 * 64
    assert _metric(text, "prefix_cache_hits_total", other) == 0


def test_dp_both_replicas_serve_under_load(dp_server):
    engine, url = dp_server
    before = httpx.get(f"{url}/metrics", timeout=10).text
    prompts = [f"Story number {i}: once upon a time in city {i * 7}," for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: _complete(url, p, max_tokens=12), prompts))
    assert all(r.status_code == 200 for r in results)
    text = _wait_metrics(url, lambda t: sum(
        _metric(t, "request_success_total", e) - _metric(before, "request_success_total", e) for e in "01") >= 8)
    served = [_metric(text, "request_success_total", e) - _metric(before, "request_success_total", e) for e in "01"]
    assert sum(served) == 8
    assert min(served) >= 2, served    # least-loaded routing spreads concurrent distinct prompts


def test_dp_passes_the_tenant_to_the_replica(dp_server):
    """An X-Tenant request goes through the router to a replica (a merge once dropped
    the tenant argument there) and is counted under its tenant."""
    engine, url = dp_server
    r = httpx.post(f"{url}/v1/completions", timeout=60, headers={"X-Tenant": "acme"},
                   json={"model": MODEL, "prompt": "Tenant test:", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    text = _wait_metrics(url, lambda t: 'tenant="acme"' in t)
    counted = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pagoda:tenant_requests_total") and 'tenant="acme"' in line]
    assert sum(counted) == 1


def test_dp_fails_over_when_a_replica_dies(dp_server):
    engine, url = dp_server
    victim = engine.replicas[1]
    os.kill(victim._proc.pid, signal.SIGKILL)
    victim._proc.join(10)
    # New requests, including one with the prefix replica 1 may have cached, all succeed.
    for prompt in ("Hello there", _PREFIX + "Fifth?", "Another request", "One more"):
        r = _complete(url, prompt)
        assert r.status_code == 200, r.text
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 200
    assert health.json()["status"] == "degraded"
    assert "replica 1" in health.json()["reason"]
    assert re.search(r'pagoda:num_requests_running\{engine="1"', httpx.get(f"{url}/metrics").text)
