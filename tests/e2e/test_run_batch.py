"""`pagoda run-batch` (vLLM's offline form of a batch) on the bundled model: one result line per
request in the input's order, failed requests as lines of the output, a malformed file refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.e2e.test_batch_api import jsonl

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"


def run_batch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli", "run-batch", *args,
                           "--max-model-len", "512", "--num-kv-blocks", "256"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip


def test_run_batch_writes_a_line_per_request_in_order(tmp_path: Path) -> None:
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 5,
                  "temperature": 0}},
        {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}},
        {"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": "x", "max_tokens": 10_000}},
        {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"model": MODEL, "input": "hi"}},
    ]  # fmt: skip
    (tmp_path / "in.jsonl").write_bytes(jsonl(lines))
    done = run_batch("-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 succeeded, 2 failed" in done.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in out] == ["chat", "completion", "too-long", "embed"]
    chat, completion, too_long, embed = (r["response"] for r in out)
    assert chat["status_code"] == 200 and chat["body"]["usage"]["completion_tokens"] == 5
    assert chat["body"]["choices"][0]["message"]["content"] and out[0]["error"] is None
    assert completion["status_code"] == 200 and completion["body"]["choices"][0]["finish_reason"] == "length"
    assert too_long["status_code"] == 400 and out[2]["error"]["param"] == "max_tokens"
    assert embed["status_code"] == 400 and out[3]["error"] == embed["body"]["error"]


def test_run_batch_refuses_a_file_that_is_not_a_batch(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a"}\nnot json\n')
    done = run_batch("-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"))
    assert done.returncode == 2 and not (tmp_path / "out.jsonl").exists()
    assert "line 1: The method must be POST" in done.stderr and "line 2: This line is not valid JSON" in done.stderr
