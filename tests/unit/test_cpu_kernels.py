"""pagoda's C++ CPU kernels against plain-torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.attention import AttentionMetadata, paged_attention
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


def _q8_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The small-step kernels' activation quantization, emulated: per row and group of
    32, scale max|x| / 127, values round(x * (1 / scale)) (ties to even)."""
    g = x.reshape(x.shape[0], -1, 32)
    d = g.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(g * inv[..., None]), d


def _q4_small_step_reference(x, q):
    """What q4_linear computes: W x' for the quantized x', i.e. per group
    dw * dx * (q_w . q_x) + mw * dx * sum(q_x)."""
    xq, xd = _q8_groups(x)                                     # [M, G, 32], [M, G]
    n, half = q.qweight.shape
    wg = q.qweight.reshape(n, half // 16, 16)
    wq = torch.cat((wg & 0x0F, wg >> 4), dim=-1).double()     # [N, G, 32]
    dots = torch.einsum("mgk,ngk->mng", xq.double(), wq)       # exact integers
    scaled = dots * q.scales.double()[None] * xd.double()[:, None, :]
    mins = q.mins.double()[None] * (xq.double().sum(-1) * xd.double())[:, None, :]
    y = (scaled + mins).sum(-1)
    return (y + q.bias.double() if q.bias is not None else y).float()


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_q4_linear_matches_its_reference(rows, bias):
    torch.manual_seed(rows)
    lin = torch.nn.Linear(128, 200, bias=bias)
    q = Q4Linear(lin)
    x = torch.randn(rows, 128)
    exact = F.linear(x, q4_dequantize(q.qweight, q.scales, q.mins), q.bias)
    fused = ops.q4_linear(x, q.qweight, q.scales, q.mins, q.bias)
    # The activations in int8 groups of 32, integer dots (llama.cpp's Q4_1 x Q8_1).
    torch.testing.assert_close(fused, _q4_small_step_reference(x, q), rtol=1e-4, atol=1e-4)
    assert float((fused - exact).norm() / exact.norm()) < 0.01
    assert torch.equal(q(x), fused)
    # A row's result does not depend on how many rows share the call.
    for i in (0, rows // 2, rows - 1):
        assert torch.equal(ops.q4_linear(x[i:i + 1], q.qweight, q.scales, q.mins, q.bias)[0], fused[i])


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


def _reference_decode(q, cache, tables, lens, scale, window=0, softcap=0.0, sinks=None):
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    bs = cache.shape[2]
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        p = torch.arange(max(0, n - window) if window else 0, n)
        slots = tables[b].long()[p // bs] * bs + p % bs
        k = cache[0].reshape(-1, kv_heads, head_dim)[slots].transpose(0, 1)
        v = cache[1].reshape(-1, kv_heads, head_dim)[slots].transpose(0, 1)
        qq = q[b].view(kv_heads, -1, head_dim)
        scores = qq @ k.transpose(1, 2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is not None:   # one more logit per head, with no value (transformers' GPT-OSS)
            sink = sinks.view(kv_heads, -1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat((scores, sink), -1), -1)[..., :-1]
        else:
            probs = torch.softmax(scores, -1)
        out.append((probs @ v).reshape(-1, head_dim))
    return torch.stack(out)


@needs_kernels
@pytest.mark.parametrize("isa", ["avx2", "native"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 32), (4, 4, 64), (8, 1, 32), (12, 2, 16), (10, 1, 16),
                                                    (6, 2, 12)])
def test_paged_decode_attention_matches_reference(heads, kv_heads, head_dim, isa, monkeypatch):
    """Query heads per KV head 1-8 with head_dim a multiple of 8 take the vector path (16:
    the AVX-512 one where the CPU has it, unless PAGODA_CPU_ISA=avx2; 3, 1, 6 and 8 query
    heads per KV head cover its 8-, 4- and 2-position K groups), the others (10 per KV head;
    head_dim 12) the generic one; lengths cover partial 8-position tails and block
    boundaries."""
    if isa == "avx2":
        monkeypatch.setenv("PAGODA_CPU_ISA", "avx2")
    torch.manual_seed(heads)
    cache = torch.randn(2, 40, 16, kv_heads, head_dim) * 3  # wide scores: softmax far from uniform
    lens = torch.tensor([1, 16, 17, 100, 5, 8, 9], dtype=torch.int32)
    tables = torch.stack([torch.randperm(40)[:7] for _ in range(7)]).int()
    q = torch.randn(7, heads, head_dim)
    out = ops.paged_decode_attention(q, cache, tables, lens, 0.17)
    torch.testing.assert_close(out, _reference_decode(q, cache, tables, lens, 0.17), rtol=1e-5, atol=1e-5)
    # A sequence's result does not depend on its batch.
    for b in (0, 3, 6):
        alone = ops.paged_decode_attention(q[b:b + 1], cache, tables[b:b + 1], lens[b:b + 1], 0.17)
        assert torch.equal(alone[0], out[b])


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 32), (10, 1, 16)])
def test_paged_decode_attention_window(heads, kv_heads, head_dim):
    """A sliding-window layer's decode reads the last `window` positions only (vector and
    generic paths; windows shorter and longer than the sequences, across block edges)."""
    torch.manual_seed(7)
    cache = torch.randn(2, 40, 16, kv_heads, head_dim) * 3
    lens = torch.tensor([1, 16, 17, 100, 5, 40], dtype=torch.int32)
    tables = torch.stack([torch.randperm(40)[:7] for _ in range(6)]).int()
    q = torch.randn(6, heads, head_dim)
    for window in (1, 7, 16, 33, 200):
        out = ops.paged_decode_attention(q, cache, tables, lens, 0.17, None, window)
        want = _reference_decode(q, cache, tables, lens, 0.17, window)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    full = ops.paged_decode_attention(q, cache, tables, lens, 0.17)
    assert torch.equal(ops.paged_decode_attention(q, cache, tables, lens, 0.17, None, 200), full)
    assert not torch.allclose(ops.paged_decode_attention(q, cache, tables, lens, 0.17, None, 7)[3], full[3])


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 32), (10, 1, 16)])
def test_paged_decode_attention_softcap(heads, kv_heads, head_dim):
    """Gemma 2's capped scores (cap x tanh(s / cap)) on the vector and generic paths, with
    and without a window."""
    torch.manual_seed(8)
    cache = torch.randn(2, 40, 16, kv_heads, head_dim) * 3
    lens = torch.tensor([1, 17, 100, 40], dtype=torch.int32)
    tables = torch.stack([torch.randperm(40)[:7] for _ in range(4)]).int()
    q = torch.randn(4, heads, head_dim) * 2
    for window, cap in ((0, 5.0), (20, 5.0), (0, 50.0)):
        out = ops.paged_decode_attention(q, cache, tables, lens, 0.5, None, window, cap)
        want = _reference_decode(q, cache, tables, lens, 0.5, window, cap)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)   # tanh and exp: a few ulps apart
    uncapped = ops.paged_decode_attention(q, cache, tables, lens, 0.5)
    assert not torch.allclose(ops.paged_decode_attention(q, cache, tables, lens, 0.5, None, 0, 5.0), uncapped)


