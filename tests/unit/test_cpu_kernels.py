"""pagoda's C++ CPU kernels against plain-torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.model.attention import AttentionMetadata, paged_attention
from pagoda.model.layers.quantization import Q4Linear, q4_dequantize, q4_quantize
from pagoda.ops import cpu_kernels

ops = cpu_kernels.kernels()
needs_kernels = pytest.mark.skipif(ops is None, reason=f"CPU kernels unavailable: {cpu_kernels.error()}")


def test_q4_quantize_round_trip_is_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(64, 96)
    packed, scales, mins = q4_quantize(w)
    assert packed.shape == (64, 48) and packed.dtype == torch.uint8
    assert scales.shape == mins.shape == (64, 3) and scales.dtype == mins.dtype == torch.float16
    back = q4_dequantize(packed, scales, mins).view(64, 3, 32)
    groups = w.view(64, 3, 32)
    # Half a step, plus the fp16 rounding of the minimum and of the scale (x15).
    slack = scales.float() / 2 + (mins.float().abs() + 15 * scales.float()) * 2.0 ** -10 + 1e-6
    assert bool(((back - groups).abs() <= slack[..., None]).all())
    # A group's min and max are on the grid, to fp16 rounding.
    torch.testing.assert_close(back.amin(-1), groups.amin(-1), rtol=2e-3, atol=1e-4)
    torch.testing.assert_close(back.amax(-1), groups.amax(-1), rtol=2e-3, atol=1e-4)


def test_q4_quantize_of_a_constant_group_is_exact():
    w = torch.full((2, 32), 0.25)
    assert torch.equal(q4_dequantize(*q4_quantize(w)), w)


def test_q4_quantize_rejects_ragged_rows():
    with pytest.raises(ValueError, match="divisible by 32"):
        q4_quantize(torch.randn(4, 40))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_q4_linear_matches_dequantized_reference(rows, bias):
    torch.manual_seed(rows)
    lin = torch.nn.Linear(128, 200, bias=bias)
    q = Q4Linear(lin)
    x = torch.randn(rows, 128)
    ref = F.linear(x, q4_dequantize(q.qweight, q.scales, q.mins), q.bias)
    fused = ops.q4_linear(x, q.qweight, q.scales, q.mins, q.bias)
    tiled = ops.q4_linear_tiled(x, q.qweight, q.scales, q.mins, q.bias)
    torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tiled, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(q(x), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ops.q4_dequantize(q.qweight, q.scales, q.mins),
                               q4_dequantize(q.qweight, q.scales, q.mins))


@needs_kernels
def test_q4_fused_rows_are_batch_invariant():
    """A row's result is bit-identical whether it runs alone or in a batch."""
    torch.manual_seed(1)
    q = Q4Linear(torch.nn.Linear(256, 96))
    x = torch.randn(7, 256)
    batched = ops.q4_linear(x, q.qweight, q.scales, q.mins, None)
    for i in range(7):
        assert torch.equal(ops.q4_linear(x[i:i + 1], q.qweight, q.scales, q.mins, None)[0], batched[i])


@needs_kernels
def test_q4_linear_checks_shapes():
    q = Q4Linear(torch.nn.Linear(64, 8))
    with pytest.raises(RuntimeError, match="bytes per row"):
        ops.q4_linear(torch.randn(2, 96), q.qweight, q.scales, q.mins, None)


def _reference_decode(q, cache, tables, lens, scale):
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    bs = cache.shape[2]
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        p = torch.arange(n)
        slots = tables[b].long()[p // bs] * bs + p % bs
        k = cache[0].reshape(-1, kv_heads, head_dim)[slots].transpose(0, 1)
        v = cache[1].reshape(-1, kv_heads, head_dim)[slots].transpose(0, 1)
        qq = q[b].view(kv_heads, -1, head_dim)
        out.append((torch.softmax(qq @ k.transpose(1, 2) * scale, -1) @ v).reshape(-1, head_dim))
    return torch.stack(out)


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_paged_decode_attention_matches_reference(heads, kv_heads):
    torch.manual_seed(heads)
    cache = torch.randn(2, 40, 16, kv_heads, 32)
    lens = torch.tensor([1, 16, 17, 100, 5], dtype=torch.int32)
    tables = torch.stack([torch.randperm(40)[:7] for _ in range(5)]).int()
    q = torch.randn(5, heads, 32)
    out = ops.paged_decode_attention(q, cache, tables, lens, 0.17)
    torch.testing.assert_close(out, _reference_decode(q, cache, tables, lens, 0.17), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_paged_decode_attention_rejects_bad_lengths():
    cache = torch.randn(2, 4, 16, 1, 8)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.paged_decode_attention(torch.randn(1, 1, 8), cache, tables, torch.tensor([33], dtype=torch.int32), 1.0)


@needs_kernels
def test_metadata_decode_kernel_path_equals_gather_path():
    """paged_attention with the in-place kernel and with the padded gather give
    the same outputs for a mixed batch (two decodes, one prompt chunk)."""
    torch.manual_seed(3)
    heads, kv_heads, d, bs = 6, 2, 16, 4
    query_lens, context_lens = [1, 1, 3], [6, 2, 5]
    tables = [[3, 1], [0], [2, 5]]
    results = []
    for use_kernel in (False, True):
        cache = torch.zeros(2, 8, bs, kv_heads, d)
        torch.manual_seed(4)
        cache.normal_()
        meta = AttentionMetadata.build(query_lens, context_lens, tables, bs, torch.device("cpu"), use_kernel)
        assert (meta.decode_block_tables is not None) == use_kernel
        t = sum(query_lens)
        q, k, v = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
        results.append((paged_attention(q, k, v, cache, meta, d ** -0.5), cache))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(results[0][1], results[1][1])


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 16, 17, 40])
def test_int8_weight_linear_matches_dequantized_reference(rows):
    from pagoda.model.layers.quantization import Int8WeightLinear

    torch.manual_seed(rows)
    layer = Int8WeightLinear(torch.nn.Linear(96, 300, bias=False))
    x = torch.randn(rows, 96)
    ref = F.linear(x, layer.qweight.float() * layer.weight_scale[:, None])
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ops.q8_linear(x, layer.qweight, layer.weight_scale), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ops.q8_linear_tiled(x, layer.qweight, layer.weight_scale), ref, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_i8_mm_is_exact_and_int8_linear_is_batch_invariant():
    """The small-step int8 GEMV gives the same integers as torch._int_mm, so an
    int8-mode row computes the same numbers alone (GEMV path) and in a batch of 40
    (torch._int_mm path)."""
    from pagoda.model.layers.quantization import INT8_SMALL_STEP_ROWS, Int8Linear

    torch.manual_seed(5)
    xq = torch.randint(-127, 128, (3, 64), dtype=torch.int8)
    w = torch.randint(-127, 128, (50, 64), dtype=torch.int8)
    assert torch.equal(ops.i8_mm(xq, w), xq.long().matmul(w.long().t()).int())
    layer = Int8Linear(torch.nn.Linear(64, 50))
    x = torch.randn(40, 64)
    batched = layer(x)
    assert x.shape[0] > INT8_SMALL_STEP_ROWS
    for i in (0, 17, 39):
        assert torch.equal(layer(x[i:i + 1])[0], batched[i])
