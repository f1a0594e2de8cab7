"""pagoda's integer-group blocks (PAGODA_Q4Z / Q8Z, float16 or float32 scales: GPTQ, AWQ,
compressed-tensors): dequantized bit for bit to float32(scale) * (q - zero), products
within float32 rounding of the float64 products at every step size, the gguf mode's
int8 products those with the quantized activations, and input orders (act order)
applied to x."""

from __future__ import annotations

import pytest
import torch

from pagoda.model.hf_quant.int_groups import group_blocks
from pagoda.model.layers.blocks import BlocksLinear, BlockWeight
from pagoda.ops import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="needs pagoda's CPU kernels")

LAYOUTS = {  # name: (bits, scale dtype)
    "PAGODA_Q4Z": (4, torch.float16), "PAGODA_Q8Z": (8, torch.float16),
    "PAGODA_Q4ZF": (4, torch.float32), "PAGODA_Q8ZF": (8, torch.float32),
}


def _weight(name: str, out: int, inf: int, group: int, seed: int, order: torch.Tensor | None = None):
    bits, dtype = LAYOUTS[name]
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2 ** bits, (out, inf), generator=g)
    zeros = torch.randint(0, 2 ** bits + 1, (out, inf // group), generator=g)   # up to 2^bits: GPTQ v1's wrap
    scales = (torch.rand(out, inf // group, generator=g) * 0.02 + 1e-3).to(dtype)
    if dtype == torch.float32:   # scales a float16 cannot hold
        scales = scales * (1 + 2 ** -20)
    blocks = torch.arange(inf // 32) * 32 // group
    w = group_blocks("t", lambda a, b: q[a:b], out, inf, bits, scales, zeros, blocks, order)
    cols = torch.arange(inf) // group   # the group of each column in the blocks' order
    qb = q if order is None else q[:, order]
    ref = scales.float()[:, cols] * (qb - zeros[:, cols]).float()
    if order is not None:   # back to the inputs' order
        ref = torch.empty_like(ref).index_copy_(1, order, ref)
    assert w.ggml_type.name == name
    return w, ref, (qb, zeros[:, cols], scales.float()[:, cols])


def _close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    bound = x.abs().double() @ w.abs().double().T
    tol = 4 * x.shape[1] ** 0.5 * torch.finfo(torch.float32).eps * bound + 1e-30
    assert bool(((y.double() - exact).abs() <= tol).all()), (y.double() - exact).abs().max()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dequantize_is_float32_scale_times_the_integer_difference_bit_for_bit(name):
    w, ref, (q, z, d) = _weight(name, 19, 256, 64, seed=1)
    assert torch.equal(w.dequantize(), ref)
    rows = torch.tensor([18, 0, 7, 7])
    assert torch.equal(w.dequantize(rows), ref[rows])
    # Does the order of the roundings matter? With float16 scales (11 significant bits) and
    # q, z of at most 9 bits every product is exact in float32, so d * q - d * z gives the
    # same values; with float32 scales it rounds twice and differs.
    two_roundings = d * q.float() + (-(d * z.float()))
    assert torch.equal(two_roundings, ref) == (LAYOUTS[name][1] == torch.float16)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_products_at_every_step_size(name):
    w, ref, _ = _weight(name, 45, 256, 32, seed=2)
    layer = BlocksLinear([w])
    g = torch.Generator().manual_seed(3)
    for rows in (1, 2, 3, 4, 5, 7, 16, 17, 33, 64, 130, 300):
        x = torch.randn(rows, 256, generator=g)
        _close(layer(x), x, ref)


def _quantized_x(x: torch.Tensor) -> torch.Tensor:
    g = x.reshape(x.shape[0], -1, 32)
    d = g.abs().amax(-1, keepdim=True) / 127
    return (torch.round(g / torch.where(d > 0, d, torch.ones_like(d))) * d).reshape(x.shape)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gguf_mode_is_the_product_with_int8_activations(name):
    w, ref, _ = _weight(name, 21, 512, 128, seed=4)
    layer = BlocksLinear([w])
    layer.int8_activations = True
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(5))
    y = layer(x)
    _close(y, _quantized_x(x), ref)
    for rows in (1, 2, 3, 17, 65):   # 1-2 rows: straight from the blocks (int8_dot32)
        assert torch.equal(layer(x[:rows]), y[:rows])


def test_input_orders_permute_x_per_part():
    """Act-order parts: one shared order permutes x once; parts in different orders (and a
    part in input order) multiply one at a time; the bias is added once."""
    g = torch.Generator().manual_seed(6)
    o1, o2 = torch.randperm(128, generator=g), torch.randperm(128, generator=g)
    a, ra, _ = _weight("PAGODA_Q4Z", 24, 128, 32, seed=7, order=o1)
    b, rb, _ = _weight("PAGODA_Q4Z", 8, 128, 32, seed=8, order=o1)
    c, rc, _ = _weight("PAGODA_Q8Z", 8, 128, 64, seed=9, order=o2)
    d, rd, _ = _weight("PAGODA_Q4Z", 8, 128, 32, seed=10)
    bias = torch.randn(48, generator=g)
    x = torch.randn(6, 128, generator=g)
    shared = BlocksLinear([a, b])
    assert shared.permutes_inputs and not shared._split_orders
    _close(shared(x), x, torch.cat([ra, rb]))
    mixed = BlocksLinear([a, c, d], bias[:40])
    assert mixed._split_orders
    _close(mixed(x), x, torch.cat([ra, rc, rd]), bias[:40])
    assert torch.equal(mixed.dequantized(), torch.cat([ra, rc, rd]))
    mixed.int8_activations = True
    y = mixed(x)
    assert (y - (x @ torch.cat([ra, rc, rd]).T + bias[:40])).norm() < 0.02 * y.norm()
    with pytest.raises(ValueError, match="permutation"):
        BlockWeight(a.data, a.ggml_type, 128, input_order=torch.zeros(128, dtype=torch.int64))
