"""One product per GGUF block type, the exact mode's kernel against the gguf mode's.

What `--quantization auto` rests on (pagoda/model/auto_mode.py, GGUF_MODE_TYPES): for each
type, a part of about ``--mb`` MB (far larger than the caches, so its bytes come from memory
as a model's do) multiplied by 1, 2 and 16 rows of activations, in the exact mode
(`gguf_linear`: float32 products from the blocks) and in the gguf mode (`gguf_linear_int8`:
int8 activations; Q4_K and Q6_K repacked to 16 channels a group first where the CPU has
AVX-512 VNNI, as the engine does). Prints the milliseconds of each and their ratio
(> 1: the gguf mode is the faster). Random blocks: the speed does not depend on the values.

    python benchmarks/gguf_modes.py
    PAGODA_CPU_ISA=avx2 python benchmarks/gguf_modes.py --types Q4_K,Q6_K,Q8_0,Q4_0
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

TYPES = "Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_NL,IQ4_XS,MXFP4"


def ms(fn, x: torch.Tensor, part: torch.Tensor, code: int, reps: int) -> float:
    fn(x, [part], [code], None)
    start = time.perf_counter()
    for _ in range(reps):
        fn(x, [part], [code], None)
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--k", type=int, default=2048, help="inputs per channel (a multiple of 256)")
    ap.add_argument("--mb", type=int, default=200, help="size of each part, MB")
    ap.add_argument("--rows", default="1,2,16")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ops = cpu_kernels.kernels()
    if ops is None:
        raise SystemExit(f"pagoda's CPU kernels are not available: {cpu_kernels.error()}")
    repack = cpu_kernels.has_avx512_vnni()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"K = {args.k}, ~{args.mb} MB a part, {torch.get_num_threads()} threads, median of {args.rounds}; "
          f"exact / gguf ms (ratio > 1: gguf faster); Q4_K / Q6_K repacked: {repack}")
    for name in args.types.split(","):
        qtype = GGMLQuantizationType[name]
        one = torch.from_numpy(random_blocks(qtype, 2048, args.k, np.random.default_rng(0), reference_quantizer=False))
        part = one.repeat(max(1, args.mb * 10**6 // one.numel()), 1)
        int8_part, int8_code = part, qtype.value
        if repack and qtype in LANES_TYPES:
            int8_part, int8_code = ops.gguf_repack_x16(part, qtype.value, args.k), int(LANES_TYPES[qtype])
        cells = []
        for m in rows:
            x = torch.randn(m, args.k)
            exact = statistics.median(ms(ops.gguf_linear, x, part, qtype.value, 3) for _ in range(args.rounds))
            gguf = statistics.median(ms(ops.gguf_linear_int8, x, int8_part, int8_code, 3) for _ in range(args.rounds))
            cells.append(f"{m} row(s) {exact:6.1f} / {gguf:6.1f} ({exact / gguf:4.2f}x)")
        print(f"{name:7s} {part.numel() / 1e6:4.0f} MB | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
