"""GET /metrics on the real engine: exact counter deltas for a known workload.

The engine runs with a tiny KV pool (8 blocks of 4 tokens, 32-token context) so that a
few concurrent requests must preempt each other, and prompts are explicit token ids so
that every count is known in advance.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.config import EngineConfig
from tests.e2e.server_utils import running_server

MODEL = "smollm2-metrics"
BLOCK = 4
HISTOGRAMS_PER_REQUEST = (
    "time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
    "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
)

Sample = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def server():
    from pagoda.engine.async_llm import AsyncLLM

    config = EngineConfig(show_progress=False, num_kv_blocks=8, block_size=BLOCK, max_model_len=32)
    engine = AsyncLLM.from_config(config)
    with running_server(engine, served_model_name=MODEL, shutdown_engine=True) as running:
        yield running


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=300) as c:
        yield c


def scrape(http: httpx.Client) -> Sample:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: Sample = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            assert s.labels.get("model_name") == MODEL, s
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def delta(after: Sample, before: Sample, name: str, **labels: str) -> float:
    key = (f"pagoda:{name}", tuple(sorted(labels.items())))
    assert key in after, f"{key} not exported"
    return after[key] - before.get(key, 0.0)


def complete(http: httpx.Client, prompt: list[int], max_tokens: int, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(http: httpx.Client, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        s = http.get("/v1/engine/stats").json()
        if s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0:
            return
        assert time.monotonic() < deadline, f"engine not idle: {s}"
        time.sleep(0.05)


def test_exposition_names_and_gauges(http) -> None:
    m = scrape(http)
    names = {name for name, _ in m}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "request_aborted_total",
                 "iteration_tokens_total_count", "iteration_batch_size_count", "estimated_flops_total",
                 "estimated_bytes_total", "engine_step_seconds_total", "inter_token_latency_seconds_count"):
        assert f"pagoda:{name}" in names, name
    assert m[("pagoda:kv_cache_num_blocks", ())] == 8
    # Buckets run from 1 ms to minutes.
    les = [float(dict(lab)["le"]) for name, lab in m if name == "pagoda:time_to_first_token_seconds_bucket"]
    assert min(les) == 0.001 and max(x for x in les if x != float("inf")) >= 600


def test_counters_and_histograms_with_preemption(http, caplog) -> None:
    caplog.set_level(logging.INFO, logger="pagoda.metrics")
    n, prompt_len, max_tokens = 3, 8, 12
    prompts = [[1000 + 100 * i + j for j in range(prompt_len)] for i in range(n)]
    before = scrape(http)
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda p: complete(http, p, max_tokens), prompts))
    wait_idle(http)
    after = scrape(http)

    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in results)
    completion_tokens = sum(r["usage"]["completion_tokens"] for r in results)
    assert (prompt_tokens, completion_tokens) == (n * prompt_len, n * max_tokens)
    assert delta(after, before, "prompt_tokens_total") == prompt_tokens
    assert delta(after, before, "generation_tokens_total") == completion_tokens
    assert delta(after, before, "request_success_total", finished_reason="length") == n
    assert delta(after, before, "request_success_total", finished_reason="stop") == 0
    assert delta(after, before, "request_aborted_total") == 0
    for name in HISTOGRAMS_PER_REQUEST:
        assert delta(after, before, f"{name}_count") == n, name
    assert delta(after, before, "request_prompt_tokens_sum") == prompt_tokens
    assert delta(after, before, "request_generation_tokens_sum") == completion_tokens
    # One inter-token gap per token after the first (one token per request per step).
    assert delta(after, before, "inter_token_latency_seconds_count") == completion_tokens - n
    steps = delta(after, before, "engine_steps_total")
    assert steps >= max_tokens
    assert delta(after, before, "iteration_tokens_total_count") == steps
    assert delta(after, before, "iteration_batch_size_count") == steps
    # Every computed token, including the recomputed ones, is in some step.
    assert delta(after, before, "iteration_tokens_total_sum") >= prompt_tokens + completion_tokens - n
    assert delta(after, before, "estimated_flops_total") > 0 and delta(after, before, "estimated_bytes_total") > 0

    # 3 requests of up to 20 tokens (5 blocks) in an 8-block pool: some must be preempted.
    # The counter agrees with what each request reported about itself in the request log.
    lines = [r.getMessage() for r in caplog.records if r.name == "pagoda.metrics" and "finished:" in r.getMessage()]
    mine = [line for line in lines if "reason=length" in line and f"generation_tokens={max_tokens}" in line]
    assert len(mine) == n, lines
    per_request = sum(int(re.search(r"preemptions=(\d+)", line).group(1)) for line in mine)
    preemptions = delta(after, before, "num_preemptions_total")
    assert preemptions >= 1
    assert preemptions == per_request


def test_prefix_cache_hits_on_a_repeated_prompt(http) -> None:
    prompt = [7000 + j for j in range(10)]     # 10 tokens: 2 full blocks of 4 can be reused
    before = scrape(http)
    first = complete(http, prompt, 2)
    second = complete(http, prompt, 2)
    after = scrape(http)
    expected_hits = (len(prompt) - 1) // BLOCK * BLOCK
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_hits
    assert delta(after, before, "prefix_cache_queries_total") == 2 * len(prompt)
    assert delta(after, before, "prefix_cache_hits_total") == expected_hits
    assert delta(after, before, "num_preemptions_total") == 0
    assert delta(after, before, "request_success_total", finished_reason="length") == 2


def test_aborted_request(http) -> None:
    before = scrape(http)
    body = {"model": MODEL, "prompt": [8000 + j for j in range(6)], "max_tokens": 20, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        next(r.iter_lines())                    # the first token is out; now hang up
    deadline = time.monotonic() + 60
    while delta(scrape(http), before, "request_aborted_total") != 1:
        assert time.monotonic() < deadline, "the abort was not counted"
        time.sleep(0.05)
    wait_idle(http)
    after = scrape(http)
    assert delta(after, before, "request_aborted_total") == 1
    assert delta(after, before, "time_to_first_token_seconds_count") == 1
    assert delta(after, before, "e2e_request_latency_seconds_count") == 0   # completed requests only
    assert sum(delta(after, before, "request_success_total", finished_reason=f) for f in ("stop", "length")) == 0


def test_observability_routes_are_open_and_work_without_a_recorder() -> None:
    """/metrics and /dashboard stay open like /health when /v1 needs a key (scrapers and the
    page's fetches carry none), and an engine without EngineMetrics still exports its gauges."""
    from tests.e2e.fake_engine import FakeEngine

    with running_server(FakeEngine(), served_model_name="fake", api_key="secret") as running:
        with httpx.Client(base_url=running.base_url, timeout=30) as c:
            assert c.get("/v1/models").status_code == 401
            r = c.get("/metrics")
            assert r.status_code == 200
            assert 'pagoda:num_requests_running{model_name="fake"}' in r.text
            assert c.get("/dashboard").status_code == 200
            data = c.get("/dashboard/data").json()
            assert data["model_name"] == "fake" and data["steps"] == [] and "stats" in data
