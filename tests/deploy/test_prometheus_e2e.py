"""A real Prometheus (Debian's binary) scraping a real pagoda server (the bundled model)
with the shipped scrape job and rules: what Prometheus stores is what pagoda served, and
the recording rules evaluate to what pagoda's histograms say.

Everything listens on 127.0.0.1 and stops with the module.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pagoda.config import EngineConfig
from tests.deploy.deploy_utils import MISSING_PROMETHEUS, PROMETHEUS_DIR, load_yaml_docs
from tests.e2e.server_utils import running_server

# Checked before any fixture loads the model.
PROMETHEUS = shutil.which("prometheus")
if PROMETHEUS is None:
    pytest.skip(f"no prometheus: {MISSING_PROMETHEUS}", allow_module_level=True)

MODEL = "smollm2-prom"
MAX_TOKENS = (3, 5, 7, 9)  # one request each, all run to max_tokens
_READY_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def pagoda() -> Iterator[str]:
    from pagoda.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_config(EngineConfig(show_progress=False, num_kv_blocks=128, max_model_len=512))
    with running_server(engine, served_model_name=MODEL, shutdown_engine=True) as running:
        yield running.base_url


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(pagoda_url: str) -> dict[str, Any]:
    """The shipped prometheus.yml's pagoda job and rules, pointed at the test server and
    scraping (and evaluating) every second."""
    shipped = load_yaml_docs(PROMETHEUS_DIR / "prometheus.yml")[0]
    job = next(j for j in shipped["scrape_configs"] if j["job_name"] == "pagoda")
    job["static_configs"] = [{"targets": [pagoda_url.removeprefix("http://")]}]
    job["scrape_interval"] = "1s"
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(PROMETHEUS_DIR / name) for name in shipped["rule_files"]],
        "scrape_configs": [job],
    }


@pytest.fixture(scope="module")
def prometheus(pagoda: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("prometheus")
    config = work / "prometheus.yml"
    config.write_text(yaml.safe_dump(_config(pagoda)))
    url = f"http://127.0.0.1:{_free_port()}"
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address={url.removeprefix('http://')}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        _wait(lambda: _ready(url), "Prometheus ready", proc, work / "prometheus.log")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _wait(cond: Callable[[], Any], what: str, proc: subprocess.Popen | None = None, log: Path | None = None,
          timeout: float = _READY_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"prometheus exited {proc.returncode}: {log.read_text() if log else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


def _query(prom: str, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
    body = httpx.get(f"{prom}/api/v1/query", params=params, timeout=10).json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def _scalar(prom: str, expr: str, at: float | None = None) -> float | None:
    result = _query(prom, expr, at)
    return float(result[0]["value"][1]) if result else None


def _pagoda_samples(pagoda: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{pagoda}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _pagoda_total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def _histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile on cumulative (upper bound, count) pairs, +Inf last:
    the bucket holding rank q * total, linearly interpolated inside it."""
    rank = q * buckets[-1][1]
    b = next(i for i, (_, count) in enumerate(buckets[:-1] + [(0.0, float("inf"))]) if count >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    start, before = (0.0, 0.0) if b == 0 else buckets[b - 1]
    end, count = buckets[b]
    return start + (end - start) * (rank - before) / (count - before)


@pytest.fixture(scope="module")
def loaded(pagoda: str, prometheus: str) -> dict[str, Any]:
    """Prometheus has scraped pagoda idle (so every counter's first sample is 0), then four
    requests ran; returns their usage."""
    _wait(lambda: _scalar(prometheus, 'pagoda:time_to_first_token_seconds_count{job="pagoda"}') == 0,
          "a first scrape of the idle server")

    def complete(max_tokens: int) -> dict[str, Any]:
        body = {"model": MODEL, "prompt": f"Count to {max_tokens}:", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{pagoda}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    with concurrent.futures.ThreadPoolExecutor(len(MAX_TOKENS)) as pool:
        usages = list(pool.map(complete, MAX_TOKENS))
    return {"prompt_tokens": sum(u["prompt_tokens"] for u in usages),
            "completion_tokens": sum(u["completion_tokens"] for u in usages), "done_at": time.time()}


def test_prometheus_stores_what_pagoda_served(pagoda, prometheus, loaded):
    assert loaded["completion_tokens"] == sum(MAX_TOKENS)
    served = _pagoda_samples(pagoda)
    assert _pagoda_total(served, "pagoda:request_success_total") == len(MAX_TOKENS)
    assert _pagoda_total(served, "pagoda:generation_tokens_total") == sum(MAX_TOKENS)
    assert _pagoda_total(served, "pagoda:prompt_tokens_total") == loaded["prompt_tokens"]

    requests = 'sum(pagoda:request_success_total{job="pagoda"})'
    _wait(lambda: _scalar(prometheus, requests) == len(MAX_TOKENS), "Prometheus to see the requests")
    assert _scalar(prometheus, 'pagoda:generation_tokens_total{job="pagoda"}') == sum(MAX_TOKENS)
    assert _scalar(prometheus, 'pagoda:prompt_tokens_total{job="pagoda"}') == loaded["prompt_tokens"]
    series = _query(prometheus, 'pagoda:request_success_total{job="pagoda", finished_reason="length"}')
    assert [s["metric"]["model_name"] for s in series] == [MODEL]
    assert float(series[0]["value"][1]) == len(MAX_TOKENS)
    assert _scalar(prometheus, 'up{job="pagoda"}') == 1


def test_recording_rules_evaluate_from_pagodas_histograms(pagoda, prometheus, loaded):
    """pagoda:ttft_seconds:p50_5m, once evaluated over all four requests, equals the median
    of pagoda's own TTFT buckets (their first samples were 0, so the rate's window holds
    exactly these requests), and equals its expression queried at the same instant."""
    count = 'pagoda:time_to_first_token_seconds_count{job="pagoda"}'
    _wait(lambda: _scalar(prometheus, count) == len(MAX_TOKENS), "the TTFT histogram")
    seen_at = time.time()

    def recorded_after() -> tuple[float, float] | None:
        result = _query(prometheus, "pagoda:ttft_seconds:p50_5m")
        if result and result[0]["value"][0] > seen_at + 1:
            return result[0]["value"][0], float(result[0]["value"][1])
        return None

    at, value = _wait(recorded_after, "a rule evaluation after the last scrape")
    assert at - loaded["done_at"] < 240, "the 5 m window no longer starts at the idle scrape"
    served = _pagoda_samples(pagoda)
    buckets = sorted((float(dict(labels)["le"]), v) for (name, labels), v in served.items()
                     if name == "pagoda:time_to_first_token_seconds_bucket")
    assert buckets[-1] == (float("inf"), len(MAX_TOKENS))
    assert value == pytest.approx(_histogram_quantile(0.5, buckets), rel=1e-9)
    expr = next(r["expr"] for g in load_yaml_docs(PROMETHEUS_DIR / "rules.yml")[0]["groups"] for r in g["rules"]
                if r.get("record") == "pagoda:ttft_seconds:p50_5m")
    # The same expression queried at the rule's evaluation time (a float of milliseconds):
    # rate()'s extrapolation may differ from the recorded value in the last bit.
    assert _scalar(prometheus, expr, at) == pytest.approx(value, rel=1e-9)
    assert 0 < value < 120


def test_every_rule_evaluates_without_error(prometheus, loaded):
    shipped = {r.get("record") or r.get("alert") for g in load_yaml_docs(PROMETHEUS_DIR / "rules.yml")[0]["groups"]
               for r in g["rules"]}

    def evaluated() -> list[dict[str, Any]] | None:
        groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

    rules = _wait(evaluated, "every rule to be evaluated")
    assert {r["name"] for r in rules} == shipped
    assert [r["name"] for r in rules if r["health"] != "ok"] == []
    # An idle, healthy server after four requests raises no alert.
    assert [r["name"] for r in rules if r["type"] == "alerting" and r["state"] == "firing"] == []
    assert _scalar(prometheus, "pagoda:generation_tokens:rate1m") > 0
