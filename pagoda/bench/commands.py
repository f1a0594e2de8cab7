"""`pagoda bench ...` subcommands. Each benchmark module gives an `add_*_args(parser)` and a
runner; this table registers them. Modules are imported when their command runs (the
argument adders when the parser is built), so `pagoda serve` never imports a benchmark."""

from __future__ import annotations

import argparse
import importlib
from typing import Callable, NamedTuple


class BenchCommand(NamedTuple):
    name: str
    help: str
    module: str            # pagoda.bench.<module>
    add_args: str          # its function that adds the command's own options
    run: str               # its runner: run(args) or run(args, config)
    engine: bool = True    # takes the engine options and gets an EngineConfig
    config_extra: tuple[tuple[str, object], ...] = ()   # EngineConfig overrides


COMMANDS = (
    BenchCommand("throughput", "offline throughput through LLM.generate", "throughput", "add_throughput_args",
                 "run_throughput"),
    BenchCommand("serve", "load-test an OpenAI-compatible server (streamed; sweeps, plots)", "serve",
                 "add_serve_args", "run_serve", engine=False),
    BenchCommand("batch", "live TTFT with a Batch API batch running vs without, and a restart mid-batch", "batch",
                 "add_batch_args", "run_batch_bench", engine=False),
    BenchCommand("soak", "chaos/soak a running server (started with --enable-debug-endpoints)", "soak",
                 "add_soak_args", "run_soak_command", engine=False),
    BenchCommand("latency", "one batch through the engine core: per-step prefill and decode times", "latency",
                 "add_latency_args", "run_latency"),
    BenchCommand("attention", "the CPU decode-attention kernel's KV bytes/s against the read bandwidth, over "
                 "contexts and batches", "attention", "add_attention_args", "run_attention_bench", engine=False),
    BenchCommand("roofline", "GEMM peak and memory bandwidth, and where prefill/decode steps sit", "roofline",
                 "add_roofline_args", "run_roofline"),
    BenchCommand("parallel", "throughput of TP=1 vs TP=2 and DP=1 vs DP=2 (one thread per rank)", "parallel",
                 "add_parallel_args", "run_parallel", config_extra=(("data_parallel_size", 1),)),
    BenchCommand("spec", "single-stream decode tok/s with speculative decoding vs without", "spec",
                 "add_spec_args", "run_spec_bench"),
    BenchCommand("fairness", "light vs heavy tenant TTFT under fcfs and fair scheduling (engine core)", "fairness",
                 "add_fairness_args", "run_fairness"),
    BenchCommand("long-prefill", "short prompts' TTFT behind a flood of long ones, knob off and on", "fairness",
                 "add_long_prefill_args", "run_long_prefill"),
    BenchCommand("embed", "embeddings/s through LLM.embed vs HF transformers, same prompts, same run", "embed",
                 "add_embed_args", "run_embed"),
    BenchCommand("lora", "throughput of a batch over several LoRA adapters vs all on the base model", "lora",
                 "add_lora_bench_args", "run_lora_bench"),
)


def add_bench_commands(
    sub: argparse._SubParsersAction,
    add_engine_args: Callable[[argparse.ArgumentParser], None],
    config_from_args: Callable,
) -> None:
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help)
        if cmd.engine:
            add_engine_args(p)
        getattr(importlib.import_module(f"pagoda.bench.{cmd.module}"), cmd.add_args)(p)

        def run(args: argparse.Namespace, cmd: BenchCommand = cmd) -> int:
            runner = getattr(importlib.import_module(f"pagoda.bench.{cmd.module}"), cmd.run)
            if not cmd.engine:
                return runner(args)
            return runner(args, config_from_args(args, **dict(cmd.config_extra)))

        p.set_defaults(func=run)
