"""`pagoda bench fairness` and `pagoda bench long-prefill`: scheduling policies under contention.

Both drive the engine core in-process (no HTTP) with an open-loop arrival schedule
(seeded Poisson arrivals, fixed prompt and output lengths, fresh random prompts so the
prefix cache never helps) and report each class's time to first token, in seconds and
in engine steps, for each configuration on the same arrival schedule:

- fairness: a heavy tenant sending ``--heavy-rate`` requests/s (10x the light tenant's
  ``--light-rate`` by default). Runs the light tenant alone (its baseline), then both
  under each ``--policies`` entry. With ``fair`` the light tenant's TTFT should stay near
  its baseline; with ``fcfs`` it grows with the heavy tenant's queue.
- long-prefill: a flood of ``--long-len`` prompts plus a trickle of ``--short-len`` ones,
  without and with ``--max-long-partial-prefills`` / ``--long-prefill-token-threshold``.

TTFT here is measured in the engine's loop: from the moment a request is added (at its
arrival time, or at the end of the step running then) to the end of the step that
sampled its first token.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from dataclasses import dataclass
from typing import Any

from pagoda.bench.metrics import summarize
from pagoda.config import EngineConfig


@dataclass
class Arrival:
    time: float          # seconds after the start
    request_id: str
    cls: str             # the class reported on: a tenant, or short / long
    prompt: list[int]
    max_tokens: int
    tenant: str | None = None


def poisson_times(rate: float, duration: float, rng: random.Random) -> list[float]:
    times, t = [], 0.0
    if rate <= 0:
        return times
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return times
        times.append(t)


def make_arrivals(classes: list[tuple[str, float, int, int]], duration: float, vocab_size: int,
                  special: set[int], seed: int) -> list[Arrival]:  # fmt: skip
    """classes: (name, rate/s, prompt length, output length); every class is its own tenant."""
    from pagoda.bench.throughput import random_prompts

    rng = random.Random(seed)
    arrivals = []
    for k, (name, rate, prompt_len, output_len) in enumerate(classes):
        times = poisson_times(rate, duration, rng)
        prompts = random_prompts(len(times), prompt_len, vocab_size, special, seed=seed * 1000 + k)
        arrivals += [Arrival(t, f"{name}-{i}", name, p, output_len, tenant=name)
                     for i, (t, p) in enumerate(zip(times, prompts))]  # fmt: skip
    return sorted(arrivals, key=lambda a: a.time)


def run_schedule(core: Any, arrivals: list[Arrival], max_wall_s: float) -> dict[str, Any]:
    """Feed the arrivals in real time, step the engine until all are done."""
    from pagoda.engine.messages import EngineCoreRequest
    from pagoda.sampling_params import SamplingParams

    pending = list(reversed(arrivals))
    added: dict[str, tuple[float, int]] = {}
    ttft_s: dict[str, float] = {}
    ttft_steps: dict[str, int] = {}
    by_id = {a.request_id: a for a in arrivals}
    start = time.monotonic()
    steps = 0
    while pending or core.has_unfinished_requests():
        now = time.monotonic() - start
        if now > max_wall_s:
            break
        while pending and pending[-1].time <= now:
            a = pending.pop()
            params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
            core.add_request(EngineCoreRequest(a.request_id, a.prompt, params, tenant=a.tenant))
            added[a.request_id] = (time.monotonic(), steps)
        if not core.has_unfinished_requests():
            time.sleep(min(0.005, max(0.0, pending[-1].time - now)) if pending else 0)
            continue
        out = core.step()
        steps += 1
        end = time.monotonic()
        for o in out.outputs:
            if o.new_token_ids and o.request_id not in ttft_s:
                t0, s0 = added[o.request_id]
                ttft_s[o.request_id] = end - t0
                ttft_steps[o.request_id] = steps - s0
    if core.has_unfinished_requests():
        core.abort_requests(list(core.scheduler.requests))
    classes: dict[str, dict[str, Any]] = {}
    for cls in sorted({a.cls for a in arrivals}):
        ids = [rid for rid in ttft_s if by_id[rid].cls == cls]
        classes[cls] = {
            "num_requests": sum(1 for a in arrivals if a.cls == cls),
            "num_with_first_token": len(ids),
            "ttft_ms": summarize([ttft_s[r] for r in ids]),
            "ttft_steps": summarize([float(ttft_steps[r]) for r in ids], scale=1.0),
        }
    return {"wall_s": time.monotonic() - start, "steps": steps, "classes": classes,
            "complete": not pending and len(ttft_s) == len(arrivals)}  # fmt: skip


def _engine(config: EngineConfig, loaded: Any, **changes: Any) -> Any:
    from pagoda.engine.engine_core import EngineCore
    from pagoda.engine.messages import EngineCoreRequest
    from pagoda.sampling_params import SamplingParams

    core = EngineCore(dataclasses.replace(config, show_progress=False, **changes), loaded=loaded,
                      collect_stats=False)  # fmt: skip
    # Warm-up (first-call allocations, thread pools), so the first arrivals do not pay for it.
    core.add_request(EngineCoreRequest("warmup", [1] * 16, SamplingParams(max_tokens=2)))
    while core.has_unfinished_requests():
        core.step()
    return core


def _setup(config: EngineConfig) -> tuple[Any, int, set[int]]:
    from pagoda.tokenizer import load_tokenizer
    from pagoda.model.loader import load_model, parse_dtype
    import torch

    tokenizer = load_tokenizer(config)
    loaded = load_model(config.model, parse_dtype(config.dtype), torch.device(config.device), show_progress=False,
                        quantization=config.quantization)  # fmt: skip
    return loaded, tokenizer.vocab_size, set(tokenizer.all_special_ids)


def _report(title: str, runs: dict[str, dict[str, Any]], classes: list[str]) -> None:
    print(title)
    print(f"{'run':<28}" + "".join(f"{c + ' TTFT p50/p90 ms (steps)':>40}" for c in classes))
    for name, run in runs.items():
        row = f"{name:<28}"
        for c in classes:
            s = run["classes"].get(c)
            if s is None:
                row += f"{'-':>40}"
                continue
            ms, st = s["ttft_ms"], s["ttft_steps"]
            cell = f"{ms['median']:.0f}/{ms['p90']:.0f} ({st['median']:.0f}/{st['p90']:.0f})"
            row += f"{cell:>40}"
        print(row + ("" if run["complete"] else "  [cut at --max-wall-s]"))


def _save(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-wall-s", type=float, default=600.0, help="stop a run after this long")
    p.add_argument("--arrival-seed", type=int, default=0)
    p.add_argument("--save-result", default=None, help="write the results as JSON here")


# ---------------------------------------------------------------------- fairness
def add_fairness_args(p: argparse.ArgumentParser) -> None:
    _common_args(p)
    p.add_argument("--heavy-rate", type=float, default=10.0, help="heavy tenant requests/s")
    p.add_argument("--light-rate", type=float, default=1.0, help="light tenant requests/s")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--policies", default="fcfs,fair", help="comma-separated policies to compare")


def run_fairness(args: argparse.Namespace, config: EngineConfig) -> int:
    loaded, vocab, special = _setup(config)
    both = make_arrivals([("heavy", args.heavy_rate, args.prompt_len, args.output_len),
                          ("light", args.light_rate, args.prompt_len, args.output_len)],
                         args.duration, vocab, special, args.arrival_seed)  # fmt: skip
    light = [a for a in both if a.cls == "light"]
    runs = {"light alone": run_schedule(_engine(config, loaded), light, args.max_wall_s)}
    for policy in args.policies.split(","):
        runs[f"heavy+light, {policy}"] = run_schedule(_engine(config, loaded, scheduling_policy=policy), both,
                                                      args.max_wall_s)  # fmt: skip
    _report(f"fairness: heavy {args.heavy_rate}/s vs light {args.light_rate}/s, prompt {args.prompt_len}, "
            f"output {args.output_len}", runs, ["light", "heavy"])  # fmt: skip
    _save(args, {"args": vars(args) | {"func": None}, "runs": runs})
    return 0


# ---------------------------------------------------------------------- long prefills
def add_long_prefill_args(p: argparse.ArgumentParser) -> None:
    _common_args(p)
    p.add_argument("--long-rate", type=float, default=1.0, help="long prompts/s")
    p.add_argument("--short-rate", type=float, default=2.0, help="short prompts/s")
    p.add_argument("--long-len", type=int, default=1500)
    p.add_argument("--short-len", type=int, default=32)
    p.add_argument("--cap", type=int, default=1, help="--max-long-partial-prefills of the second run")
    p.add_argument("--threshold", type=int, default=256, help="--long-prefill-token-threshold of the second run")


def run_long_prefill(args: argparse.Namespace, config: EngineConfig) -> int:
    loaded, vocab, special = _setup(config)
    arrivals = make_arrivals([("long", args.long_rate, args.long_len, args.output_len),
                              ("short", args.short_rate, args.short_len, args.output_len)],
                             args.duration, vocab, special, args.arrival_seed)  # fmt: skip
    runs = {
        "knob off": run_schedule(_engine(config, loaded, max_long_partial_prefills=None,
                                         long_prefill_token_threshold=None), arrivals, args.max_wall_s),
        f"cap {args.cap}, threshold {args.threshold}": run_schedule(
            _engine(config, loaded, max_long_partial_prefills=args.cap, long_prefill_token_threshold=args.threshold),
            arrivals, args.max_wall_s),
    }  # fmt: skip
    _report(f"long prefills: {args.long_rate}/s x {args.long_len} tokens, {args.short_rate}/s x "
            f"{args.short_len} tokens", runs, ["short", "long"])  # fmt: skip
    _save(args, {"args": vars(args) | {"func": None}, "runs": runs})
    return 0
