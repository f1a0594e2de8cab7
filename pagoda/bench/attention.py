"""`pagoda bench attention`: the CPU decode-attention kernel (``paged_decode_attention``, the
one the engine's decode steps run) in bytes of KV read per second, against the machine's
measured read bandwidth, over contexts and batch sizes.

Each sequence gets blocks of its own (distinct, shuffled: nothing is shared, so nothing is
served from a cache another sequence warmed), a KV pool of random values in the chosen
dtype, and one query per sequence. A point keeps as many copies of its pool ("layers") as
make at least ``--sweep-mib``, and one timed call runs the kernel over every copy in turn, as
a decode step walks its layers: the rows then come from memory, as in a served step, and not
from a last-level cache that holds a lone layer's pool between repeated calls (this project's
Xeons have 260-480 MiB of L3: a 16k-token context of the bundled model is 12 MiB). Blocks of
64 tokens by default, as the engine's on the CPU. A point's bytes
are what the kernel must read: every sequence's K and V rows (and an int8 cache's scales), in
every copy; its time the fastest of repeated sweeps (the least disturbed on a shared machine,
as `pagoda bench roofline` takes its roofs).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from pagoda.bench.roofline import _best_time, measure_bandwidth
from pagoda.config.engine import CPU_BLOCK_SIZE

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_attention_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", type=_int_list, default=[1024, 4096, 16384, 32768], metavar="N,N,...",
                   help="tokens of context per sequence")
    p.add_argument("--batches", type=_int_list, default=[1, 4, 16, 64], metavar="B,B,...")
    p.add_argument("--kv-dtype", choices=sorted(_DTYPES), default="float16")
    # The bundled SmolLM2-135M's attention: 9 query heads over 3 KV heads of 64.
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=CPU_BLOCK_SIZE,
                   help=f"tokens per KV block ({CPU_BLOCK_SIZE}: the engine's default on the CPU)")
    p.add_argument("--max-tokens", type=int, default=1 << 21,
                   help="skip points with more context tokens than this in all (their KV pool's memory)")
    # Both well above the largest L3 seen on these machines (480 MiB, an AMX Xeon), where a
    # 512 MiB read would partly come from the cache.
    p.add_argument("--bandwidth-mib", type=int, default=2048, help="buffer size of the read-bandwidth test")
    p.add_argument("--sweep-mib", type=int, default=2048,
                   help="copies of each point's KV pool (layers) that make at least this many MiB, swept in turn "
                        "by one timed call, so the rows come from memory and not from the last-level cache; "
                        "0: one pool, called again and again")
    p.add_argument("--min-time", type=float, default=0.5, help="seconds of repeated calls per point")
    p.add_argument("--arithmetic-only", action="store_true",
                   help="every block-table entry on one block (the rows stay in the L1, no sweep): the kernel's "
                        "arithmetic alone, the time it would take if every read were hidden")
    p.add_argument("--save-result", default=None, metavar="FILE.json")


def time_point(ctx: int, batch: int, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
               block_size: int, min_time: float, seed: int = 0, sweep_bytes: int = 0,
               arithmetic_only: bool = False) -> dict[str, Any]:  # fmt: skip
    from pagoda.ops import cpu_kernels

    ops = cpu_kernels.kernels()
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-ctx // block_size)
    num_blocks = per_seq * batch
    shape = (2, num_blocks, block_size, kv_heads, head_dim)
    if dtype == torch.int8:
        cache = torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)
        scales = torch.rand(2, num_blocks, block_size, kv_heads, generator=gen) / 64
    else:
        cache = torch.randn(shape, generator=gen).to(dtype)
        scales = None
    tables = torch.randperm(num_blocks, generator=gen).view(batch, per_seq).int()
    if arithmetic_only:  # one block's rows, read again and again: the arithmetic alone
        tables.zero_()
        sweep_bytes = 0
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    pool_bytes = cache.nbytes + (scales.nbytes if scales is not None else 0)
    layers = [(cache, scales)] + [(cache.clone(), None if scales is None else scales.clone())
                                  for _ in range(1, max(1, -(-sweep_bytes // pool_bytes)))]

    def sweep() -> None:
        for c, s in layers:
            ops.paged_decode_attention(q, c, tables, lens, scale, s)

    seconds = _best_time(sweep, min_time)
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * cache.element_size()
    if scales is not None:
        kv_bytes += 2 * batch * ctx * kv_heads * 4
    kv_bytes *= len(layers)
    return {"context": ctx, "batch": batch, "layers": len(layers), "seconds": seconds / len(layers),
            "kv_bytes": kv_bytes // len(layers), "bytes_per_s": kv_bytes / seconds}  # fmt: skip


def run_attention_bench(args: argparse.Namespace) -> int:
    from pagoda.ops import cpu_kernels

    if cpu_kernels.kernels() is None:
        print(f"pagoda bench attention: no CPU kernels here ({cpu_kernels.error()})")
        return 1
    dtype = _DTYPES[args.kv_dtype]
    # The read bandwidth before and after the points; the fractions are of the higher. On a
    # shared machine it moves (a Zen 4 VM measured 28-61 GB/s within minutes), so one reading
    # could flatter the kernel or wrong it.
    before = measure_bandwidth(args.bandwidth_mib << 20)["read_bytes_per_s"]
    print(f"read bandwidth before: {before / 1e9:.2f} GB/s ({torch.get_num_threads()} threads); "
          f"KV {args.kv_dtype}, {args.heads} heads over {args.kv_heads} KV heads of {args.head_dim}")
    print(f"{'context':>8} {'batch':>6} {'layers':>6} {'ms/layer':>9} {'GB/s':>7}")
    points = []
    for ctx in args.contexts:
        for batch in args.batches:
            if ctx * batch > args.max_tokens:
                continue
            point = time_point(ctx, batch, dtype, args.heads, args.kv_heads, args.head_dim, args.block_size,
                               args.min_time, sweep_bytes=args.sweep_mib << 20,
                               arithmetic_only=args.arithmetic_only)
            points.append(point)
            print(f"{ctx:>8} {batch:>6} {point['layers']:>6} {point['seconds'] * 1e3:>9.3f} "
                  f"{point['bytes_per_s'] / 1e9:>7.2f}")
    after = measure_bandwidth(args.bandwidth_mib << 20)["read_bytes_per_s"]
    bandwidth = max(before, after)
    print(f"read bandwidth after: {after / 1e9:.2f} GB/s; of the higher, {bandwidth / 1e9:.2f} GB/s:")
    for point in points:
        point["fraction_of_read_bandwidth"] = point["bytes_per_s"] / bandwidth
        print(f"{point['context']:>8} {point['batch']:>6} {point['fraction_of_read_bandwidth']:>6.0%}")
    if args.save_result:
        os.makedirs(os.path.dirname(os.path.abspath(args.save_result)), exist_ok=True)
        with open(args.save_result, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "threads": torch.get_num_threads(),
                       "read_bytes_per_s": bandwidth, "read_bytes_per_s_before": before,
                       "read_bytes_per_s_after": after, "kv_dtype": args.kv_dtype, "sweep_mib": args.sweep_mib,
                       "arithmetic_only": args.arithmetic_only,
                       "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                                 "block_size": args.block_size}, "points": points}, f, indent=1)
        print(f"results: {args.save_result}")
    return 0
