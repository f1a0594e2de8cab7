"""`pagoda bench batch`: live traffic's TTFT with a batch running (OpenAI's Batch API) against
the same load without it, and a restart in the middle of the batch.

It starts `pagoda serve --file-storage-path` (a temporary folder) itself, then:

1. ``alone``: ``--live-requests`` streamed chat requests at ``--live-concurrency``;
2. uploads a ``--num-lines`` batch (chat lines of ``--batch-input-len`` prompt tokens,
   ``--batch-output-len`` generated, EOS ignored) and creates it; once its first lines run,
   ``with batch``: the same load again (other prompts of the same lengths, so the prefix
   cache gives neither run an edge), checking that the batch ran throughout;
3. (unless ``--no-restart-check``) stops the server with SIGTERM while the batch is
   unfinished, starts a new one on the same folder, waits for the batch to complete, and
   checks that every line has one result and that the new server computed only the lines
   without one (its finished-request counter against the lines left).

The figure is the ratio of the live TTFT p50 with the batch to that without it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pagoda.bench import datasets as ds
from pagoda.bench.client import RequestSpec, make_client, run_load
from pagoda.bench.metrics import compute_metrics
from pagoda.bench.serve import load_client_tokenizer


def add_batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the model to serve (default: the bundled one)")
    p.add_argument("--served-model-name", default="bench")
    p.add_argument("--num-lines", type=int, default=200, help="requests in the batch")
    p.add_argument("--batch-input-len", type=int, default=128)
    p.add_argument("--batch-output-len", type=int, default=64)
    p.add_argument("--live-requests", type=int, default=40, help="live requests in each of the two runs")
    p.add_argument("--live-concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128, help="live prompts' tokens")
    p.add_argument("--output-len", type=int, default=32, help="live requests' generated tokens")
    p.add_argument("--serve-args", default="", help="more `pagoda serve` flags, quoted as one string")
    p.add_argument("--no-restart-check", action="store_true", help="skip the restart in the middle of the batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", default=None, metavar="FILE.json")
    p.add_argument("--startup-timeout", type=float, default=600.0)


class _Server:
    def __init__(self, args: argparse.Namespace, storage: Path, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", *([args.model] if args.model else []),
               "--port", str(self.port), "--served-model-name", args.served_model_name,
               "--file-storage-path", str(storage), "--disable-log-requests", *shlex.split(args.serve_args)]
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + args.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pagoda serve exited with {self.proc.returncode}; its log: {log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pagoda serve did not start in {args.startup_timeout:g} s; its log: {log}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def finished_requests(self) -> int:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10, trust_env=False).text
        return int(sum(s.value for f in text_string_to_metric_families(text) if f.name == "pagoda:request_success"
                       for s in f.samples if s.name.endswith("_total")))  # fmt: skip


def _batch_file(args: argparse.Namespace, sampler: ds.TextSampler) -> bytes:
    lines = []
    for i, conv in enumerate(ds.random_dataset(sampler, args.num_lines, args.batch_input_len, args.batch_output_len)):
        body = {"model": args.served_model_name, "messages": [{"role": "user", "content": conv.turns[0].prompt}],
                "max_tokens": args.batch_output_len, "ignore_eos": True, "temperature": 0}  # fmt: skip
        lines.append({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


async def _live(args: argparse.Namespace, server: _Server, sampler: ds.TextSampler) -> dict[str, Any]:
    spec = RequestSpec(f"{server.url}/v1/chat/completions", args.served_model_name, chat=True, ignore_eos=True)
    convs = ds.random_dataset(sampler, args.live_requests, args.input_len, args.output_len)
    async with make_client(args.live_concurrency + 4, 600) as client:
        results, duration = await run_load(client, spec, convs, args.live_concurrency)
    metrics = compute_metrics(results, duration)
    if metrics["failed"]:
        raise RuntimeError(f"{metrics['failed']} live requests failed: {[r.error for r in results if r.error][:3]}")
    return metrics


def _batch(server: _Server, batch_id: str) -> dict[str, Any]:
    return httpx.get(f"{server.url}/v1/batches/{batch_id}", timeout=10, trust_env=False).json()


def run_batch_bench(args: argparse.Namespace) -> int:
    tokenizer = load_client_tokenizer(args.model if args.model and os.path.exists(args.model) else None)
    report: dict[str, Any] = {"command": " ".join(["pagoda", "bench", "batch", *sys.argv[3:]]),
                              "args": {k: v for k, v in vars(args).items() if not callable(v)}}
    with tempfile.TemporaryDirectory(prefix="pagoda-bench-batch-") as tmp:
        storage, log = Path(tmp) / "store", Path(tmp) / "serve.log"
        server = _Server(args, storage, log)
        try:
            asyncio.run(_live(argparse.Namespace(**{**vars(args), "live_requests": 4}), server,
                              ds.TextSampler(tokenizer, args.seed + 99)))   # warm-up
            alone = asyncio.run(_live(args, server, ds.TextSampler(tokenizer, args.seed + 1)))
            print(f"alone:      TTFT p50 {alone['ttft_ms']['median']:.0f} ms, TPOT p50 {alone['tpot_ms']['median']:.1f} ms")
            up = httpx.post(f"{server.url}/v1/files", data={"purpose": "batch"}, timeout=60, trust_env=False,
                            files={"file": ("batch.jsonl", _batch_file(args, ds.TextSampler(tokenizer, args.seed + 2)))})
            up.raise_for_status()
            batch = httpx.post(f"{server.url}/v1/batches", timeout=10, trust_env=False, json={
                "input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()
            while (b := _batch(server, batch["id"]))["status"] in ("validating",) or not b["request_counts"]["completed"]:
                if b["status"] not in ("validating", "in_progress"):
                    raise RuntimeError(f"the batch ended before the live run: {b['status']} {b.get('errors')}")
                time.sleep(0.2)
            before = b["request_counts"]["completed"]
            with_batch = asyncio.run(_live(args, server, ds.TextSampler(tokenizer, args.seed + 3)))
            b = _batch(server, batch["id"])
            during = b["request_counts"]["completed"] - before
            print(f"with batch: TTFT p50 {with_batch['ttft_ms']['median']:.0f} ms, TPOT p50 "
                  f"{with_batch['tpot_ms']['median']:.1f} ms ({during} batch lines finished meanwhile, "
                  f"batch {b['status']})")
            if b["status"] != "in_progress":
                print("warning: the batch finished during the live run; raise --num-lines")
            ratio = with_batch["ttft_ms"]["median"] / alone["ttft_ms"]["median"]
            print(f"live TTFT p50 with the batch / without: {ratio:.2f}x")
            report.update(alone=alone, with_batch=with_batch, ttft_p50_ratio=ratio, batch_lines_during_live=during,
                          batch_status_after_live=b["status"])
            if not args.no_restart_check and b["status"] == "in_progress":
                report["restart"] = _restart(args, server, storage, log, batch["id"])
                server = None
        finally:
            if server is not None:
                server.stop()
    if args.save_result:
        os.makedirs(os.path.dirname(os.path.abspath(args.save_result)), exist_ok=True)
        with open(args.save_result, "w") as f:
            json.dump(report, f, indent=1)
        print(f"results: {args.save_result}")
    return 0


def _restart(args: argparse.Namespace, server: _Server, storage: Path, log: Path, batch_id: str) -> dict[str, Any]:
    server.stop()   # SIGTERM: drain; the lines in flight are aborted and run again later
    out = storage / "batches" / f"{batch_id}.output.jsonl"
    done_before = len(out.read_bytes().splitlines()) if out.exists() else 0
    start = time.monotonic()
    server = _Server(args, storage, log)
    try:
        while (b := _batch(server, batch_id))["status"] not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.5)
        computed = server.finished_requests()
        content = httpx.get(f"{server.url}/v1/files/{b['output_file_id']}/content", timeout=60, trust_env=False)
        ids = [json.loads(line)["custom_id"] for line in content.text.splitlines()]
    finally:
        server.stop()
    ok = (b["status"] == "completed" and sorted(ids) == sorted(f"line-{i}" for i in range(args.num_lines))
          and computed == args.num_lines - done_before)  # fmt: skip
    print(f"restart: {done_before} lines done before the restart; the new server computed {computed} "
          f"({args.num_lines - done_before} left) and finished in {time.monotonic() - start:.0f} s; "
          f"batch {b['status']}, {len(ids)} results, {len(set(ids))} distinct: {'OK' if ok else 'FAILED'}")
    if not ok:
        raise RuntimeError("the restarted server did not finish the batch exactly once per line")
    return {"done_before": done_before, "computed_after": computed, "results": len(ids), "status": b["status"]}