@needs_kernels
@pytest.mark.parametrize("isa", ["avx2", "native"])
@pytest.mark.parametrize("kind", ["float32", "float16", "int8"])
def test_paged_decode_attention_split_over_long_contexts(kind, isa, monkeypatch):
    """Contexts longer than a split-K chunk (256 positions): a sequence's chunks run as units
    of their own and their partial softmaxes merge; lengths around the chunk edges, with
    windows and sinks, each cache dtype; the result of a sequence alone equals its result in
    the batch (the cut depends on the sequence alone); the AVX2 kernel and, where the CPU has
    it, the AVX-512 one (64-wide heads)."""
    if isa == "avx2":
        monkeypatch.setenv("PAGODA_CPU_ISA", "avx2")
    torch.manual_seed(11)
    heads, kv_heads, head_dim, bs = 9, 3, 64, 16
    lens = torch.tensor([1, 255, 256, 257, 700, 1030], dtype=torch.int32)
    per_seq = 65
    values = torch.randn(2, per_seq * 6, bs, kv_heads, head_dim) * 3
    scales = None
    if kind == "int8":
        scales = values.abs().amax(-1) / 127
        cache = torch.round(values / scales[..., None]).to(torch.int8)
        dense = cache.float() * scales[..., None]
    else:
        cache = values.to(getattr(torch, kind))
        dense = cache.float()
    tables = torch.randperm(per_seq * 6).view(6, per_seq).int()
    q = torch.randn(6, heads, head_dim)
    sinks = torch.randn(heads) * 3
    for window, sink in ((0, None), (300, None), (0, sinks), (200, sinks)):
        out = ops.paged_decode_attention(q, cache, tables, lens, 0.125, scales, window, 0.0, sink)
        want = _reference_decode(q, dense, tables, lens, 0.125, window, sinks=sink)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        for b in (0, 3, 5):
            alone = ops.paged_decode_attention(q[b:b + 1], cache, tables[b:b + 1], lens[b:b + 1], 0.125, scales,
                                               window, 0.0, sink)
            assert torch.equal(alone[0], out[b])


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 32), (10, 1, 16)])
def test_paged_decode_attention_sinks(heads, kv_heads, head_dim):
    """GPT-OSS's sinks (a logit per query head joining the softmax) on the vector and
    generic paths, with and without a window, sinks below and above the scores."""
    torch.manual_seed(9)
    cache = torch.randn(2, 40, 16, kv_heads, head_dim) * 3
    lens = torch.tensor([1, 17, 100, 40], dtype=torch.int32)
    tables = torch.stack([torch.randperm(40)[:7] for _ in range(4)]).int()
    q = torch.randn(4, heads, head_dim) * 2
    for window, sinks in ((0, torch.randn(heads)), (20, torch.randn(heads) * 5), (0, torch.full((heads,), 30.0))):
        out = ops.paged_decode_attention(q, cache, tables, lens, 0.5, None, window, 0.0, sinks)
        want = _reference_decode(q, cache, tables, lens, 0.5, window, sinks=sinks)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    plain = ops.paged_decode_attention(q, cache, tables, lens, 0.5)
    assert not torch.allclose(ops.paged_decode_attention(q, cache, tables, lens, 0.5, None, 0, 0.0,
                                                         torch.zeros(heads)), plain)
    with pytest.raises(RuntimeError, match="sinks"):
        ops.paged_decode_attention(q, cache, tables, lens, 0.5, None, 0, 0.0, torch.zeros(heads + 1))


