"""Exact mode's BlocksLinear: float32 products with weights read from GGUF Q4_1 / Q8_0
blocks must equal the float32 linear layer on the dequantized weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.model.layers import quantization as qz
from pagoda.model.layers.quantization import (BlocksLinear, exact_blocks, pack_exact_blocks, q4_dequantize,
                                              q8_0_dequantize)
from pagoda.ops import cpu_kernels

ops = cpu_kernels.kernels()
needs_kernels = pytest.mark.skipif(ops is None, reason=f"CPU kernels unavailable: {cpu_kernels.error()}")


def _q4_1_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A float32 weight as a Q4_1 GGUF tensor dequantizes to: random 4-bit values, fp16
    scales and minimums."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    # Q4_1 maps each group's minimum to 0 and its maximum to 15.
    packed[:, ::16] &= 0xF0
    packed[:, 1::16] |= 0x0F
    scales = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4).half()
    mins = (-torch.rand(n, k // 32, generator=g) * 0.08).half()
    return q4_dequantize(packed, scales, mins)


def _q8_0_weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    q[:, ::32] = 127  # ggml's Q8_0 maps each group's largest |w| to +-127
    scales = (torch.rand(n, k // 32, generator=g) * 0.001 + 1e-5).half()
    return q8_0_dequantize(q, scales)


def test_exact_blocks_rebuilds_gguf_weights_bit_for_bit():
    w4 = _q4_1_weight(40, 96, 0)
    packed, scales, mins = exact_blocks(w4)
    assert mins is not None and torch.equal(q4_dequantize(packed, scales, mins), w4)
    w8 = _q8_0_weight(40, 96, 1)
    q, scales, mins = exact_blocks(w8)
    assert mins is None and q.dtype == torch.int8 and torch.equal(q8_0_dequantize(q, scales), w8)
    # A float checkpoint's weights are no such blocks: they stay as they are.
    assert exact_blocks(torch.randn(40, 96)) is None
    assert exact_blocks(torch.randn(40, 90)) is None  # rows not in groups of 32


@needs_kernels
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 70])
@pytest.mark.parametrize("out_features", [96, 100])  # 100: output channels not in threes
def test_blocks_linear_equals_the_float32_linear(fmt, rows, out_features):
    w = (_q4_1_weight if fmt == "q4_1" else _q8_0_weight)(out_features, 128, rows)
    qweight, scales, mins = exact_blocks(w)
    torch.manual_seed(rows)
    x = torch.randn(rows, 128)
    bias = torch.randn(out_features)
    y = ops.blocks_linear(x, qweight, scales, mins, bias)
    ref = F.linear(x.double(), w.double(), bias.double()).float()
    # float32 sums in another order than BLAS's: a few ulps of the sum's terms.
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # A row's result does not depend on how many rows share the call.
    for i in (0, rows // 2, rows - 1):
        assert torch.equal(ops.blocks_linear(x[i:i + 1], qweight, scales, mins, bias)[0], y[i])


@needs_kernels
def test_blocks_linear_checks_its_inputs():
    qweight, scales, mins = exact_blocks(_q4_1_weight(8, 64, 2))
    with pytest.raises(RuntimeError, match="bytes per row"):
        ops.blocks_linear(torch.randn(2, 96), qweight, scales, mins, None)
    with pytest.raises(RuntimeError, match="float32"):
        ops.blocks_linear(torch.randn(2, 64, dtype=torch.float64), qweight, scales, mins, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.blocks_linear(torch.randn(2, 64), qweight, scales, mins, torch.randn(9))
    with pytest.raises(RuntimeError, match="Q8_0 qweight must be"):
        ops.blocks_linear(torch.randn(2, 64), qweight, scales, None, None)  # Q4_1 bytes without mins


@needs_kernels
def test_blocks_linear_layer_uses_blas_above_its_row_limit(monkeypatch):
    lin = torch.nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(_q4_1_weight(48, 64, 3))
    layer = BlocksLinear(lin, exact_blocks(lin.weight.detach()))
    assert layer.weight is lin.weight  # shared, not copied (a tied LM head stays tied)
    monkeypatch.setattr(qz, "BLOCKS_MAX_ROWS", 4)
    calls = []
    real = ops.blocks_linear
    monkeypatch.setattr(layer, "_ops", type("Ops", (), {"blocks_linear": staticmethod(
        lambda *a: calls.append(a[0].shape[0]) or real(*a))})())
    x = torch.randn(2, 3, 64)  # 6 rows > 4: BLAS
    with torch.no_grad():
        torch.testing.assert_close(layer(x), lin(x), rtol=1e-5, atol=1e-5)
        assert calls == []
        torch.testing.assert_close(layer(x[0]), lin(x[0]), rtol=1e-5, atol=1e-5)
    assert calls == [3]


@needs_kernels
def test_pack_exact_blocks_replaces_only_layers_it_can_rebuild():
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 64, bias=False),
                                torch.nn.Linear(64, 32, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(_q4_1_weight(96, 64, 4))
        model[1].weight.copy_(_q8_0_weight(64, 96, 5))  # model[2] keeps float weights
    x = torch.randn(5, 64)
    with torch.no_grad():
        before = model(x)
        assert pack_exact_blocks(model) == 2
        after = model(x)
    assert isinstance(model[0], BlocksLinear) and model[0].format == "Q4_1"
    assert isinstance(model[1], BlocksLinear) and model[1].format == "Q8_0"
    assert type(model[2]) is torch.nn.Linear
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
