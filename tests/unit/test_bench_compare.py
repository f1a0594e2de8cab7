"""benchmarks/compare.py's rounds: engines alternating at each point, the median kept."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("bench_compare_rounds", ROOT / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rep(engine: str, c: int, tps: float) -> dict:
    return {"benchmark": "serve", "label": engine,
            "points": [{"max_concurrency": c, "metrics": {"output_throughput": tps, "completed": 4, "num_requests": 4}}]}


def test_median_round_keeps_the_middle_run_and_every_rounds_figure(compare):
    reps = [_rep("pagoda", 1, t) for t in (50.0, 40.0, 60.0)]
    chosen = compare.median_round(reps)
    assert chosen["points"][0]["metrics"]["output_throughput"] == 50.0
    assert chosen["points"][0]["rounds"] == [50.0, 40.0, 60.0]
    two = compare.median_round([_rep("pagoda", 1, 70.0), _rep("pagoda", 1, 30.0)])
    assert two["points"][0]["metrics"]["output_throughput"] == 30.0  # the lower middle
    with pytest.raises(ValueError):
        compare.median_round([])


def test_run_alternates_the_engines_and_writes_the_medians(compare, monkeypatch, tmp_path):
    calls = []
    figures = {("pagoda", 16): iter([90.0, 70.0, 80.0]), ("llama-server", 16): iter([40.0, 41.0, 39.0])}

    def fake_point(engine, args, c, n, seed):
        calls.append(engine)
        return _rep(engine, c, next(figures[(engine, c)]))

    monkeypatch.setattr(compare, "run_point", fake_point)
    monkeypatch.setattr(compare, "check_engines", lambda engines, model: [])
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    out = tmp_path / "out"
    assert compare.main(["run", "--model", str(model), "--engines", "pagoda,llama-server", "--concurrency", "16",
                         "--num-prompts", "16", "--rounds", "3", "--out-dir", str(out)]) == 0
    # The order reverses every other round: neither engine always runs first.
    assert calls == ["pagoda", "llama-server", "llama-server", "pagoda", "pagoda", "llama-server"]
    ours = json.loads((out / "pagoda.json").read_text())["points"][0]
    assert ours["metrics"]["output_throughput"] == 80.0 and ours["rounds"] == [90.0, 70.0, 80.0]
    table = (out / "compare.md").read_text()
    assert "| pagoda / llama-server | 2.00x |" in table
    assert "pagoda c=16: 90.0, 70.0, 80.0" in table and "llama-server c=16: 40.0, 41.0, 39.0" in table


def test_run_refuses_no_rounds(compare, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    with pytest.raises(SystemExit, match="--rounds"):
        compare.main(["run", "--model", str(model), "--engines", "pagoda", "--rounds", "0",
                      "--out-dir", str(tmp_path / "o")])
