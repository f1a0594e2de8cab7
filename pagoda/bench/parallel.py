"""`pagoda bench parallel`: throughput and TTFT of TP=1 vs TP=2 vs PP=2 and DP=1 vs DP=2, same workload.

Each setting starts the engine the server would (AsyncLLM, or DataParallelLLM
for DP > 1, engine cores in their own processes), sends ``--num-prompts``
random prompts of ``--input-len`` tokens at once (greedy, ``--output-len``
tokens each, ignore_eos) and reports output tokens per second and the
requests' time to first token (all sent at once: TTFT includes queueing). Every rank or
replica gets ``--threads-per-rank`` torch threads (default 1), so TP=2, PP=2 and
DP=2 use twice the cores of TP=1 / DP=1: the question is how much of the
second core each turns into throughput.

    pagoda bench parallel --settings tp1,tp2,pp2,dp1,dp2 --num-prompts 32 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time

from pagoda.config import EngineConfig

# name -> (tensor, pipeline, data) parallel sizes, experts split by expert (a MoE model's
# experts whole on their rank, not every expert's rows split over the ranks)
_SETTINGS = {"tp1": (1, 1, 1, False), "tp2": (2, 1, 1, False), "tp2ep": (2, 1, 1, True),
             "pp2": (1, 2, 1, False), "tp2pp2": (2, 2, 1, False), "dp1": (1, 1, 1, False),
             "dp2": (1, 1, 2, False), "dp2ep": (1, 1, 2, True), "tp2dp2": (2, 1, 2, False)}


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--settings", default="tp1,tp2,dp2",
                   help=f"comma-separated, from {', '.join(_SETTINGS)} (tp1 and dp1 are the same engine)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--save-result", default=None, help="write the results as JSON here")


def _settings(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in _SETTINGS]
    if bad or not names:
        raise ValueError(f"unknown --settings {bad or text!r}; choose from {', '.join(_SETTINGS)}")
    return names


async def _run_one(config: EngineConfig, prompts: list[list[int]], output_len: int) -> dict:
    from pagoda import SamplingParams
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.engine.dp_client import DataParallelLLM

    cls = DataParallelLLM if config.data_parallel_size > 1 else AsyncLLM
    engine = cls.from_config(config, log_stats=False, log_requests=False)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)

    async def one(i: int, ids: list[int], p: SamplingParams) -> tuple[int, float]:
        n, first = 0, float("nan")
        sent = time.perf_counter()
        async for out in engine.generate(f"bench-{i}", None, ids, p):
            if n == 0 and out.outputs[0].token_ids:
                first = time.perf_counter() - sent
            n = len(out.outputs[0].token_ids)
        return n, first

    try:
        # Warm-up: one short request per replica's worth.
        warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        await asyncio.gather(*(one(-1 - i, prompts[i][:8], warm) for i in range(config.data_parallel_size)))
        start = time.perf_counter()
        done = await asyncio.gather(*(one(i, p, params) for i, p in enumerate(prompts)))
        elapsed = time.perf_counter() - start
    finally:
        await engine.shutdown()
    counts = [n for n, _ in done]
    ttfts = sorted(t for _, t in done)
    return {"elapsed_s": elapsed, "requests": len(prompts), "output_tokens": sum(counts),
            "output_tokens_per_s": sum(counts) / elapsed, "mean_ttft_s": sum(ttfts) / len(ttfts),
            "median_ttft_s": ttfts[len(ttfts) // 2]}


def run_parallel(args: argparse.Namespace, config: EngineConfig) -> int:
    from pagoda.bench.throughput import random_prompts
    from pagoda.tokenizer import load_tokenizer

    names = _settings(args.settings)
    tok = load_tokenizer(config)
    vocab = tok.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, set(tok.eos_token_ids), seed=config.seed)
    threads = config.threads_per_rank or 1
    results = {}
    for name in names:
        tp, pp, dp, ep = _SETTINGS[name]
        cfg = dataclasses.replace(config, tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                                  enable_expert_parallel=ep or config.enable_expert_parallel,
                                  threads_per_rank=threads, show_progress=False)
        r = asyncio.run(_run_one(cfg, prompts, args.output_len))
        # One process (not parallel) runs on its thread governor, not --threads-per-rank.
        single = tp * pp * dp == 1
        r.update(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                 expert_parallel=cfg.enable_expert_parallel, threads_per_rank=None if single else threads)
        results[name] = r
        print(f"{name:>7}: TP={tp} PP={pp} DP={dp}{' EP' if cfg.enable_expert_parallel else ''}, "
              f"{'one process, its thread governor' if single else f'{threads} thread(s) per rank'}: "
              f"{r['output_tokens_per_s']:.1f} output tok/s ({r['output_tokens']} tokens in {r['elapsed_s']:.1f} s), "
              f"TTFT mean {r['mean_ttft_s'] * 1e3:.0f} ms, median {r['median_ttft_s'] * 1e3:.0f} ms",
              flush=True)
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({"num_prompts": args.num_prompts, "input_len": args.input_len,
                       "output_len": args.output_len, "results": results}, f, indent=2)
    return 0