@needs_kernels
def test_paged_decode_attention_rejects_bad_lengths():
    cache = torch.randn(2, 4, 16, 1, 8)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.paged_decode_attention(torch.randn(1, 1, 8), cache, tables, torch.tensor([33], dtype=torch.int32), 1.0)


@needs_kernels
def test_paged_decode_attention_rejects_bad_block_ids():
    cache = torch.randn(2, 4, 16, 1, 8)
    tables = torch.tensor([[1, 4]], dtype=torch.int32)   # block 4 of 4
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_decode_attention(torch.randn(1, 1, 8), cache, tables, torch.tensor([17], dtype=torch.int32), 1.0)
    # Only the blocks a sequence uses are read: a padded table's tail may hold anything.
    ops.paged_decode_attention(torch.randn(1, 1, 8), cache, tables, torch.tensor([16], dtype=torch.int32), 1.0)


@needs_kernels
@pytest.mark.parametrize("with_sinks", [False, True])
def test_metadata_decode_kernel_path_equals_gather_path(with_sinks):
    """paged_attention with the in-place kernel and with the padded gather give
    the same outputs for a mixed batch (two decodes, one prompt chunk), with and without
    GPT-OSS's sinks (which also change the result)."""
    torch.manual_seed(3)
    heads, kv_heads, d, bs = 6, 2, 16, 4
    query_lens, context_lens = [1, 1, 3], [6, 2, 5]
    tables = [[3, 1], [0], [2, 5]]
    sinks = torch.randn(heads) if with_sinks else None
    results = []
    for use_kernel in (False, True):
        cache = torch.zeros(2, 8, bs, kv_heads, d)
        torch.manual_seed(4)
        cache.normal_()
        meta = AttentionMetadata.build(query_lens, context_lens, tables, bs, torch.device("cpu"), use_kernel)
        assert (meta.decode_block_tables is not None) == use_kernel
        t = sum(query_lens)
        q, k, v = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
        results.append((paged_attention(q, k, v, cache, meta, d ** -0.5, sinks=sinks), cache))
        if with_sinks:
            plain = paged_attention(q, k, v, cache, meta, d ** -0.5, kv_written=True)
            assert not torch.allclose(plain, results[-1][0])
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(results[0][1], results[1][1])


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 16, 17, 40, 300])
def test_int8_weight_linear_matches_its_reference(rows):
    """q4 mode's LM head: the same integer scheme with int8 weights, any number of rows."""
    from pagoda.model.layers.quantization import Int8WeightLinear

    torch.manual_seed(rows)
    layer = Int8WeightLinear(torch.nn.Linear(96, 300, bias=False))
    x = torch.randn(rows, 96)
    exact = F.linear(x, layer.qweight.float() * layer.weight_scale[:, None])
    # Activations in int8 groups of 32, integer dots, then the channel scale.
    xq, xd = _q8_groups(x)
    dots = torch.einsum("mgk,ngk->mng", xq.double(), layer.qweight.double().reshape(300, 3, 32))
    small = ((dots * xd.double()[:, None, :]).sum(-1) * layer.weight_scale.double()).float()
    torch.testing.assert_close(ops.q8_linear(x, layer.qweight, layer.weight_scale), small, rtol=1e-4, atol=1e-4)
    assert float((small - exact).norm() / exact.norm()) < 0.01
    out = layer(x)
    torch.testing.assert_close(out, small, rtol=1e-4, atol=1e-4)
    for i in (0, rows // 2, rows - 1):
        assert torch.equal(layer(x[i:i + 1])[0], out[i])


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
    # 75 channels: the epilogue's 32-channel blocks, 8-channel and single-channel
    # tails; rows go three, two or one at a time; two outlier channels and a bias.
    for outliers in (None, torch.tensor([3, 10])):
        layer = Int8Linear(torch.nn.Linear(64, 75), outliers=outliers)
        x = torch.randn(40, 64)
        batched = layer(x)
        assert x.shape[0] > INT8_SMALL_STEP_ROWS
        for i in (0, 17, 38, 39):
            assert torch.equal(layer(x[i:i + 1])[0], batched[i])
        assert torch.equal(layer(x[37:39]), batched[37:39])
        # The GEMV for every step (what CPUs without VNNI run: torch._int_mm is slow there)
        # and torch._int_mm above INT8_SMALL_STEP_ROWS give the same bits.
        args = (layer.int8_weight().contiguous(), layer.weight_scale, layer.bias)
        rest = (layer.outlier_idx, layer.outlier_weight)
        assert torch.equal(ops.int8_linear(x, *args, INT8_SMALL_STEP_ROWS, *rest),
                           ops.int8_linear(x, *args, 1 << 62, *rest))


@needs_kernels
def test_int8_linear_token_amax_is_the_scale_of_every_rank():
    """``token_amax`` (a row-parallel layer: each token's max over every rank's inlier
    channels): equal to the row's own max it changes nothing; larger, the row is rounded
    with that scale, as the torch path of Int8Linear rounds it."""
    from pagoda.model.layers.quantization import Int8Linear

    torch.manual_seed(9)
    layer = Int8Linear(torch.nn.Linear(64, 40), outliers=torch.tensor([5, 30]))
    x = torch.randn(7, 64)
    args = (layer.int8_weight().contiguous(), layer.weight_scale, layer.bias, 1 << 62, layer.outlier_idx,
            layer.outlier_weight)
    own = x.abs().index_fill(1, layer.outlier_idx, 0.0).amax(1)
    assert torch.equal(ops.int8_linear(x, *args, None, None, own), ops.int8_linear(x, *args))
    wider = own * torch.linspace(1.0, 3.0, 7)
    got = ops.int8_linear(x, *args, None, None, wider)
    inliers = x.index_fill(1, layer.outlier_idx, 0.0)
    scale = wider[:, None] / 127.0
    acc = torch.round(inliers / scale) @ layer.int8_weight().float().t()
    want = acc * (scale * layer.weight_scale) + layer.bias + x[:, layer.outlier_idx] @ layer.outlier_weight
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, ops.int8_linear(x, *args), rtol=1e-4, atol=0)
    with pytest.raises(RuntimeError, match="token_amax"):
        ops.int8_linear(x, *args, None, None, own[:3])


