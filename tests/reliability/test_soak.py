"""Soak / chaos: the real server over the real engine-core process, hammered by
pagoda.bench.soak's mix of good, bad, disconnecting and retried requests.

CI size by default (two rounds of PAGODA_SOAK_REQUESTS, default 30, at most
PAGODA_SOAK_CONCURRENCY, default 8, in flight); `pagoda bench soak` runs the
same driver with bigger numbers against a `pagoda serve --enable-debug-endpoints`.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from pagoda.bench.soak import SoakConfig, check_server, rss_kib, run_soak
from pagoda.config import EngineConfig
from tests.e2e.server_utils import running_server

MODEL = "smollm2"
MAX_MODEL_LEN = 512
NUM_REQUESTS = int(os.environ.get("PAGODA_SOAK_REQUESTS", "30"))
CONCURRENCY = int(os.environ.get("PAGODA_SOAK_CONCURRENCY", "8"))
MAX_TOKENS = int(os.environ.get("PAGODA_SOAK_MAX_TOKENS", "8"))
# Engine RSS may grow by at most this much from the end of round 1 to the end of round 2
# (allocator caches settle during round 1; a per-request leak shows up as steady growth).
RSS_GROWTH_BOUND_KIB = int(os.environ.get("PAGODA_SOAK_RSS_BOUND_KIB", str(128 * 1024)))


@pytest.fixture(scope="module")
def soak_server():
    from pagoda.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_config(
        EngineConfig(show_progress=False, num_kv_blocks=256, max_model_len=MAX_MODEL_LEN),
        log_requests=False, log_stats=False,
    )  # fmt: skip
    with running_server(engine, served_model_name=MODEL, shutdown_engine=True,
                        enable_debug_endpoints=True) as running:
        # Warm up (the first steps are slow on CPU), so that round 1 measures steady state.
        body = {"model": MODEL, "prompt": "warm up", "max_tokens": 2}
        assert httpx.post(f"{running.base_url}/v1/completions", json=body, timeout=300).status_code == 200
        yield engine, running


def test_debug_endpoint_is_off_by_default():
    from tests.e2e.fake_engine import FakeEngine

    with running_server(FakeEngine()) as running:
        assert httpx.post(f"{running.base_url}/debug/check_integrity").status_code == 404


def test_soak_two_rounds(soak_server):
    engine, running = soak_server
    url = running.base_url
    pid = check_server(url)["engine_pid"]
    assert pid == engine._proc.pid
    rss = [rss_kib(pid)]
    for round_ in range(2):
        cfg = SoakConfig(num_requests=NUM_REQUESTS, concurrency=CONCURRENCY, max_tokens=MAX_TOKENS, seed=round_)
        report = asyncio.run(run_soak(url, MODEL, cfg, MAX_MODEL_LEN))
        print(f"round {round_}: {report.as_dict()}")
        assert report.failures == [], report.failures[:20]
        assert report.num_5xx == 0
        assert sum(report.categories.values()) == NUM_REQUESTS
        check_server(url)  # healthy, idle, kv_cache_usage 0, check_integrity ok
        rss.append(rss_kib(pid))
    print(f"engine RSS (KiB): start {rss[0]}, after round 1 {rss[1]}, after round 2 {rss[2]}")
    assert rss[2] - rss[1] <= RSS_GROWTH_BOUND_KIB, rss
