"""`pagoda bench parallel` end to end on the default model with tiny numbers: each setting
starts its engines, every request gets its tokens, and the saved JSON adds up."""

from __future__ import annotations

import json

import pytest

from pagoda.entrypoints.cli import build_parser


def test_settings_run_and_report(tmp_path):
    out = tmp_path / "parallel.json"
    args = build_parser().parse_args(
        ["bench", "parallel", "--settings", "tp1,dp2", "--num-prompts", "3", "--input-len", "16",
         "--output-len", "4", "--max-model-len", "256", "--num-kv-blocks", "64", "--save-result", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert (report["num_prompts"], report["input_len"], report["output_len"]) == (3, 16, 4)
    one, dp = report["results"]["tp1"], report["results"]["dp2"]
    assert (dp["data_parallel_size"], dp["threads_per_rank"]) == (2, 1)
    assert one["threads_per_rank"] is None   # one process: its thread governor
    for r in (one, dp):
        assert r["requests"] == 3 and r["output_tokens"] == 12
        assert 0 < r["median_ttft_s"] <= r["elapsed_s"] and 0 < r["mean_ttft_s"] <= r["elapsed_s"]
        assert r["output_tokens_per_s"] == pytest.approx(12 / r["elapsed_s"])


def test_unknown_setting_is_refused():
    from pagoda.bench.parallel import _settings

    with pytest.raises(ValueError, match="unknown --settings"):
        _settings("tp1,tp3")