needs_vnni = pytest.mark.skipif(not cpu_kernels.has_avx512_vnni(), reason="this CPU lacks AVX-512 VNNI")


@needs_vnni
def test_int8_pack_vnni_layout_and_sums():
    """Tiles of 64 channels, [K/4][64][4] each: byte (t, k // 4, c, k % 4) is weight
    (64 t + c, k); channels past N are zero; comp is -128 x each channel's sum."""
    torch.manual_seed(11)
    w = torch.randint(-127, 128, (70, 12), dtype=torch.int8)
    packed, comp = ops.int8_pack_vnni(w)
    padded = torch.zeros(128, 12, dtype=torch.int8)
    padded[:70] = w
    expected = padded.view(2, 64, 3, 4).permute(0, 2, 1, 3).reshape(-1)
    assert torch.equal(packed, expected)
    assert torch.equal(comp[:70], -128 * w.int().sum(1)) and not comp[70:].any()


@needs_vnni
@pytest.mark.parametrize("in_features,out_features", [(64, 75), (48, 130), (1536, 64)])
def test_int8_linear_vnni_gives_the_avx2_bits(in_features, out_features):
    """The AVX-512 VNNI product (u8 x s8 with the 128 x sum(w) taken off) has the same
    integers as the AVX2 GEMV and torch._int_mm, and its fused epilogue the same float
    operations in the same order: every element bit for bit, for every step size (rows
    six at a time and each remainder), tile tails, outlier channels and bias."""
    from pagoda.model.layers.quantization import INT8_SMALL_STEP_ROWS, Int8Linear

    torch.manual_seed(in_features + out_features)
    for outliers in (None, torch.tensor([3, 10, 40])):
        for bias in (True, False):
            layer = Int8Linear(torch.nn.Linear(in_features, out_features, bias=bias), outliers=outliers)
            assert layer.vnni_weight is not None
            for rows in (1, 2, 5, 6, 7, 13, 40):
                x = torch.randn(rows, in_features) * 4
                got = layer(x)
                avx2 = ops.int8_linear(x, layer.int8_weight(), layer.weight_scale, layer.bias,
                                       INT8_SMALL_STEP_ROWS, layer.outlier_idx, layer.outlier_weight)
                assert torch.equal(got, avx2), (outliers, bias, rows)
    # Extreme integers: every product at +-127 x 127 (no saturation anywhere).
    layer = Int8Linear(torch.nn.Linear(in_features, out_features, bias=False))
    with torch.no_grad():
        layer.vnni_weight, layer.vnni_comp = ops.int8_pack_vnni(torch.full_like(layer.int8_weight(), 127))
    for sign in (1.0, -1.0):
        x = torch.full((3, in_features), sign)
        acc = layer(x) / (layer.weight_scale * (1.0 / 127.0))
        torch.testing.assert_close(acc, torch.full_like(acc, sign * 127 * 127 * in_features), rtol=1e-6, atol=0)


