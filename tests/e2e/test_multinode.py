"""A tensor-parallel group over two "nodes": two separate launches of the command
a user runs on two machines, here on loopback with a TCP rendezvous.

    node 0: pagoda serve --tensor-parallel-size 2 --nnodes 2 --node-rank 0 \\
                --master-addr 127.0.0.1 --master-port P --port H
    node 1: pagoda serve --tensor-parallel-size 2 --nnodes 2 --node-rank 1 \\
                --master-addr 127.0.0.1 --master-port P

Node 0 serves HTTP with the engine core as rank 0; node 1 runs rank 1 only.
Greedy output must equal the one-process engine's, and node 1 must exit once
node 0 shuts down. The same with --pipeline-parallel-size 2: node 1 runs the second stage.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "The capital of France is"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(node_rank: int, master_port: int, http_port: int, parallel: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", parallel, "2",
           "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
           "--master-port", str(master_port), "--distributed-timeout", "60",
           "--num-kv-blocks", "64", "--max-model-len", "256", "--port", str(http_port),
           "--disable-log-stats"]
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_two_node_tensor_parallel_on_loopback(parallel):
    from pagoda import LLM, SamplingParams

    master, http = _free_port(), _free_port()
    node0 = _launch(0, master, http, parallel)
    node1 = _launch(1, master, http, parallel)
    try:
        url = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 240
        while True:
            assert node0.poll() is None and node1.poll() is None, "a node exited during startup"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the two-node server did not start"
            time.sleep(0.5)
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["text"]

        llm = LLM(None, num_kv_blocks=64, max_model_len=256, show_progress=False)
        want = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].outputs[0].text
        assert got == want

        node0.send_signal(signal.SIGTERM)
        assert node0.wait(60) == 0
        assert node1.wait(30) == 0      # its rank was told to stop, then the node exits
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
                p.wait()
