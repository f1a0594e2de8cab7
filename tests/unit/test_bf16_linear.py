"""The CPU's bf16 mode (``--dtype bfloat16``): Bf16Linear's products on oneDNN."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from pagoda.config import EngineConfig
from pagoda.model.layers.quantization import Bf16Linear, bf16_gemm_path
from pagoda.ops import cpu_kernels


def _linear(n, k, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin


@pytest.mark.parametrize("n,k,bias", [(1536, 576, False), (576, 1536, True), (200, 96, False)])
def test_equals_the_product_of_the_rounded_operands(n, k, bias):
    """bfloat16 weights x bfloat16 activations: each product is exact in float32, so the
    float32 sum of the rounded operands is the reference; the layer's output is that sum
    rounded to bfloat16 (within one bfloat16 step of it: the sums' order differs)."""
    lin = _linear(n, k, bias)
    layer = Bf16Linear(lin)
    x = torch.randn(37, k)
    ref = (x.bfloat16().double() @ lin.weight.detach().bfloat16().double().t())
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (37, n)
    if bias:
        got = got - lin.bias.detach()
    # bfloat16 keeps 8 significant bits: one rounding of the result is 2**-8 relative.
    err = (got.double() - ref).abs()
    assert (err <= ref.abs() * 2**-7 + 1e-6).all(), float(err.max())
    # ... and far from the float32 product of the unrounded operands only by bf16 rounding.
    exact = x.double() @ lin.weight.detach().double().t()
    assert float((got.double() - exact).abs().max()) < 0.05 * float(exact.abs().max())


def test_a_row_gets_the_same_numbers_whatever_the_step_size():
    if bf16_gemm_path() != "onednn":
        pytest.skip("the oneDNN path (bf16 units); the others in test_every_path_gives_the_rounded_product")
    lin = _linear(1536, 576, bias=True)
    layer = Bf16Linear(lin)
    x = torch.randn(512, 576, generator=torch.Generator().manual_seed(2))
    full = layer(x)
    assert layer(x[:0]).shape == (0, 1536)
    if cpu_kernels.onednn_units("bf16") == "AMX bf16 tiles":
        # With AMX, oneDNN runs steps of up to 32 rows and longer ones on two kernels, each
        # the same at every step size (one row included), the two a bfloat16 rounding apart
        # in a few elements (measured on a 2-vCPU AMX Xeon: 1-3 of 1536 x m; padding small
        # steps to 33 rows cost 1.7x at one row, cutting large ones into 32s 1.5-2.8x).
        small = layer(x[:32])
        for m in (1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31):
            assert torch.equal(layer(x[:m]), small[:m]), m
        for m in (33, 64, 100, 128, 255, 256, 511):
            assert torch.equal(layer(x[:m]), full[:m]), m
        assert (small - full[:32]).abs().le(full[:32].abs() * 2**-7 + 1e-6).all()
        return
    for m in (2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 64, 100, 128, 255, 256, 511):
        assert torch.equal(layer(x[:m]), full[:m]), m
    # One row (oneDNN's matrix-vector kernel) may round its bfloat16 sum the other way:
    # within one bfloat16 step (measured: 6 of 100 random 576 x 1536 cases differ).
    for i in (0, 300):
        assert (layer(x[i:i + 1]) - full[i:i + 1]).abs().le(full[i:i + 1].abs() * 2**-7 + 1e-6).all()


def test_the_path_follows_the_cpu():
    layer = Bf16Linear(_linear(64, 32))
    assert layer.path == bf16_gemm_path() and f"on {layer.path}" in repr(layer)
    flags = cpu_kernels.cpu_flags()
    if flags & {"avx512_bf16", "amx_bf16"} and "ONEDNN_MAX_CPU_ISA" not in os.environ:
        assert layer.path == "onednn" and layer.weight.is_mkldnn
    elif cpu_kernels.kernels() is not None:
        assert layer.path == "pagoda"


@pytest.mark.parametrize("path", ["onednn", "pagoda", "torch"])
def test_every_path_gives_the_rounded_product(path):
    if path == "onednn" and bf16_gemm_path() != "onednn":
        pytest.skip("no bf16 units here")
    if path == "pagoda" and cpu_kernels.kernels() is None:
        pytest.skip("pagoda's kernels unavailable")
    lin = _linear(576, 1536, bias=True)
    layer = Bf16Linear(lin, path=path)
    x = torch.randn(40, 1536, generator=torch.Generator().manual_seed(3))
    ref = x.bfloat16().double() @ lin.weight.detach().bfloat16().double().t()
    got = layer(x).double()
    # The sum is rounded to bfloat16, then the bias added in float32.
    assert ((got - lin.bias.detach().double() - ref).abs() <= ref.abs() * 2**-7 + 1e-5).all()
    # A row's numbers whatever the step size: oneDNN's for every size from two rows (one
    # row: test_a_row_gets_the_same_numbers_whatever_the_step_size), pagoda's within
    # decode-sized steps (up to 16 rows; BLAS above, as in the exact mode).
    sizes = {"onednn": (2, 5, 16, 17, 39), "pagoda": (1, 2, 5, 16), "torch": ()}[path]
    full = layer(x) if path == "onednn" else layer(x[:16])
    assert all(torch.equal(layer(x[:m]), full[:m]) for m in sizes)


def test_dtype_bfloat16_on_cpu_is_the_bf16_mode():
    c = EngineConfig(dtype="bfloat16")
    assert (c.quantization, c.dtype) == ("bf16", "float32")
    assert c.resolved_kv_cache_dtype == "float16"
    assert EngineConfig(quantization="bf16").quantization == "bf16"
    with pytest.raises(ValueError, match="cannot be combined with --quantization int8"):
        EngineConfig(dtype="bf16", quantization="int8")
    with pytest.raises(ValueError, match="on a GPU use --dtype bfloat16"):
        EngineConfig(quantization="bf16", dtype="float16")


@pytest.mark.parametrize("isa", ["AVX2", "AVX512_CORE", "AVX512_CORE_BF16"])
def test_forced_isa_keeps_the_numbers_close_and_row_invariant(isa):
    """oneDNN picks its bf16 kernels by the CPU at run time; capped at an ISA without bf16
    units (ONEDNN_MAX_CPU_ISA, read at its first use: a fresh interpreter), the products
    are the same within bf16 rounding and still independent of the step size."""
    code = (
        "import torch\n"
        "from tests.unit.test_bf16_linear import _linear\n"
        "from pagoda.model.layers.quantization import Bf16Linear\n"
        "lin = _linear(1536, 576)\n"
        "layer = Bf16Linear(lin)\n"
        "x = torch.randn(200, 576, generator=torch.Generator().manual_seed(1))\n"
        "full = layer(x)\n"
        "base = full if layer.path == 'onednn' else layer(x[:16])\n"
        "sizes = (1, 3, 16, 17, 64) if layer.path == 'onednn' else (1, 3, 16)\n"
        "assert all(torch.equal(layer(x[:m]), base[:m]) for m in sizes)\n"
        "print(layer.path)\n"
        "ref = x.bfloat16().double() @ lin.weight.detach().bfloat16().double().t()\n"
        "assert ((full.double() - ref).abs() <= ref.abs() * 2**-7 + 1e-6).all()\n"
        "print('ok')\n"
    )
    flags = cpu_kernels.cpu_flags()
    if isa == "AVX512_CORE_BF16" and not flags & {"avx512_bf16", "amx_bf16"}:
        pytest.skip("no bf16 units here")
    if isa.startswith("AVX512") and "avx512bw" not in flags:
        pytest.skip("no AVX-512 here")
    expected = "onednn" if isa == "AVX512_CORE_BF16" else "pagoda"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa, "PAGODA_CPU_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0 and out.stdout.split() == [expected, "ok"], out.stderr[-2000:]


def test_units_named_from_the_cpu_flags(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512_bf16", "avx512_vnni"}))
    monkeypatch.setattr(cpu_kernels, "amx_permitted", lambda: None)
    assert cpu_kernels.onednn_units("bf16") == "AVX512_BF16 dot products"
    assert cpu_kernels.onednn_units("int8") == "VNNI dot products"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_kernels.onednn_units("bf16").startswith("float32 FMA")
    assert cpu_kernels.onednn_units("int8") == "AVX2 integer multiply-adds"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx2", "amx_tile", "amx_bf16", "amx_int8"}))
    monkeypatch.setattr(cpu_kernels, "amx_permitted", lambda: True)
    assert cpu_kernels.onednn_units("bf16") == "AMX bf16 tiles"
    assert cpu_kernels.onednn_units("int8") == "AMX int8 tiles"


def test_amx_permission_asked_only_where_the_cpu_has_amx():
    flags = cpu_kernels.cpu_flags()
    got = cpu_kernels.amx_permitted()
    if {"amx_tile", "amx_bf16"} <= flags:
        assert got is True  # Linux >= 5.16 grants it to any process that asks
    else:
        assert got is None
