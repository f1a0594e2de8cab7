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
