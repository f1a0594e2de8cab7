"""Compile pagoda's Triton kernels for GPU targets on a machine without a GPU (run by
tests/unit/test_triton_gpu_compile.py in a process without TRITON_INTERPRET).

The launchers run on CPU tensors with every kernel launch intercepted; each distinct launch
(kernel, argument types, constexprs, warps) is then compiled by Triton's own compiler, down
to a cubin with the ptxas Triton ships, for the targets named on the command line (sm_90:
H100 / H200). The interpreter the other tests use accepts programs the compiler refuses
(types, layouts, unsupported ops); this catches those before a GPU is at hand.

    python -m tests.unit.triton_gpu_compile 90 80
    python -m tests.unit.triton_gpu_compile 90 --regs    # and each kernel's registers and spills
"""

from __future__ import annotations

import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("run without TRITON_INTERPRET=1: the kernels must be defined for the compiler")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8",
          torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
_OPTIONS = ("num_warps", "num_stages")


def intercept() -> list[tuple[JITFunction, tuple, dict]]:
    """Make every ``kernel[grid](...)`` record its arguments instead of launching."""
    launches: list[tuple[JITFunction, tuple, dict]] = []

    def getitem(self, grid):
        return lambda *args, **kwargs: launches.append((self, args, dict(kwargs)))

    JITFunction.__getitem__ = getitem
    return launches


def signature(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """(Triton signature, constexprs, compile options) of one recorded launch."""
    options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
    values = dict(zip(fn.arg_names, args)) | kwargs
    sig, consts = {}, {}
    for i, name in enumerate(fn.arg_names):
        value = values[name]
        if i in fn.constexprs:
            sig[name], consts[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}.{name}: an argument of type {type(value).__name__}")
    return sig, consts, options


def run_launchers() -> None:
    """Every launcher over the variants the engine uses: float32 / float16 / bfloat16 caches,
    int8 and fp8 ones, windows, soft-caps, sinks, split-KV, GQA ratios, head sizes."""
    from pagoda.ops import triton_attention as ta
    from pagoda.ops import triton_elementwise as te

    te._require = lambda *tensors: None   # (it refuses CPU tensors outside the interpreter)
    bt = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 7], dtype=torch.int32)
    slots = torch.tensor([0, -1, 5], dtype=torch.int64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        # (head shapes: Llama's, MHA, Phi's 80-dim heads with G = 3, Gemma's 256; bfloat16 all)
        shapes = ((32, 8, 128), (8, 8, 64), (12, 4, 80), (8, 2, 256)) if dtype == torch.bfloat16 else ((32, 8, 128),)
        for heads, kv_heads, d in shapes:
            q = torch.zeros(2, heads, d, dtype=dtype)
            cache = torch.zeros(2, 4, 16, kv_heads, d, dtype=dtype)
            ta.paged_decode(q, cache, bt, lens, 0.1)
            ta.paged_decode(q, cache, bt, lens, 0.1, num_splits=4, window=16, softcap=30.0,
                            sinks=torch.zeros(heads))
            ta.paged_extend(torch.zeros(7, heads, d, dtype=dtype), cache, bt, qsl, lens, 0.1, max_query_len=4)
            ta.paged_extend(torch.zeros(7, heads, d, dtype=dtype), cache, bt, qsl, lens, 0.1, max_query_len=4,
                            window=16, softcap=30.0, sinks=torch.zeros(heads))
            kv = torch.zeros(3, kv_heads, d, dtype=dtype)
            ta.store_kv(kv, kv, cache, slots)
        for raw in (torch.int8, torch.uint8) if dtype == torch.bfloat16 else ():   # int8, fp8 e4m3 as bytes
            cache = torch.zeros(2, 4, 16, 8, 128, dtype=raw)
            scales = torch.zeros(2, 4, 16, 8)
            q = torch.zeros(2, 32, 128, dtype=dtype)
            ta.paged_decode(q, cache, bt, lens, 0.1, scales=scales, num_splits=2)
            ta.paged_extend(torch.zeros(7, 32, 128, dtype=dtype), cache, bt, qsl, lens, 0.1, max_query_len=4,
                            scales=scales)
            kv = torch.zeros(3, 8, 128, dtype=dtype)
            ta.store_kv(kv, kv, cache, slots, scales)
        if dtype == torch.float32:
            continue   # (the layers' fused ops run on CUDA for the half-precision models)
        x = torch.zeros(4, 2048, dtype=dtype)
        te.rms_norm(x, torch.zeros(2048, dtype=dtype), 1e-6)
        te.rms_norm(x, torch.zeros(2048, dtype=dtype), 1e-6, torch.zeros_like(x))
        qkv = torch.zeros(4, (32 + 16) * 64, dtype=dtype).view(4, 48, 64)
        te.rope(qkv[:, :32], qkv[:, 32:40], torch.zeros(4, 64, dtype=dtype), torch.zeros(4, 64, dtype=dtype))
        te.silu_mul(torch.zeros(4, 2 * 8192, dtype=dtype))
        te.gelu_tanh_mul(torch.zeros(4, 2 * 1100, dtype=dtype))


def ptxas_info(ptx: str, arch: int) -> str:
    """ptxas's register and spill report of one kernel (the ptxas Triton ships)."""
    import subprocess
    import tempfile

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([ptxas, "-v", "--gpu-name", f"sm_{arch}a" if arch >= 90 else f"sm_{arch}", f.name,
                        "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    lines = [line.split(":", 1)[-1].strip() for line in r.stderr.splitlines() if "registers" in line or "spill" in line]
    return "; ".join(lines)


def main(archs: list[int], regs: bool = False) -> int:
    launches = intercept()
    run_launchers()
    seen = set()
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for fn, args, kwargs in launches:
            sig, consts, options = signature(fn, args, dict(kwargs))
            key = (arch, fn.__name__, tuple(sig.items()), tuple((k, str(v)) for k, v in consts.items()),
                   tuple(options.items()))
            if key in seen:
                continue
            seen.add(key)
            start = time.perf_counter()
            compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                                      options=options)
            print(f"sm_{arch} {fn.__name__} {consts} {options}: {len(compiled.asm['cubin'])} bytes "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
            if regs:
                print(f"    {ptxas_info(compiled.asm['ptx'], arch)}", flush=True)
    print(f"compiled {len(seen)} kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:] if a.isdigit()] or [90], "--regs" in sys.argv))
