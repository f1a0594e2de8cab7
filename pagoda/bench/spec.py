"""`pagoda bench spec`: single-stream decode speed with and without speculative decoding.

One model load, then for each configuration (no speculation first, then each
``--spec``) the same prompts run one at a time through the engine core, greedy,
``ignore_eos``. Two workloads:

- ``repetitive``: code editing, where the answer copies most of the prompt (what
  ngram prompt lookup is for);
- ``open``: open-ended questions, where the output rarely repeats the prompt.

Reported per configuration and workload: decode tokens/s (tokens after the first over
the time from the first token to the last, the single-stream decode rate), end-to-end
time, the draft acceptance rate (accepted / proposed drafts), mean tokens per
verification round, acceptance per draft position, and whether the greedy tokens match
the run without speculation (they should; a near-tie can flip one in fp32).
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

from pagoda.config import EngineConfig

_CODE = [
    '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for value in values:
        total += (value - m) ** 2
    return total / len(values)
''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]
''',
    '''def read_config(path):
    with open(path) as f:
        lines = f.readlines()
    config = {}
    for line in lines:
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config
''',
]
_EDITS = ["Rename the variable `total` to `acc`", "Add a docstring to every method",
          "Rename the function `read_config` to `load_config`"]
_QUESTIONS = ["Tell me a short story about a lighthouse keeper.", "Why is the sky blue?",
              "Give me three tips for learning a new language."]


def workload_prompts(tokenizer: Any, name: str, num: int) -> list[list[int]]:
    if name == "repetitive":
        messages = [
            f"{_EDITS[i % len(_EDITS)]} in this code and print the whole code again.\n\n```python\n"
            f"{_CODE[i % len(_CODE)]}```"
            for i in range(num)
        ]
    else:
        messages = [_QUESTIONS[i % len(_QUESTIONS)] for i in range(num)]
    prompts = []
    for m in messages:
        text = tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def run_one(core: Any, prompt: list[int], output_len: int, rid: str) -> dict[str, Any]:
    from pagoda.engine.messages import EngineCoreRequest
    from pagoda.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params))
    tokens: list[int] = []
    start = time.perf_counter()
    first = last = start
    steps = 0
    while core.has_unfinished_requests():
        out = core.step()
        steps += 1
        now = time.perf_counter()
        for o in out.outputs:
            if o.new_token_ids and not tokens:
                first = now
            tokens += o.new_token_ids
            last = now
    return {"tokens": tokens, "e2e_s": last - start, "decode_s": last - first, "steps": steps}


def _spec_counters(core: Any) -> tuple[int, int, int, list[int]]:
    s = core.scheduler.make_stats()
    return s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens, list(s.spec_accepted_per_pos)


def bench_config(loaded: Any, config: EngineConfig, spec: dict | None, workloads: dict[str, list[list[int]]],
                 output_len: int, warmup: int) -> dict[str, Any]:
    from pagoda.engine.engine_core import EngineCore

    core = EngineCore(dataclasses.replace(config, speculative_config=spec, show_progress=False),
                      loaded=loaded, collect_stats=False)
    for i in range(warmup):
        first = next(iter(workloads.values()))[0]
        run_one(core, first, min(output_len, 16), f"warmup{i}")
    results: dict[str, Any] = {}
    for name, prompts in workloads.items():
        before = _spec_counters(core)
        runs = [run_one(core, p, output_len, f"{name}{i}") for i, p in enumerate(prompts)]
        after = _spec_counters(core)
        drafts, draft_tokens, accepted = (after[i] - before[i] for i in range(3))
        per_pos = [a - b for a, b in zip(after[3], before[3] + [0] * len(after[3]))]
        decode_tokens = sum(len(r["tokens"]) - 1 for r in runs)
        decode_s = sum(r["decode_s"] for r in runs)
        results[name] = {
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
            "e2e_s": sum(r["e2e_s"] for r in runs),
            "steps": sum(r["steps"] for r in runs),
            "num_drafts": drafts,
            "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_tokens_per_round": 1 + accepted / drafts if drafts else None,
            "acceptance_per_position": [n / drafts for n in per_pos] if drafts else [],
            "tokens": [r["tokens"] for r in runs],
        }
    return results


def spec_label(spec: dict | None) -> str:
    """E.g. 'ngram k=4 n=2..4', 'layer_skip k=3 L=15', 'none'."""
    if spec is None:
        return "none"
    k = spec["num_speculative_tokens"]
    if spec["method"] == "ngram":
        return f"ngram k={k} n={spec.get('prompt_lookup_min', 1)}..{spec.get('prompt_lookup_max', 4)}"
    if spec["method"] == "layer_skip":
        return f"layer_skip k={k} L={spec['num_layers']}"
    return f"draft_model k={k} {os.path.basename(str(spec['model']))}"


def default_specs(num_layers: int) -> list[dict]:
    return [
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": max(1, num_layers // 2)},
    ]


def run_spec_bench(args: argparse.Namespace, config: EngineConfig) -> int:
    from pagoda.model.loader import load_model, parse_dtype
    from pagoda.config.speculative import SpeculativeConfig
    from pagoda.tokenizer import build_tokenizer

    if args.spec and config.speculative_config is not None:
        raise ValueError("bench spec: give the configurations to compare with --spec or "
                         "--speculative-config, not both")
    loaded = load_model(config.model, parse_dtype(config.dtype), torch.device(config.device),
                        show_progress=False, quantization=config.quantization)
    tokenizer = build_tokenizer(loaded, config.chat_template)
    if args.spec:
        specs = [dataclasses.asdict(SpeculativeConfig.parse(s)) for s in args.spec]
    elif config.speculative_config is not None:
        specs = [dataclasses.asdict(config.speculative_config)]
    else:
        specs = default_specs(loaded.arch.num_hidden_layers)
    specs = [{k: v for k, v in s.items() if v is not None} for s in specs]
    workloads = {w: workload_prompts(tokenizer, w, args.num_prompts) for w in args.workloads}
    rows: list[tuple[str, dict]] = []
    base = bench_config(loaded, config, None, workloads, args.output_len, args.num_warmup)
    rows.append((spec_label(None), base))
    for spec in specs:
        rows.append((spec_label(spec), bench_config(loaded, config, spec, workloads, args.output_len,
                                                    args.num_warmup)))
    print(f"single-stream greedy decode, {args.num_prompts} prompt(s) x {args.output_len} tokens per workload")
    print(f"{'workload':<11} {'speculation':<28} {'tok/s':>7} {'x':>5} {'accept':>7} {'tok/rnd':>7} {'same':>5}")
    for w in args.workloads:
        base_rate = base[w]["decode_tokens_per_s"]
        for label, res in rows:
            r = res[w]
            same = sum(a == b for a, b in zip(r["tokens"], base[w]["tokens"]))
            accept = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
            per_round = "-" if r["mean_tokens_per_round"] is None else f"{r['mean_tokens_per_round']:.2f}"
            speedup = r["decode_tokens_per_s"] / base_rate if base_rate else 0.0
            print(f"{w:<11} {label:<28} {r['decode_tokens_per_s']:>7.1f} {speedup:>5.2f} {accept:>7} "
                  f"{per_round:>7} {same:>2}/{len(r['tokens'])}")
    if args.save_result:
        report = {
            "benchmark": "spec",
            "workload": {"num_prompts": args.num_prompts, "output_len": args.output_len,
                         "workloads": args.workloads, "num_warmup": args.num_warmup},
            "engine": {k: v for k, v in dataclasses.asdict(config).items()
                       if k not in ("show_progress", "speculative_config")},
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                        "threads": torch.get_num_threads()},
            "results": [
                {"speculative_config": spec, "label": label,
                 **{w: {k: v for k, v in res[w].items() if k != "tokens"} for w in args.workloads}}
                for (label, res), spec in zip(rows, [None, *specs])
            ],
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.save_result)), exist_ok=True)
        with open(args.save_result, "w") as f:
            json.dump(report, f, indent=1)
        print(f"results: {args.save_result}")
    return 0


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", action="append", default=None,
                   help="a speculative config (JSON) to compare against no speculation; repeatable "
                        "(default: ngram k=4 and layer_skip over half the layers, k=3; or --speculative-config)")
    p.add_argument("--workloads", nargs="+", default=["repetitive", "open"], choices=("repetitive", "open"))
    p.add_argument("--num-prompts", type=int, default=3, help="prompts per workload, run one at a time")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-warmup", type=int, default=1)
    p.add_argument("--save-result", default=None, help="write the results as JSON here")
