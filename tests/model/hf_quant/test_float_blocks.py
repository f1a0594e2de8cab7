"""pagoda's FP8 and NVFP4 block layouts in the kernels: the dequantized rows are the
formats' reference values bit for bit (e4m3 * float32 scale; e2m1 * (e4m3 / global) as
compressed-tensors computes it), and the products at every step size are float32
products of those weights within float32 rounding."""

from __future__ import annotations

import pytest
import torch

from pagoda.model.hf_quant.float_blocks import (
    FP8_32,
    FP8_128,
    NVFP4_32,
    NVFP4_128,
    ScaleBlocks,
    fp8_weight,
    nvfp4_weight,
)
from pagoda.model.layers.blocks import BlocksLinear, BlockWeight
from pagoda.ops import cpu_kernels

ops = cpu_kernels.kernels()
pytestmark = pytest.mark.skipif(ops is None, reason=f"CPU kernels unavailable: {cpu_kernels.error()}")

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _fp8(rows: int, cols: int, seed: int, blocks: ScaleBlocks, every_byte: bool = False):
    """A random FP8 weight and its reference dequantization: e4m3 -> float32 (torch's
    conversion), times the float32 scale of its block."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
    if every_byte:
        q.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    else:
        q[(q & 0x7F) == 0x7F] = 0x3C   # no NaN in products
    shape = blocks.shape(rows, cols)
    scale = torch.rand(shape, generator=g) * 2.0 ** torch.randint(-12, 4, shape, generator=g)
    w = q.view(torch.float8_e4m3fn)
    full = scale.repeat_interleave(blocks.rows, 0)[:rows].repeat_interleave(blocks.cols, 1)[:, :cols]
    return fp8_weight("w", w, scale, "s", blocks), w.float() * full


def _nvfp4(rows: int, cols: int, seed: int):
    """A random NVFP4 weight and its reference: e2m1 * (e4m3 scale / global scale), the
    quotient in float32, then the product."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = (torch.rand(rows, cols // 16, generator=g) * 448).to(torch.float8_e4m3fn)
    global_scale = torch.tensor([float(torch.rand(1, generator=g)) * 3000 + 1])
    step = (scale.float() / global_scale).repeat_interleave(16, 1)
    return nvfp4_weight("w", packed, scale, global_scale, "s", "g"), E2M1[codes.long()] * step


CASES = {
    "FP8_128-blocks": (FP8_128, lambda r, c, s: _fp8(r, c, s, ScaleBlocks(128, 128))),
    "FP8_128-tensor": (FP8_128, lambda r, c, s: _fp8(r, c, s, ScaleBlocks(r, c))),
    "FP8_32-channel": (FP8_32, lambda r, c, s: _fp8(r, c + 32, s, ScaleBlocks(1, c + 32))),
    "FP8_32-group32": (FP8_32, lambda r, c, s: _fp8(r, c, s, ScaleBlocks(1, 32))),
    "NVFP4_128": (NVFP4_128, lambda r, c, s: _nvfp4(r, c, s)),
    "NVFP4_32": (NVFP4_32, lambda r, c, s: _nvfp4(r, c + 32, s)),
}


