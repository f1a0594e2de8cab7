"""What the metrics cost the engine's step: ``python -m pagoda.bench.overhead``.

Two measurements on the same EngineCore and workload:

1. Direct: the time spent in the engine-side metrics code (the step record with its
   FLOPs/bytes estimate, the KV pool picture, and the extra msgpack bytes they add to
   each step's message), divided by the step time. Precise even on a noisy machine.
2. A/B: one workload with stats collection switched on and off on alternate steps
   (so both see the same batches and the same machine load); the ratio of the median
   decode step times. Honest, but only as precise as the machine is quiet.

The front end's share (decode + EngineMetrics updates) runs in the API process, not
in the step, and is reported separately per step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import msgspec

from pagoda.config import EngineConfig
from pagoda.engine.engine_core import EngineCore
from pagoda.engine.output_processor import OutputProcessor, make_core_requests
from pagoda.engine.messages import EngineCoreOutputs
from pagoda.metrics.stats import EngineMetrics
from pagoda.sampling_params import SamplingParams


class _Timed:
    """Wraps a callable and sums the time spent in it."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.total = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - t


def _add_requests(core: EngineCore, tag: str, n: int, prompt_len: int, output_len: int) -> list[str]:
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    ids = []
    for i in range(n):
        prompt = [(1000 + 37 * i + j) % core.vocab_size for j in range(prompt_len)]
        for req in make_core_requests(f"{tag}-{i}", prompt, params, frozenset()):
            core.add_request(req)
            ids.append(req.request_id)
    return ids


def run_interleaved(core: EngineCore, collector: Any, tag: str, n: int, prompt_len: int,
                    output_len: int) -> dict[str, Any]:
    """One workload in which stats collection is switched on and off on alternate steps,
    so that both halves see the same batch and the same machine load."""
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(EngineCoreOutputs)
    ids = _add_requests(core, tag, n, prompt_len, output_len)
    front = EngineMetrics(core.max_model_len, core.config.max_num_seqs, core.config.max_num_batched_tokens)
    proc = OutputProcessor(None)
    for rid in ids:
        front.add_request(rid, time.monotonic(), prompt_len)
        proc.add_request(rid, None, [0] * prompt_len, SamplingParams(max_tokens=output_len))
    times: dict[bool, list[float]] = {True: [], False: []}     # decode-only steps, by stats on/off
    on_total, on_steps, encode_extra, front_time = 0.0, 0, 0.0, 0.0
    i = 0
    while core.has_unfinished_requests():
        on = i % 2 == 0
        i += 1
        core.step_stats = collector if on else None
        t0 = time.perf_counter()
        out = core.step()
        payload = enc.encode(out)
        elapsed = time.perf_counter() - t0
        stats = out.scheduler_stats
        if stats is not None and stats.step_num_tokens == stats.step_batch_size:
            times[on].append(elapsed)
        if not on:
            continue
        on_total += elapsed
        on_steps += 1
        # What the record and the pool picture add to encoding the message.
        t1 = time.perf_counter()
        enc.encode(out)
        with_stats = time.perf_counter() - t1
        bare = msgspec.structs.replace(out, step=None, kv_block_map=None)
        t1 = time.perf_counter()
        enc.encode(bare)
        encode_extra += max(0.0, with_stats - (time.perf_counter() - t1))
        # The front end's work for this message (in the API process in a server).
        t1 = time.perf_counter()
        msg = dec.decode(payload)
        now = time.monotonic()
        front.on_engine_outputs(msg, now)
        results, _ = proc.process_outputs(msg.outputs)
        front.on_request_outputs(results, now)
        front_time += time.perf_counter() - t1
    core.step_stats = collector
    return {"on_steps": on_steps, "on_total": on_total, "encode_extra": encode_extra, "front": front_time,
            "decode_on": times[True], "decode_off": times[False]}


def record_cost_per_request(arch: Any, batch: int = 256, repeats: int = 200) -> float:
    """Seconds record_step spends per request on a decode batch of ``batch`` requests
    (no model: the scheduler alone), to extrapolate to fast (GPU) steps."""
    from pagoda.core.kv_cache_manager import KVCacheManager
    from pagoda.core.request import Request
    from pagoda.core.sched_output import ModelRunnerOutput
    from pagoda.core.scheduler import Scheduler, SchedulerConfig
    from pagoda.metrics.step import StepStatsCollector

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=batch * 32, max_num_seqs=batch, max_model_len=256),
                      KVCacheManager(batch * 4, 16))
    for i in range(batch):
        prompt = [(7 * i + j) % arch.vocab_size for j in range(32)]
        sched.add_request(Request(f"chatcmpl-{i:032x}", prompt, SamplingParams(max_tokens=8), max_model_len=256))
    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    sched.update_from_output(so, ModelRunnerOutput(ids, [[1]] * len(ids)))
    so = sched.schedule()                    # a batch of `batch` decodes
    collector = StepStatsCollector(arch)
    t = time.perf_counter()
    for _ in range(repeats):
        collector.record_step(so, sched.requests, 0.0)
    return (time.perf_counter() - t) / repeats / batch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    core = EngineCore(EngineConfig(model=args.model, show_progress=False, device=args.device,
                                   max_model_len=args.prompt_len + args.output_len + 16, num_kv_blocks=1024))
    collector = core.step_stats
    assert collector is not None
    record = collector.record_step = _Timed(collector.record_step)  # type: ignore[method-assign]
    pool_map = collector.maybe_block_map = _Timed(collector.maybe_block_map)  # type: ignore[method-assign]
    run_interleaved(core, collector, "warmup", 4, args.prompt_len, 4)
    record.total = pool_map.total = 0.0

    res = run_interleaved(core, collector, "run", args.num_requests, args.prompt_len, args.output_len)
    steps_on = res["on_steps"]
    engine_metrics = record.total + pool_map.total + res["encode_extra"]
    print(f"workload: {args.num_requests} requests x ({args.prompt_len} prompt + {args.output_len} output) tokens, "
          f"stats on for every other step ({steps_on} steps), device {args.device}")
    print(f"mean step time (stats on): {res['on_total'] / steps_on * 1e3:.2f} ms")
    print(f"engine-side metrics per step: record {record.total / steps_on * 1e6:.1f} us, "
          f"KV pool picture {pool_map.total / steps_on * 1e6:.1f} us, "
          f"extra encoding {res['encode_extra'] / steps_on * 1e6:.1f} us")
    print(f"direct overhead: {engine_metrics / (res['on_total'] - engine_metrics) * 100:.3f} % of step time")
    on, off = res["decode_on"], res["decode_off"]
    if on and off:
        med_on, med_off = statistics.median(on), statistics.median(off)
        print(f"interleaved A/B, decode steps: median on {med_on * 1e3:.2f} ms ({len(on)}), "
              f"off {med_off * 1e3:.2f} ms ({len(off)}), ratio {med_on / med_off:.4f} "
              f"(noise: step times vary {statistics.pstdev(off) / med_off * 100:.0f} % around the median)")
    print(f"front end (API process, not in the step): {res['front'] / steps_on * 1e6:.1f} us per step")
    per_req = record_cost_per_request(core.loaded.arch)
    print(f"step record on a 256-decode batch: {per_req * 1e6:.2f} us per request "
          f"({per_req * 256 * 1e3:.3f} ms per step; < 2 % of any step longer than {per_req * 256 * 50 * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
