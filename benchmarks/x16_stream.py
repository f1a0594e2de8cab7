"""Read bandwidth of the gguf mode's repacked K-quant products at a few rows (issue #49).

A 16-stream MoE decode step multiplies each active expert's weights by the 1-4 tokens routed
to it: the weights stream from memory once, the products are few. This measures that case
alone: one repacked Q4_K or Q6_K part far larger than the caches (``--mb``), multiplied by
1, 2 and 4 rows in a loop, in GB/s of weights, beside the same part in L2 (what the products
cost when memory is not the limit) and a torch sum over the same number of bytes (what the
machine reads). Needs an AVX-512 VNNI CPU (the repacked layout's kernels).

    python benchmarks/x16_stream.py --type Q4_K --k 2048
    python benchmarks/x16_stream.py --type Q6_K --k 512
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pagoda.bench.gguf_files import random_blocks
from pagoda.model.layers.blocks import LANES_TYPES
from pagoda.ops import cpu_kernels

REPACKED = {t.name: int(LANES_TYPES[t]) for t in LANES_TYPES}   # Q4_K -> Q4_K_X16's code, ...


def gbps(ops, x: torch.Tensor, packed: torch.Tensor, code: int, reps: int) -> float:
    ops.gguf_linear_int8(x, [packed], [code], None)
    t = time.perf_counter()
    for _ in range(reps):
        ops.gguf_linear_int8(x, [packed], [code], None)
    return packed.numel() * reps / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", choices=sorted(REPACKED), default="Q4_K")
    ap.add_argument("--k", type=int, default=2048, help="inputs per channel (a multiple of 256)")
    ap.add_argument("--mb", type=int, default=300, help="size of the streamed part, MB")
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ops = cpu_kernels.kernels()
    qtype = GGMLQuantizationType[args.type]
    one = ops.gguf_repack_x16(torch.from_numpy(random_blocks(qtype, 2048, args.k, np.random.default_rng(0),
                                                             reference_quantizer=False)), qtype.value, args.k)
    big = one.repeat(max(1, args.mb * 10**6 // one.numel()), 1)
    flat = torch.ones(big.numel() // 4)
    print(f"{args.type}, K = {args.k}: {big.numel() / 1e6:.0f} MB streamed, {one.numel() / 1e6:.1f} MB in L2; "
          f"{torch.get_num_threads()} threads; median of {args.rounds} rounds")
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, args.k)
        far = [gbps(ops, x, big, REPACKED[args.type], 5) for _ in range(args.rounds)]
        near = [gbps(ops, x, one, REPACKED[args.type], 500) for _ in range(args.rounds)]
        print(f"  {m} row(s): {statistics.median(far):5.1f} GB/s from memory, {statistics.median(near):5.1f} GB/s from L2")
    sums = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        for _ in range(5):
            flat.sum()
        sums.append(flat.numel() * 4 * 5 / (time.perf_counter() - t) / 1e9)
    print(f"  torch sum of the same bytes: {statistics.median(sums):5.1f} GB/s")


if __name__ == "__main__":
    main()
