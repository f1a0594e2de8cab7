"""pagoda, offline, on token ids: the counterpart of ov_runner.py (same SPEC, same JSON
line), run by compare.py in a fresh process of pagoda's venv so that its peak RSS is its own.

    python pagoda_runner.py SPEC.json        # prints one JSON line (the last line of stdout)

SPEC: {"quantization": "none" | "int8" | "q4" | "gguf" | "bf16", "model": a GGUF or HF
folder (null: the bundled model), "mode": "throughput" | "latency", "prompts": [[token
ids], ...], "output_len": N, "max_num_seqs": C, "num_threads": null or a fixed count}.

- throughput: every prompt handed at once to LLM.generate() (greedy, ignore_eos), at most
  C sequences scheduled at a time (--max-num-seqs: a served run's max concurrency).
- latency: one prompt after another through the engine core, stepped by hand (single
  stream): the first token's time is the TTFT, the others' the TPOT.

Threads: pagoda's default (its governor: every core while the machine is otherwise idle)
unless "num_threads" is given. One warm-up request first, discarded.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from pagoda import LLM, SamplingParams
from pagoda.engine.messages import EngineCoreRequest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runner_stats import peak_rss_mb, summary  # noqa: E402


def greedy(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)


def run_throughput(llm: LLM, spec: dict) -> dict:
    prompts, out_len = spec["prompts"], int(spec["output_len"])
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(out_len), use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def run_latency(llm: LLM, spec: dict) -> dict:
    core = llm.engine
    prompts, out_len = spec["prompts"], int(spec["output_len"])
    ttft, tpot, e2e, tokens = [], [], [], []
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        core.add_request(EngineCoreRequest(request_id=f"lat-{i}", prompt_token_ids=p, sampling_params=greedy(out_len)))
        got: list[int] = []
        first = None
        while core.has_unfinished_requests():
            for o in core.step().outputs:
                got.extend(o.new_token_ids)
            if got and first is None:
                first = time.perf_counter()
        done = time.perf_counter()
        first = first or done
        ttft.append((first - t0) * 1000)
        e2e.append((done - t0) * 1000)
        if len(got) > 1:
            tpot.append((done - first) * 1000 / (len(got) - 1))
        tokens.append(got)
    return {"elapsed_s": time.perf_counter() - start, "tokens": tokens, "ttft": ttft, "tpot": tpot, "e2e": e2e}


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        spec = json.load(f)
    mode, quant = spec["mode"], spec.get("quantization", "none")
    t0 = time.perf_counter()
    llm = LLM(model=spec.get("model"), quantization=quant, max_num_seqs=int(spec["max_num_seqs"]),
              num_threads=spec.get("num_threads"), show_progress=False)
    load_s = time.perf_counter() - t0
    llm.generate({"prompt_token_ids": spec["prompts"][0][:16]}, greedy(4), use_tqdm=False)   # warm-up
    r = run_latency(llm, spec) if mode == "latency" else run_throughput(llm, spec)
    prompts = spec["prompts"]
    n_in, n_out, elapsed = sum(map(len, prompts)), sum(map(len, r["tokens"])), r["elapsed_s"]
    threads = llm.engine.threads
    out = {
        "engine": f"pagoda {quant} ({'engine core stepped, single stream' if mode == 'latency' else 'LLM.generate'})",
        "quantization": quant, "mode": mode,
        "num_prompts": len(prompts), "input_tokens": n_in, "output_tokens": n_out,
        "elapsed_s": round(elapsed, 3), "load_s": round(load_s, 3),
        "requests_per_s": round(len(prompts) / elapsed, 3),
        "output_tokens_per_s": round(n_out / elapsed, 2),
        "total_tokens_per_s": round((n_in + n_out) / elapsed, 2),
        "peak_rss_mb": peak_rss_mb(),
        "threads": {"now": torch.get_num_threads(),
                    "governor": None if threads is None else {"low": threads.low, "high": threads.high,
                                                              "switches": threads.switches}},
        "first_tokens": r["tokens"][0][:16],
    }
    if mode == "latency":
        out.update(ttft_ms=summary(r["ttft"]), e2el_ms=summary(r["e2e"]))
        if r["tpot"]:
            out["tpot_ms"] = summary(r["tpot"])
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