@needs_vnni
def test_int8_linear_keeps_one_copy_of_its_weights():
    """Packed for VNNI, the layer drops the plain layout (an 8B model's int8 weights are
    7 GB) and still gives back the weights it was built from."""
    from pagoda.model.layers.quantization import Int8Linear, int8_per_channel

    lin = torch.nn.Linear(96, 130, bias=False)
    layer = Int8Linear(lin)
    assert layer.qweight.numel() == 0
    assert torch.equal(layer.int8_weight(), int8_per_channel(lin.weight.detach())[0])
    own = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert own < 1.2 * 192 * 96   # the packed tiles (two of 64 channels) and a few sums


def test_avx2_only_setting_turns_vnni_off(monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_ISA", "avx2")
    assert cpu_kernels.has_avx512_vnni() is False
    from pagoda.model.layers.quantization import Int8Linear

    layer = Int8Linear(torch.nn.Linear(64, 8))
    assert layer.vnni_weight is None and "vnni_weight" not in layer.state_dict()


@needs_kernels
def test_int8_linear_keeps_outlier_channels_in_float():
    """With a huge activation in one channel, per-token int8 rounds every other channel
    to almost nothing; the outlier channel in float keeps the error small. The C++ op
    and the plain-torch path compute the same numbers."""
    from pagoda.model.layers.quantization import Int8Linear

    torch.manual_seed(7)
    lin = torch.nn.Linear(64, 40)
    x = torch.randn(5, 64)
    x[:, 3] = 300.0
    exact = lin(x).detach()
    plain = Int8Linear(lin)
    split = Int8Linear(lin, outliers=torch.tensor([3]))
    err = lambda y: float((y - exact).norm() / exact.norm())  # noqa: E731
    assert err(split(x)) < 0.01 < err(plain(x))
    fallback = Int8Linear(lin, outliers=torch.tensor([3]))
    fallback._ops = None
    torch.testing.assert_close(fallback(x), split(x), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.int8_linear(x, split.int8_weight().contiguous(), split.weight_scale, None, 6, torch.tensor([64]),
                        split.outlier_weight)


@needs_kernels
@pytest.mark.parametrize("isa", ["", "avx2"])
def test_silu_mul_has_torchs_bits(isa, monkeypatch):
    """silu_mul computes F.silu(gate) * up with torch's own SLEEF exp: every element
    bit for bit, on either instruction set, including huge, tiny and signed-zero
    inputs; the MLP uses it and still gives the unfused result."""
    monkeypatch.setenv("PAGODA_CPU_ISA", isa)
    torch.manual_seed(2)
    for rows, width, spread in ((1, 32, 0.5), (5, 96, 3.0), (64, 1536, 10.0), (3, 64, 60.0)):
        gu = torch.randn(rows, 2 * width) * spread
        gu[0, :12] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 100.0, -100.0, 1e-8, -1e-8, 3e38, -3e38])
        gate, up = gu.split(width, dim=-1)
        assert torch.equal(ops.silu_mul(gu), F.silu(gate) * up)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.silu_mul(torch.randn(2, 40))

    from pagoda.model.arch import ModelArchConfig
    from pagoda.model.models.llama import LlamaMLP

    arch = ModelArchConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
                           tie_word_embeddings=False, attention_bias=False)
    mlp = LlamaMLP(arch)
    x = torch.randn(7, 32)
    with torch.no_grad():
        gate, up = mlp.gate_up_proj(x).split(64, dim=-1)
        assert torch.equal(mlp(x), mlp.down_proj(F.silu(gate) * up))


