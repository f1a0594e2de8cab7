"""`pagoda bench roofline`: where the model's prefill and decode steps sit on this machine's roofline.

1. The roofs: the best GEMM FLOP/s torch reaches here (fp32, and bf16 for reference) and
   the memory bandwidth of a large read and a large copy.
2. The model's forward (all layers + LM head on the sampled rows) is timed directly, with
   the per-step AttentionMetadata pagoda's runner would build, for decode batches of
   several sizes and context lengths and for prefills of several lengths.
3. Each step's FLOPs and ideal bytes come from `pagoda.metrics.cost.step_cost`; arithmetic
   intensity = FLOPs / bytes. A step left of the ridge (peak / bandwidth) is bound by
   memory, right of it by compute; "% of roof" is achieved FLOP/s over the roof at that
   intensity.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any, Callable

import torch

from pagoda.metrics.cost import step_cost_breakdown
from pagoda.config import EngineConfig
from pagoda.host import cpu_threads_policy
from pagoda.ops import cpu_kernels


def _best_time(fn: Callable[[], Any], min_time_s: float = 0.3, max_reps: int = 50) -> float:
    """Fastest of repeated runs (after one warm-up): on a shared machine the minimum is the
    least disturbed measurement, which is what a roof should be."""
    fn()
    best = float("inf")
    spent = 0.0
    for _ in range(max_reps):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best = min(best, dt)
        spent += dt
        if spent >= min_time_s:
            break
    return best


def measure_gemm_peak(dtype: torch.dtype, shapes: list[tuple[int, int, int]]) -> dict[str, Any]:
    per_shape = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=torch.float32).to(dtype)
        b = torch.randn(k, n, dtype=torch.float32).to(dtype)
        t = _best_time(lambda: torch.mm(a, b))
        per_shape[f"{m}x{k}x{n}"] = 2.0 * m * k * n / t
    return {"dtype": str(dtype).removeprefix("torch."), "peak_flops": max(per_shape.values()),
            "per_shape_flops": per_shape}


def measure_int8_peak(shapes: list[tuple[int, int, int]]) -> dict[str, Any]:
    """int8 x int8 -> int32 GEMM (torch._int_mm, what --quantization int8 runs for large steps)."""
    per_shape = {}
    for m, k, n in shapes:
        a = torch.randint(-127, 127, (m, k), dtype=torch.int8)
        b = torch.randint(-127, 127, (k, n), dtype=torch.int8)
        t = _best_time(lambda: torch._int_mm(a, b))
        per_shape[f"{m}x{k}x{n}"] = 2.0 * m * k * n / t
    return {"dtype": "int8", "peak_flops": max(per_shape.values()), "per_shape_flops": per_shape}


def linear_weight_bytes_per_element(model: torch.nn.Module) -> float:
    """Bytes per weight of the projections and LM head as loaded (4 for fp32, ~1 for
    int8, ~0.6 for q4 with its scales; exact mode's ``BlocksLinear`` counts its blocks,
    what its steps read), for the ideal-bytes side of the roofline."""
    from pagoda.model.layers.blocks import BlocksLinear
    from pagoda.model.layers.quantization import Bf16Linear, Int8Linear, Int8WeightLinear, Q4Linear

    elems = nbytes = 0
    # A Bf16Linear without bf16 units holds its weight in a BlocksLinear: counted once, as itself.
    inner = {id(m.blocks) for m in model.modules() if isinstance(m, Bf16Linear) and m.blocks is not None}
    for m in model.modules():
        if id(m) in inner:
            continue
        if isinstance(m, (torch.nn.Linear, Bf16Linear, Int8Linear, Int8WeightLinear, Q4Linear, BlocksLinear)):
            elems += m.in_features * m.out_features
            if isinstance(m, torch.nn.Linear):
                nbytes += m.weight.numel() * m.weight.element_size()
            elif isinstance(m, BlocksLinear):
                nbytes += m.weight_bytes
            else:
                nbytes += sum(b.numel() * b.element_size() for n, b in m.named_buffers() if n != "bias")
    return nbytes / elems


def measure_bandwidth(size_bytes: int) -> dict[str, float]:
    """A read (sum) and a copy of buffers far larger than the caches."""
    n = size_bytes // 4
    src = torch.rand(n)
    dst = torch.empty_like(src)
    read = size_bytes / _best_time(lambda: src.sum(), min_time_s=0.5)
    copy = 2 * size_bytes / _best_time(lambda: dst.copy_(src), min_time_s=0.5)
    return {"read_bytes_per_s": read, "copy_bytes_per_s": copy}


class StepTimer:
    """The model and a KV pool of distinct blocks per request (sharing blocks would let
    attention hit the caches and flatter decode)."""

    def __init__(self, config: EngineConfig, max_tokens_in_kv: int) -> None:
        from pagoda.attention.kv_quant import QuantizedKVCache, storage_dtype
        from pagoda.host import keep_freed_memory
        from pagoda.model.loader import load_model, parse_dtype
        from pagoda.worker.model_runner import allocate_kv_cache, kv_cache_bytes_per_block, kv_cache_storage, kv_layout

        if torch.device(config.device).type == "cpu":
            keep_freed_memory()   # as the engine does

        self.dtype = parse_dtype(config.dtype)
        self.device = torch.device(config.device)
        self.loaded = load_model(config.model, self.dtype, self.device, show_progress=False,
                                 quantization=config.quantization)
        self.model = self.loaded.model
        self.arch = self.loaded.arch
        self.block_size = config.block_size
        num_blocks = max_tokens_in_kv // self.block_size + 1
        a = self.arch
        # The KV cache the engine would use (float16 in the quantized modes, 8 bits with
        # scales for --kv-cache-dtype int8|fp8), filled with zeros (unit scales).
        kv_dtype, kv_quant = kv_cache_storage(config.resolved_kv_cache_dtype, self.dtype)
        layer_buffer = kv_layout(self.model).layer_buffer
        self.kv_caches = [allocate_kv_cache(self.model, num_blocks, self.block_size, kv_dtype, kv_quant, self.device,
                                            buffer=layer_buffer[i])
                          for i in range(a.num_hidden_layers)]  # fmt: skip
        for c in self.kv_caches:
            if isinstance(c, QuantizedKVCache):
                c.data.zero_()
                c.scales.fill_(1.0)
            else:
                c.zero_()
        self.kv_dtype = kv_dtype if kv_quant == "auto" else storage_dtype(kv_quant)
        self.kv_bytes_per_element = (kv_cache_bytes_per_block(self.model, 1, kv_dtype, kv_quant)
                                     / (2 * kv_layout(self.model).num_buffers * a.num_key_value_heads * a.head_dim))
        self.decode_kernel = cpu_kernels.use_decode_kernel(self.device, self.kv_dtype, self.dtype)
        self.num_blocks = num_blocks

    def time_step(self, query_lens: list[int], context_lens: list[int], min_time_s: float) -> float:
        from pagoda.attention import AttentionMetadata

        tables, next_block = [], 0
        for q, c in zip(query_lens, context_lens):
            need = -(-(q + c) // self.block_size)
            if next_block + need > self.num_blocks:
                raise ValueError("the KV pool is too small for this step")
            tables.append(list(range(next_block, next_block + need)))
            next_block += need
        num_tokens = sum(query_lens)
        gen = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, self.arch.vocab_size, (num_tokens,), generator=gen).to(self.device)
        positions = torch.tensor([p for q, c in zip(query_lens, context_lens) for p in range(c, c + q)],
                                 device=self.device)
        last = (torch.tensor(query_lens).cumsum(0) - 1).to(self.device)   # each request's last token

        @torch.inference_mode()
        def step() -> None:
            # The metadata is rebuilt each time, as the runner does every step.
            meta = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size, self.device,
                                           self.decode_kernel)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            self.model.compute_logits(hidden[last])
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        return _best_time(step, min_time_s=min_time_s, max_reps=10)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_roofline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode-batch-sizes", type=_int_list, default=[1, 4, 16, 64])
    p.add_argument("--context-lens", type=_int_list, default=[128, 512],
                   help="tokens already in the cache for the decode steps")
    p.add_argument("--prefill-lens", type=_int_list, default=[32, 128, 512],
                   help="prompt tokens of one request's prefill step")
    p.add_argument("--min-time", type=float, default=1.0, help="seconds of repeats per step (best is kept)")
    p.add_argument("--bandwidth-mib", type=int, default=512, help="buffer size for the bandwidth test")
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16 GEMM measurement")
    p.add_argument("--save-result", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="write the roofline PNG here")


def run_roofline(args: argparse.Namespace, config: EngineConfig) -> int:
    if config.world_size > 1 or config.data_parallel_size > 1:
        raise SystemExit("pagoda bench roofline times one process's forward; it does not take "
                         "--tensor-parallel-size, --pipeline-parallel-size or --data-parallel-size")
    if config.device == "cpu":
        threads = cpu_threads_policy(config.num_threads)
        if threads is not None:
            torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    shapes = [(512, 576, 1536), (1024, 1024, 1024), (2048, 2048, 2048)]
    gemm = [measure_gemm_peak(torch.float32, shapes)]
    if not args.no_bf16:
        gemm.append(measure_gemm_peak(torch.bfloat16, shapes[:2]))
    for g in gemm:
        print(f"GEMM {g['dtype']}: peak {g['peak_flops'] / 1e9:.1f} GFLOP/s "
              f"({', '.join(f'{s} {v / 1e9:.1f}' for s, v in g['per_shape_flops'].items())})")
    bw = measure_bandwidth(args.bandwidth_mib << 20)
    print(f"memory: read {bw['read_bytes_per_s'] / 1e9:.2f} GB/s, copy {bw['copy_bytes_per_s'] / 1e9:.2f} GB/s")

    max_kv = max([b * (c + 1) + b * config.block_size for b in args.decode_batch_sizes for c in args.context_lens]
                 + [p + config.block_size for p in args.prefill_lens])
    timer = StepTimer(config, max_kv)
    elem = torch.empty(0, dtype=timer.dtype).element_size()
    weight_elem = linear_weight_bytes_per_element(timer.model)
    if config.quantization == "int8":
        gemm.append(measure_int8_peak(shapes[:2]))
        peak = gemm[-1]["peak_flops"]   # its large steps run int8 GEMMs
    else:  # none, and q4 (large steps: dequantized tiles through fp32 BLAS)
        peak = next(g["peak_flops"] for g in gemm if g["dtype"] == str(timer.dtype).removeprefix("torch."))
    print(f"quantization {config.quantization}: {weight_elem:.3f} bytes per weight, compute roof "
          f"{peak / 1e9:.1f} GFLOP/s")
    bandwidth = max(bw["read_bytes_per_s"], bw["copy_bytes_per_s"])
    ridge = peak / bandwidth
    cases = [("prefill", f"prefill {p}", [p], [0]) for p in args.prefill_lens]
    cases += [("decode", f"decode b{b} ctx{c}", [1] * b, [c] * b)
              for c in args.context_lens for b in args.decode_batch_sizes]
    steps = []
    for kind, name, q_lens, c_lens in cases:
        t = timer.time_step(q_lens, c_lens, args.min_time)
        cost = step_cost_breakdown(timer.arch, sum(q_lens), c_lens, q_lens,
                                   weight_bytes=weight_elem, act_bytes=elem,
                                   kv_bytes=timer.kv_bytes_per_element)
        achieved = cost["flops"] / t
        roof = min(peak, cost["intensity"] * bandwidth)
        steps.append({
            "kind": kind, "name": name, "num_tokens": sum(q_lens), "batch_size": len(q_lens),
            "context_len": c_lens[0], "time_s": t, "flops": cost["flops"], "bytes": cost["bytes"],
            "intensity": cost["intensity"], "achieved_flops": achieved, "achieved_bytes_per_s": cost["bytes"] / t,
            "bound": "memory" if cost["intensity"] < ridge else "compute", "roof_fraction": achieved / roof,
            "tokens_per_s": sum(q_lens) / t, "cost": cost,
        })
    report = {
        "benchmark": "roofline",
        "title": f"{os.path.basename(timer.loaded.path)} ({str(timer.dtype).removeprefix('torch.')}) on "
                 f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch thread(s)",
        "machine": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "platform": platform.platform(),
                    "torch": torch.__version__, "gemm": gemm, "bandwidth": bw, "peak_flops": peak,
                    "bandwidth_bytes_per_s": bandwidth, "ridge_flops_per_byte": ridge},
        "model": {"path": timer.loaded.path, "dtype": str(timer.dtype), "params": timer.arch.num_params,
                  "quantization": config.quantization, "weight_bytes_per_element": weight_elem},
        "steps": steps,
    }
    print(format_table(report))
    if args.save_result:
        os.makedirs(os.path.dirname(os.path.abspath(args.save_result)), exist_ok=True)
        with open(args.save_result, "w") as f:
            json.dump(report, f, indent=1)
        print(f"results: {args.save_result}")
    if args.plot:
        from pagoda.bench.plots import plot_roofline

        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        print(f"plot: {plot_roofline(report, args.plot)}")
    return 0


def format_table(report: dict[str, Any]) -> str:
    m = report["machine"]
    rows = [f"roofs: {m['peak_flops'] / 1e9:.1f} GFLOP/s, {m['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, "
            f"ridge {m['ridge_flops_per_byte']:.1f} FLOP/B",
            "| step | tokens | time ms | tok/s | GFLOP | MB moved | FLOP/B | GFLOP/s | GB/s | bound | % of roof |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in report["steps"]:
        rows.append(f"| {s['name']} | {s['num_tokens']} | {s['time_s'] * 1000:.1f} | {s['tokens_per_s']:.0f} | "
                    f"{s['flops'] / 1e9:.2f} | {s['bytes'] / 1e6:.0f} | {s['intensity']:.1f} | "
                    f"{s['achieved_flops'] / 1e9:.1f} | {s['achieved_bytes_per_s'] / 1e9:.2f} | {s['bound']} | "
                    f"{s['roof_fraction']:.0%} |")
    return "\n".join(rows)
