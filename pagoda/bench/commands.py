"""`pagoda bench ...` subcommands. Each benchmark module registers its parser here."""

from __future__ import annotations

import argparse
from typing import Callable


def add_bench_commands(
    sub: argparse._SubParsersAction,
    add_engine_args: Callable[[argparse.ArgumentParser], None],
    config_from_args: Callable,
) -> None:
    tp = sub.add_parser("throughput", help="offline throughput through LLM.generate")
    add_engine_args(tp)
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--input-len", type=int, default=128)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--compare-hf", action="store_true",
                    help="also run HF transformers generate() with a static batch, same prompts")
    tp.add_argument("--hf-batch-size", type=int, default=None, help="static batch size for HF (default: all)")
    tp.add_argument("--save-result", default=None, help="write the results as JSON here")

    def run_tp(args: argparse.Namespace) -> int:
        from pagoda.bench.throughput import run_throughput

        return run_throughput(args, config_from_args(args))

    tp.set_defaults(func=run_tp)

    sv = sub.add_parser("serve", help="load-test an OpenAI-compatible server (streamed; sweeps, plots)")
    from pagoda.bench.serve import add_serve_args

    add_serve_args(sv)

    def run_sv(args: argparse.Namespace) -> int:
        from pagoda.bench.serve import run_serve

        return run_serve(args)

    sv.set_defaults(func=run_sv)

    sk = sub.add_parser("soak", help="chaos/soak a running server (started with --enable-debug-endpoints)")
    from pagoda.bench.soak import add_soak_args

    add_soak_args(sk)

    def run_sk(args: argparse.Namespace) -> int:
        from pagoda.bench.soak import run_soak_command

        return run_soak_command(args)

    sk.set_defaults(func=run_sk)

    lat = sub.add_parser("latency", help="one batch through the engine core: per-step prefill and decode times")
    add_engine_args(lat)
    from pagoda.bench.latency import add_latency_args

    add_latency_args(lat)

    def run_lat(args: argparse.Namespace) -> int:
        from pagoda.bench.latency import run_latency

        return run_latency(args, config_from_args(args))

    lat.set_defaults(func=run_lat)

    rf = sub.add_parser("roofline", help="GEMM peak and memory bandwidth, and where prefill/decode steps sit")
    add_engine_args(rf)
    from pagoda.bench.roofline import add_roofline_args

    add_roofline_args(rf)

    def run_rf(args: argparse.Namespace) -> int:
        from pagoda.bench.roofline import run_roofline

        return run_roofline(args, config_from_args(args))

    rf.set_defaults(func=run_rf)

    par = sub.add_parser("parallel", help="throughput of TP=1 vs TP=2 and DP=1 vs DP=2 (one thread per rank)")
    add_engine_args(par)
    from pagoda.bench.parallel import add_parallel_args

    add_parallel_args(par)

    def run_par(args: argparse.Namespace) -> int:
        from pagoda.bench.parallel import run_parallel

        return run_parallel(args, config_from_args(args, data_parallel_size=1))

    par.set_defaults(func=run_par)

    sp = sub.add_parser("spec", help="single-stream decode tok/s with speculative decoding vs without")
    add_engine_args(sp)
    from pagoda.bench.spec import add_spec_args

    add_spec_args(sp)

    def run_sp(args: argparse.Namespace) -> int:
        from pagoda.bench.spec import run_spec_bench

        return run_spec_bench(args, config_from_args(args))

    sp.set_defaults(func=run_sp)

    fa = sub.add_parser("fairness", help="light vs heavy tenant TTFT under fcfs and fair scheduling (engine core)")
    add_engine_args(fa)
    from pagoda.bench.fairness import add_fairness_args, add_long_prefill_args

    add_fairness_args(fa)

    def run_fa(args: argparse.Namespace) -> int:
        from pagoda.bench.fairness import run_fairness

        return run_fairness(args, config_from_args(args))

    fa.set_defaults(func=run_fa)

    lp = sub.add_parser("long-prefill", help="short prompts' TTFT behind a flood of long ones, knob off and on")
    add_engine_args(lp)
    add_long_prefill_args(lp)

    def run_lp(args: argparse.Namespace) -> int:
        from pagoda.bench.fairness import run_long_prefill

        return run_long_prefill(args, config_from_args(args))

    lp.set_defaults(func=run_lp)

    lr = sub.add_parser("lora", help="throughput of a batch over several LoRA adapters vs all on the base model")
    add_engine_args(lr)
    from pagoda.bench.lora import add_lora_bench_args

    add_lora_bench_args(lr)

    def run_lr(args: argparse.Namespace) -> int:
        from pagoda.bench.lora import run_lora_bench

        return run_lora_bench(args, config_from_args(args))

    lr.set_defaults(func=run_lr)
