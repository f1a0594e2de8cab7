"""`pagoda bench attention`: each point sweeps copies of its KV pool (as a decode step walks
its layers) so the rows come from memory, and says what it read."""

from __future__ import annotations

import json

import pytest
import torch

from pagoda.bench.attention import time_point
from pagoda.entrypoints.cli import main
from pagoda.ops import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="no CPU kernels here")


def test_a_point_sweeps_enough_copies_of_its_pool():
    # 64 positions x 2 KV heads x 64 x 2 bytes, K and V: 32 KiB a pool.
    pool = 2 * 64 * 2 * 64 * 2
    one = time_point(64, 1, torch.float16, 4, 2, 64, 16, min_time=0.01)
    swept = time_point(64, 1, torch.float16, 4, 2, 64, 16, min_time=0.01, sweep_bytes=5 * pool - 1)
    assert one["layers"] == 1 and swept["layers"] == 5
    # Bytes and time are per layer: a point's bytes are one pool's K and V rows.
    assert one["kv_bytes"] == swept["kv_bytes"] == pool
    assert swept["bytes_per_s"] == pytest.approx(swept["kv_bytes"] / swept["seconds"])
    int8 = time_point(64, 2, torch.int8, 4, 2, 64, 16, min_time=0.01)
    assert int8["kv_bytes"] == 2 * (64 * 2 * 64 + 64 * 2 * 4) * 2   # rows and their float32 scales


def test_arithmetic_only_reads_one_block_and_sweeps_nothing():
    # Every table entry on block 0: the same bytes counted per call, and no copies swept
    # whatever --sweep-mib asks (the rows are meant to stay in the cache).
    point = time_point(64, 2, torch.float16, 4, 2, 64, 16, min_time=0.01, sweep_bytes=1 << 20, arithmetic_only=True)
    assert point["layers"] == 1 and point["kv_bytes"] == 2 * 2 * 64 * 2 * 64 * 2


def test_the_command_saves_its_points(tmp_path, capsys):
    out = tmp_path / "attention.json"
    assert main(["bench", "attention", "--contexts", "32,80", "--batches", "1,2", "--heads", "4", "--kv-heads", "2",
                 "--min-time", "0.01", "--bandwidth-mib", "16", "--sweep-mib", "1", "--save-result", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["sweep_mib"] == 1 and saved["shape"]["kv_heads"] == 2
    assert saved["shape"]["block_size"] == 64   # the engine's CPU default, unless --block-size says otherwise
    assert [(p["context"], p["batch"]) for p in saved["points"]] == [(32, 1), (32, 2), (80, 1), (80, 2)]
    assert all(p["layers"] > 1 and p["fraction_of_read_bandwidth"] > 0 for p in saved["points"])
    # The fractions are of the higher of the two bandwidth readings (before and after the points).
    assert saved["read_bytes_per_s"] == max(saved["read_bytes_per_s_before"], saved["read_bytes_per_s_after"])
    assert all(p["fraction_of_read_bandwidth"] == pytest.approx(p["bytes_per_s"] / saved["read_bytes_per_s"])
               for p in saved["points"])
    assert "ms/layer" in capsys.readouterr().out
