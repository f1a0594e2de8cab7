"""`pagoda bench latency`: one batch through the engine, every step timed.

B requests of exactly ``input_len`` prompt tokens each are added at once, then the engine
core is stepped until all have ``output_len`` tokens (ignore_eos, greedy). A step that
computes any prompt tokens counts as prefill (with the default token budget of 512, a
batch of 8 x 128-token prompts is prefilled in two steps); a step in which every request
computes one token is a decode. Each iteration uses fresh prompts, so the prefix cache
never shortens a prefill.

This times the engine core in-process (scheduler + model + sampler), without the HTTP
server or detokenization: what a request costs the engine, not what a client waits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from typing import Any

import torch

from pagoda.bench.metrics import summarize
from pagoda.config import EngineConfig


def run_batch(core: Any, prompts: list[list[int]], output_len: int, tag: str) -> list[dict[str, Any]]:
    """Add the batch, step until it is done; one record per step."""
    from pagoda.engine.messages import EngineCoreRequest
    from pagoda.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for j, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(request_id=f"{tag}-{j}", prompt_token_ids=p, sampling_params=params))
    steps = []
    while core.has_unfinished_requests():
        t0 = time.perf_counter()
        out = core.step()
        dt = time.perf_counter() - t0
        st = out.scheduler_stats
        kind = "decode" if st.step_num_tokens == st.step_batch_size else "prefill"
        steps.append({"kind": kind, "time_s": dt, "num_tokens": st.step_num_tokens,
                      "batch_size": st.step_batch_size})
    return steps


def summarize_iteration(steps: list[dict[str, Any]], batch_size: int) -> dict[str, Any]:
    prefill = [s for s in steps if s["kind"] == "prefill"]
    decode = [s for s in steps if s["kind"] == "decode"]
    total = sum(s["time_s"] for s in steps)
    decode_time = sum(s["time_s"] for s in decode)
    decode_tokens = sum(s["num_tokens"] for s in decode)
    return {
        "total_s": total,
        "prefill_s": sum(s["time_s"] for s in prefill),
        "num_prefill_steps": len(prefill),
        "prefill_tokens": sum(s["num_tokens"] for s in prefill),
        "num_decode_steps": len(decode),
        "decode_step_ms": summarize([s["time_s"] for s in decode]),
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time else 0.0,
        "batch_size": batch_size,
    }


def run_latency(args: argparse.Namespace, config: EngineConfig) -> int:
    from pagoda.bench.throughput import random_prompts
    from pagoda.engine.engine_core import EngineCore
    from pagoda.tokenizer import load_tokenizer

    config = EngineConfig(**{**vars(config), "show_progress": False})
    tokenizer = load_tokenizer(config)
    core = EngineCore(config)
    special = set(tokenizer.all_special_ids)
    for i in range(args.num_iters_warmup):
        run_batch(core, random_prompts(args.batch_size, args.input_len, tokenizer.vocab_size, special,
                                       seed=10_000 + i), args.output_len, f"warmup{i}")
    iterations = []
    for i in range(args.num_iters):
        prompts = random_prompts(args.batch_size, args.input_len, tokenizer.vocab_size, special,
                                 seed=config.seed + i)
        steps = run_batch(core, prompts, args.output_len, f"iter{i}")
        it = summarize_iteration(steps, args.batch_size)
        it["steps"] = steps
        iterations.append(it)
        d = it["decode_step_ms"]
        print(f"iter {i}: total {it['total_s'] * 1000:.0f} ms; prefill {it['prefill_s'] * 1000:.0f} ms in "
              f"{it['num_prefill_steps']} step(s) ({it['prefill_tokens']} tokens); decode step ms "
              f"mean {d['mean']:.1f} median {d['median']:.1f} p90 {d['p90']:.1f} p99 {d['p99']:.1f} "
              f"({it['decode_tokens_per_s']:.1f} tok/s)")
    totals = [it["total_s"] for it in iterations]
    prefills = [it["prefill_s"] for it in iterations]
    decode_steps = [s["time_s"] for it in iterations for s in it["steps"] if s["kind"] == "decode"]
    summary = {
        "total_ms": summarize(totals),
        "prefill_ms": summarize(prefills),
        "decode_step_ms": summarize(decode_steps),
        "prefill_tokens_per_s": args.batch_size * args.input_len / (sum(prefills) / len(prefills)),
        "decode_tokens_per_s": args.batch_size / (sum(decode_steps) / len(decode_steps)) if decode_steps else 0.0,
    }
    print(f"batch {args.batch_size} x (in {args.input_len}, out {args.output_len}), {args.num_iters} iterations:")
    print(f"  end to end   median {summary['total_ms']['median']:.0f} ms, p99 {summary['total_ms']['p99']:.0f} ms")
    print(f"  prefill      median {summary['prefill_ms']['median']:.0f} ms "
          f"({summary['prefill_tokens_per_s']:.0f} prompt tok/s)")
    print(f"  decode step  median {summary['decode_step_ms']['median']:.1f} ms, "
          f"p99 {summary['decode_step_ms']['p99']:.1f} ms ({summary['decode_tokens_per_s']:.1f} tok/s)")
    if args.save_result:
        report = {
            "benchmark": "latency",
            "workload": {"batch_size": args.batch_size, "input_len": args.input_len,
                         "output_len": args.output_len, "num_iters": args.num_iters,
                         "num_iters_warmup": args.num_iters_warmup},
            "engine": {k: v for k, v in dataclasses.asdict(config).items() if k != "show_progress"},
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                        "threads": torch.get_num_threads()},
            "summary": summary,
            "iterations": iterations,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.save_result)), exist_ok=True)
        with open(args.save_result, "w") as f:
            json.dump(report, f, indent=1)
        print(f"results: {args.save_result}")
    return 0


def add_latency_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--save-result", default=None, help="write the results (every step) as JSON here")