@needs_kernels
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(with_residual):
    from pagoda.model.models.llama import RMSNorm

    torch.manual_seed(3)
    norm = RMSNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    x, res = torch.randn(6, 48), torch.randn(6, 48)
    expected_sum = x + res
    expected = norm._norm(expected_sum if with_residual else x)
    if with_residual:
        residual = res.clone()
        out = ops.rms_norm(x, norm.weight.detach(), 1e-5, residual)
        assert torch.equal(residual, expected_sum)    # updated in place
    else:
        out = ops.rms_norm(x, norm.weight.detach(), 1e-5, None)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_rope_qkv_matches_torch_and_writes_the_cache():
    from pagoda.model.models.llama import apply_rope

    torch.manual_seed(4)
    t, heads, kv_heads, d = 5, 6, 2, 16
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    angles = torch.randn(t, d // 2)
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos(), emb.sin()
    q_ref = apply_rope(qkv[:, :heads * d].reshape(t, heads, d), cos[:, None], sin[:, None])
    k_ref = apply_rope(qkv[:, heads * d:(heads + kv_heads) * d].reshape(t, kv_heads, d), cos[:, None], sin[:, None])
    v_ref = qkv[:, (heads + kv_heads) * d:].reshape(t, kv_heads, d)
    cache = torch.zeros(2, 4, 4, kv_heads, d)
    slots = torch.tensor([9, 0, 15, 3, 4])
    q, k, v = ops.rope_qkv(qkv, cos, sin, heads, kv_heads, cache, slots)
    torch.testing.assert_close(q, q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, k_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(v, v_ref)
    assert torch.equal(cache[0].reshape(-1, kv_heads, d)[slots], k)
    assert torch.equal(cache[1].reshape(-1, kv_heads, d)[slots], v)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert not cache[:, :, :].reshape(2, 16, -1)[:, untouched].any()


@needs_kernels
@pytest.mark.parametrize("cols", [1, 7, 8, 37, 49152])
def test_argmax_rows_matches_torch(cols):
    """The first of equal maxima, the first NaN, all -inf rows, +-0: as torch.argmax."""
    torch.manual_seed(cols)
    x = torch.randn(12, cols)
    x[1] = torch.randint(0, 3, (cols,)).float()          # many ties
    x[2] = float("-inf")
    if cols > 3:
        x[3, cols // 2] = float("nan")
        x[3, cols - 1] = float("nan")
        x[4, -2:] = float("inf")
        x[5] = 0.0
        x[5, cols - 1] = -0.0
        x[6, cols - 1] = 100.0                                # the maximum in the tail
    got = ops.argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(ops.argmax_rows(x[:, : max(1, cols // 2)]), x[:, : max(1, cols // 2)].argmax(dim=-1))


@needs_kernels
@pytest.mark.parametrize("head_dim", [64, 16, 12])
def test_rope_qkv_rounds_as_its_elementwise_formula(head_dim):
    """Bit for bit x * cos + (-x_rotated) * sin (two multiplies and an add, each rounded),
    in the 8-wide loop (head_dim 16, 64) and the scalar tail (12); float16 cache writes
    round as torch's .half(), widths with and without a tail."""
    torch.manual_seed(head_dim)
    t, heads, kv_heads, d = 7, 3, 1, head_dim
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d) * 50
    cos, sin = torch.randn(t, d), torch.randn(t, d)
    cache = torch.zeros(2, 4, 4, kv_heads, d, dtype=torch.float16)
    slots = torch.tensor([9, 0, 15, 3, 4, 1, 2])
    q, k, v = ops.rope_qkv(qkv, cos, sin, heads, kv_heads, cache, slots)
    half = d // 2

    def formula(x):  # [t, heads, d]
        a, b = x[..., :half], x[..., half:]
        c, s = cos[:, None], sin[:, None]
        return torch.cat((a * c[..., :half] + (-b) * s[..., :half], b * c[..., half:] + a * s[..., half:]), -1)

    assert torch.equal(q, formula(qkv[:, :heads * d].reshape(t, heads, d)))
    assert torch.equal(k, formula(qkv[:, heads * d:(heads + kv_heads) * d].reshape(t, kv_heads, d)))
    assert torch.equal(cache[0].reshape(-1, kv_heads, d)[slots], k.half())
    assert torch.equal(cache[1].reshape(-1, kv_heads, d)[slots], v.half())


def test_kernels_build_on_a_cpu_that_has_what_they_need():
    """A compile error must not pass unnoticed as skipped tests and a slow fallback."""
    if not {"avx2", "fma", "f16c"} <= cpu_kernels._cpu_flags():
        pytest.skip("this CPU lacks AVX2/FMA/F16C")
    if cpu_kernels.error() == "disabled by PAGODA_DISABLE_CPU_KERNELS=1":
        pytest.skip("disabled by PAGODA_DISABLE_CPU_KERNELS=1")
    assert ops is not None, cpu_kernels.error()



@needs_kernels
def test_the_module_builds_as_a_plain_script():
    """`make install` compiles the kernels by running this file as a script (torch and ninja
    alone, beside the rest of the install): it must not import the package, and it finds the
    build the package uses."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-I", cpu_kernels.__file__, "--build"], capture_output=True, text=True,
                         timeout=600, check=True).stdout.strip()
    assert out == ops.__file__

@needs_kernels
def test_float16_cache_decode_and_write():
    """A float16 cache: rope_qkv stores K/V rounded as torch's .half() does, and decode
    attention over it equals the float32 reference on the same (rounded) values."""
    torch.manual_seed(8)
    heads, kv_heads, d = 9, 3, 64
    cache = (torch.randn(2, 12, 16, kv_heads, d) * 2).half()
    qkv = torch.randn(3, (heads + 2 * kv_heads) * d)
    cos, sin = torch.ones(3, d), torch.zeros(3, d)       # no rotation: k, v come back as written
    slots = torch.tensor([5, 40, 77])
    q, k, v = ops.rope_qkv(qkv, cos, sin, heads, kv_heads, cache, slots)
    assert torch.equal(cache[0].reshape(-1, kv_heads, d)[slots], k.half())
    assert torch.equal(cache[1].reshape(-1, kv_heads, d)[slots], v.half())
    tables = torch.stack([torch.randperm(12)[:4] for _ in range(3)]).int()
    lens = torch.tensor([1, 23, 64], dtype=torch.int32)
    out = ops.paged_decode_attention(q, cache, tables, lens, 0.125)
    ref = _reference_decode(q, cache.float(), tables, lens, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (6, 2, 12)])
def test_int8_cache_decode_and_write(heads, kv_heads, head_dim):
    """An int8 cache (--kv-cache-dtype int8): rope_qkv quantizes K/V into their slots
    exactly as QuantizedKVCache.write does (values and per-token scales), and decode
    attention over it equals the float32 reference on the dequantized values, whatever
    the batch. (6, 2, 12) takes the generic path."""
    from pagoda.attention.kv_quant import QuantizedKVCache

    torch.manual_seed(heads)
    d = head_dim
    ours = QuantizedKVCache(12, 16, kv_heads, d, torch.int8, "cpu")
    theirs = QuantizedKVCache(12, 16, kv_heads, d, torch.int8, "cpu")
    for c in (ours, theirs):
        c.data.zero_()
        c.scales.fill_(1.0)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d) * torch.linspace(0.01, 20, 5)[:, None]
    cos, sin = torch.randn(5, d), torch.randn(5, d)
    slots = torch.tensor([5, 40, 77, 0, 191])
    q, k, v = ops.rope_qkv(qkv, cos, sin, heads, kv_heads, ours.data, slots, ours.scales)
    theirs.write(slots, k, v)
    assert torch.equal(ours.data, theirs.data) and torch.equal(ours.scales, theirs.scales)
    with pytest.raises(RuntimeError, match="needs contiguous float32 scales"):
        ops.rope_qkv(qkv, cos, sin, heads, kv_heads, ours.data, slots)

    # Decode over a cache filled with K/V of very different sizes per token.
    kv = torch.randn(12 * 16, kv_heads, d) * torch.rand(12 * 16, 1, 1) * 10
    ours.write(torch.arange(12 * 16), kv, -kv.flip(0))
    tables = torch.stack([torch.randperm(12)[:4] for _ in range(4)]).int()
    lens = torch.tensor([1, 23, 64, 9], dtype=torch.int32)
    q = torch.randn(4, heads, d)
    out = ops.paged_decode_attention(q, ours.data, tables, lens, 0.125, ours.scales)
    dequantized = torch.stack([ours.read(i, torch.arange(12 * 16), torch.float32) for i in (0, 1)])
    ref = _reference_decode(q, dequantized.view(2, 12, 16, kv_heads, d), tables, lens, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for b in range(4):
        alone = ops.paged_decode_attention(q[b:b + 1], ours.data, tables[b:b + 1], lens[b:b + 1], 0.125, ours.scales)
        assert torch.equal(alone[0], out[b])
    with pytest.raises(RuntimeError, match="needs its scales"):
        ops.paged_decode_attention(q, ours.data, tables, lens, 0.125)


@needs_kernels
def test_int8_cache_kernel_path_equals_gather_path():
    """paged_attention over an int8 cache: the in-place kernel (K/V written by the
    caller, as the model's fused op does) and the gather path give the same outputs
    for a mixed batch, and the same cache."""
    from pagoda.attention.kv_quant import QuantizedKVCache

    heads, kv_heads, d, bs = 6, 2, 16, 4
    query_lens, context_lens = [1, 1, 3], [6, 2, 5]
    tables = [[3, 1], [0], [2, 5]]
    results = []
    for use_kernel in (False, True):
        torch.manual_seed(4)
        cache = QuantizedKVCache(8, bs, kv_heads, d, torch.int8, "cpu")
        cache.write(torch.arange(8 * bs), torch.randn(8 * bs, kv_heads, d), torch.randn(8 * bs, kv_heads, d))
        meta = AttentionMetadata.build(query_lens, context_lens, tables, bs, torch.device("cpu"), use_kernel)
        t = sum(query_lens)
        q, k, v = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
        if use_kernel:
            cache.write(meta.slot_mapping, k, v)
        out = paged_attention(q, k, v, cache, meta, d ** -0.5, kv_written=use_kernel)
        results.append((out, cache))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(results[0][1].data, results[1][1].data)
    assert torch.equal(results[0][1].scales, results[1][1].scales)


@needs_kernels
@pytest.mark.skipif(not cpu_kernels.has_avx512_vnni(), reason="this CPU has no AVX-512")
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 64), (9, 3, 64), (16, 2, 128)])
def test_paged_decode_attention_avx512_agrees_with_avx2(heads, kv_heads, head_dim, monkeypatch):
    """The 16-lane kernel sums each head in another order than the 8-lane one: the same
    results but for the last bits (a machine runs one of them, so each is batch invariant on
    its own, tested above)."""
    torch.manual_seed(5)
    cache = torch.randn(2, 200, 16, kv_heads, head_dim).half()
    lens = torch.tensor([3, 300, 1000], dtype=torch.int32)
    tables = torch.randperm(200)[:192].view(3, 64).int()
    q = torch.randn(3, heads, head_dim)
    wide = ops.paged_decode_attention(q, cache, tables, lens, 0.125)
    monkeypatch.setenv("PAGODA_CPU_ISA", "avx2")
    narrow = ops.paged_decode_attention(q, cache, tables, lens, 0.125)
    torch.testing.assert_close(wide, narrow, rtol=1e-5, atol=1e-6)
    assert not torch.equal(wide, narrow)   # the 16-lane kernel did run