def _close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within float32 rounding of the float64 product (~K eps |x| |w|)."""
    exact = x.double() @ w.double().T
    bound = x.abs().double() @ w.abs().double().T
    tol = 4 * x.shape[1] ** 0.5 * torch.finfo(torch.float32).eps * bound + 1e-30
    assert y.dtype == torch.float32
    assert bool(((y.double() - exact).abs() <= tol).all()), (y.double() - exact).abs().max()


@pytest.mark.parametrize("case", sorted(CASES))
def test_dequantize_is_the_reference_bit_for_bit(case):
    own_type, make = CASES[case]
    w, ref = make(37, 256, 1)
    assert w.ggml_type is own_type
    got = w.dequantize()
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32)) or torch.equal(got, ref)
    rows = torch.tensor([36, 0, 5, 5])
    assert torch.equal(w.dequantize(rows), ref[rows])


def test_every_e4m3_value_and_nan():
    w, ref = _fp8(4, 256, 2, ScaleBlocks(4, 256), every_byte=True)
    got = w.dequantize()
    assert torch.equal(got.isnan(), ref.isnan()) and got[0, 0x7F].isnan() and got[0, 0xFF].isnan()
    assert torch.equal(got.nan_to_num(0.0).view(torch.int32), ref.nan_to_num(0.0).view(torch.int32))


@pytest.mark.parametrize("case", sorted(CASES))
def test_linear_equals_float_products_at_every_step_size(case):
    _, make = CASES[case]
    w, ref = make(45, 256, 3)
    layer = BlocksLinear([w])
    g = torch.Generator().manual_seed(4)
    for rows in (1, 2, 3, 4, 5, 7, 16, 17, 33, 64, 130, 300):
        x = torch.randn(rows, w.in_features, generator=g)
        y = layer(x)
        assert y.shape == (rows, 45)
        _close(y, x, ref)


def test_stacked_float_formats_with_bias():
    """A q/k/v projection whose parts are FP8 blocks, NVFP4 and float32."""
    a, ra = _fp8(24, 256, 5, ScaleBlocks(128, 128))
    b, rb = _nvfp4(8, 256, 6)
    c = torch.randn(8, 256)
    bias = torch.randn(40)
    layer = BlocksLinear([a, b, BlockWeight.from_tensor(c)], bias)
    ref = torch.cat([ra, rb, c])
    for rows in (1, 4, 9, 40):
        x = torch.randn(rows, 256)
        _close(layer(x) - bias, x, ref)
    assert torch.equal(layer.dequantized(), ref)


def _quantized_x(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    g = x.reshape(x.shape[0], -1, group)
    d = g.abs().amax(-1, keepdim=True) / 127
    return (torch.round(g / torch.where(d > 0, d, torch.ones_like(d))) * d).reshape(x.shape)


@pytest.mark.parametrize("case", ["NVFP4_128", "NVFP4_32"])
def test_nvfp4_int8_products_are_the_products_with_quantized_activations(case):
    w, ref = CASES[case][1](21, 256, 7)
    layer = BlocksLinear([w])
    layer.int8_activations = True
    x = torch.randn(300, w.in_features, generator=torch.Generator().manual_seed(8))
    y = layer(x)
    _close(y, _quantized_x(x), ref)
    for rows in (1, 3, 17, 65):
        assert torch.equal(layer(x[:rows]), y[:rows])


def test_fp8_has_no_int8_product():
    w, _ = _fp8(8, 128, 9, ScaleBlocks(1, 128))
    with pytest.raises(RuntimeError, match="quantized blocks"):
        ops.gguf_linear_int8(torch.randn(2, 128), [w.data], [int(w.ggml_type)], None)


def test_moe_experts_in_fp8_compute_their_dequantized_experts():
    """The exact mode's MoE kernel (Qwen3-MoE FP8 checkpoints: one FP8 weight per expert)."""
    experts, hidden, inter = 3, 128, 64
    gate_up, gate_up_ref, down, down_ref = [], [], [], []
    for e in range(experts):
        for k in range(2):
            w, r = _fp8(inter, hidden, 10 + 2 * e + k, ScaleBlocks(128, 128))
            gate_up.append(w)
            gate_up_ref.append(r)
        w, r = _nvfp4(hidden, inter, 20 + e) if e == 1 else _fp8(hidden, inter, 20 + e, ScaleBlocks(128, 128))
        down.append(w)
        down_ref.append(r)
    for tokens in (1, 5, 40):
        x = torch.randn(tokens, hidden)
        ids = torch.randint(0, experts, (tokens, 2))
        ids[:, 1] = (ids[:, 0] + 1) % experts
        weights = torch.rand(tokens, 2)
        y = ops.gguf_moe(x, ids, weights, [w.data for w in gate_up], [int(w.ggml_type) for w in gate_up],
                         [w.data for w in down], [int(w.ggml_type) for w in down])
        ref = torch.zeros(tokens, hidden, dtype=torch.float64)
        for t in range(tokens):
            for j in range(2):
                e = int(ids[t, j])
                g = x[t].double() @ gate_up_ref[2 * e].double().T
                u = x[t].double() @ gate_up_ref[2 * e + 1].double().T
                ref[t] += weights[t, j] * ((torch.nn.functional.silu(g) * u) @ down_ref[e].double().T)
        assert torch.allclose(y.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
