"""`pagoda bench serve` end to end: a real pagoda server (engine-core process, default model)
and the real command with tiny numbers; the saved JSON must add up."""

from __future__ import annotations

import json

import pytest

from pagoda.config import EngineConfig
from pagoda.entrypoints.cli import build_parser
from tests.e2e.server_utils import running_server

MODEL = "smollm2"


@pytest.fixture(scope="module")
def server():
    from pagoda.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_config(EngineConfig(show_progress=False, num_kv_blocks=256, max_model_len=1024))
    with running_server(engine, served_model_name=MODEL, shutdown_engine=True) as running:
        yield running


def bench(server, tmp_path, *extra: str) -> dict:
    out = tmp_path / "result.json"
    args = build_parser().parse_args(
        ["bench", "serve", "--base-url", server.base_url, "--no-progress", "--ignore-eos",
         "--save-result", str(out), *extra])
    assert args.func(args) == 0
    return json.loads(out.read_text())


def test_random_sweep(server, tmp_path):
    report = bench(server, tmp_path, "--num-prompts", "3,6", "--max-concurrency", "1,3", "--input-len", "32",
                   "--output-len", "8", "--goodput", "ttft:60000", "--plot-dir", str(tmp_path / "plots"))
    assert report["model"] == MODEL and report["workload"]["ignore_eos"] is True
    assert [p["max_concurrency"] for p in report["points"]] == [1, 3]
    for point, n in zip(report["points"], (3, 6)):
        m = point["metrics"]
        assert (m["num_requests"], m["completed"], m["failed"], m["errors"]) == (n, n, 0, {})
        assert m["total_output_tokens"] == n * 8                   # ignore_eos: exactly max_tokens each
        assert m["output_tokens_source"] == ["usage"]
        assert m["total_input_tokens"] == n * 32                   # the client's exact lengths (no BOS here)
        assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / m["duration_s"])
        assert 0 < m["ttft_ms"]["median"] <= m["e2el_ms"]["median"]
        assert m["ttft_ms"]["p99"] <= m["e2el_ms"]["p99"]
        assert m["goodput"]["good_requests"] == n
        for r in point["requests"]:
            assert r["success"] and r["output_tokens"] == 8
            assert 0 < r["ttft_ms"] <= r["e2el_ms"]
            # Every gap lies inside the request: TTFT + all ITLs <= E2E.
            assert r["ttft_ms"] + sum(r["itl_ms"]) <= r["e2el_ms"] + 1e-6
            assert r["tpot_ms"] == pytest.approx((r["e2el_ms"] - r["ttft_ms"]) / 7, rel=1e-3)
        assert point["server_stats"]["num_steps"] > 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [f"{MODEL}_latency_cdf.png", f"{MODEL}_sweep.png"]


def test_prefix_and_multiturn_chat(server, tmp_path):
    report = bench(server, tmp_path, "--dataset", "prefix", "--prefix-len", "64", "--input-len", "16",
                   "--output-len", "4", "--num-prompts", "4", "--max-concurrency", "2")
    (point,) = report["points"]
    assert point["metrics"]["completed"] == 4
    assert point["metrics"]["total_input_tokens"] == 4 * 80
    # The warm-up request put the shared 64-token prefix (4 full blocks) in the cache.
    assert point["server_stats"]["prefix_cache_hits"] >= 4 * 64

    report = bench(server, tmp_path, "--dataset", "multiturn", "--num-turns", "2", "--input-len", "12",
                   "--output-len", "4", "--num-prompts", "2", "--max-concurrency", "2",
                   "--endpoint", "/v1/chat/completions", "--num-warmups", "0")
    (point,) = report["points"]
    assert point["metrics"]["completed"] == 4                      # 2 conversations x 2 turns
    lens = [r["prompt_len"] for r in point["requests"]]
    assert lens[1] > lens[0] + 12 and lens[3] > lens[2] + 12       # the second turn carries the first


def test_rate_mode_with_errors_reported(server, tmp_path):
    # A prompt longer than the server's context fails; the run reports it and exits 1.
    out = tmp_path / "r.json"
    args = build_parser().parse_args(
        ["bench", "serve", "--base-url", server.base_url, "--no-progress", "--num-warmups", "0",
         "--request-rate", "50", "--burstiness", "0.5", "--num-prompts", "2", "--input-len", "1100",
         "--output-len", "2", "--save-result", str(out)])
    assert args.func(args) == 1
    m = json.loads(out.read_text())["points"][0]["metrics"]
    assert m["failed"] == 2 and next(iter(m["errors"])).startswith("HTTP 400")
