"""Weights kept in their GGUF blocks: for every type, pagoda's dequantization equals the
gguf library's reference bit for bit, and its float32 products equal float64 products of
the dequantized weights within float32 rounding, at every step size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from pagoda.bench.gguf_files import random_blocks
from pagoda.model.layers.blocks import BLOCK_TYPES, BlocksEmbedding, BlocksLinear, BlockWeight, UnsupportedWeightType
from pagoda.ops import cpu_kernels

ops = cpu_kernels.kernels()
pytestmark = pytest.mark.skipif(ops is None, reason=f"CPU kernels unavailable: {cpu_kernels.error()}")

TYPES = sorted(BLOCK_TYPES, key=lambda t: t.value)


def _weight(ggml_type: Q, rows: int, cols: int, seed: int) -> tuple[BlockWeight, np.ndarray]:
    raw = random_blocks(ggml_type, rows, cols, np.random.default_rng(seed))
    if ggml_type == Q.F32:
        ref = raw.view(np.float32).reshape(rows, cols)
    elif ggml_type == Q.F16:
        ref = raw.view(np.float16).reshape(rows, cols).astype(np.float32)
    else:
        ref = quants.dequantize(raw, ggml_type).reshape(rows, cols)
    return BlockWeight(torch.from_numpy(np.ascontiguousarray(raw)), ggml_type, cols), ref


def _close(y: torch.Tensor, x: torch.Tensor, w: np.ndarray, bias: torch.Tensor | None = None) -> None:
    """Within float32 rounding of the float64 product: the float32 sums' error is
    bounded by ~K eps |x| |w|, far below a wrong block's (weights off by a scale)."""
    exact = x.double() @ torch.from_numpy(w).double().T
    if bias is not None:
        exact = exact + bias.double()
    bound = x.abs().double() @ torch.from_numpy(np.abs(w)).double().T
    tol = 4 * x.shape[1] ** 0.5 * torch.finfo(torch.float32).eps * bound + 1e-30
    assert y.dtype == torch.float32
    assert bool(((y.double() - exact).abs() <= tol).all()), (y.double() - exact).abs().max()


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_dequantize_is_the_reference_bit_for_bit(ggml_type):
    w, ref = _weight(ggml_type, 19, 512, seed=ggml_type.value)
    got = w.dequantize().numpy()
    assert got.shape == ref.shape
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)) or np.array_equal(got, ref)
    rows = torch.tensor([18, 0, 7, 7])
    assert np.array_equal(w.dequantize(rows).numpy(), ref[rows.numpy()])


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_linear_equals_float_products_at_every_step_size(ggml_type):
    w, ref = _weight(ggml_type, 45, 256, seed=100 + ggml_type.value)
    layer = BlocksLinear([w])
    g = torch.Generator().manual_seed(ggml_type.value)
    for rows in (1, 2, 3, 4, 5, 7, 16, 17, 33, 64, 130, 300):
        x = torch.randn(rows, 256, generator=g)
        y = layer(x)
        assert y.shape == (rows, 45)
        _close(y, x, ref)


def test_stacked_parts_of_different_types_with_bias():
    """A q/k/v projection whose parts differ in type (Q4_K_M files mix Q4_K and Q6_K)."""
    parts = [_weight(t, n, 512, seed=i) for i, (t, n) in enumerate([(Q.Q4_K, 32), (Q.Q6_K, 8), (Q.Q8_0, 8)])]
    bias = torch.randn(48)
    layer = BlocksLinear([p for p, _ in parts], bias)
    ref = np.concatenate([r for _, r in parts])
    for rows in (1, 6, 40):
        x = torch.randn(rows, 512)
        _close(layer(x), x, ref, bias)
    # Leading dimensions are kept.
    assert layer(torch.randn(2, 3, 512)).shape == (2, 3, 48)
    assert torch.equal(layer.dequantized(), torch.from_numpy(ref))


def test_a_small_steps_rows_do_not_depend_on_the_batch():
    """Up to 4 rows (decode of a few streams) run one micro-kernel whose sums per row have
    a fixed order; 5-16 rows another (dequantized tiles), also row by row."""
    w, _ = _weight(Q.Q4_K, 70, 512, seed=3)
    layer = BlocksLinear([w])
    x = torch.randn(16, 512)
    y4, y16 = layer(x[:4]), layer(x)
    for i in range(4):
        assert torch.equal(layer(x[i : i + 1])[0], y4[i])
    assert torch.equal(layer(x[5:12]), y16[5:12])


@pytest.mark.parametrize("ggml_type", [t for t in TYPES if t not in (Q.F32, Q.F16, Q.BF16)], ids=lambda t: t.name)
def test_small_steps_give_the_whole_row_kernels_bits(ggml_type):
    """Steps of 1-4 rows multiply 256-weight chunks decoded into L1, the offsets four
    channels at a time: the same float32 operations in the same order as the kernels
    that decoded whole rows first (gguf_linear_direct_reference), so the same bits, on
    one thread or two, for stacked parts with a bias, channel counts that leave tails,
    long rows and signed zeros in x."""
    threads = torch.get_num_threads()
    try:
        for cols in (256, 2048, 8192):
            rng = np.random.default_rng(cols + ggml_type.value)
            parts = [torch.from_numpy(random_blocks(ggml_type, rows, cols, rng)) for rows in (37, 6)]
            types = [ggml_type.value] * 2
            bias = torch.randn(43, generator=torch.Generator().manual_seed(cols))
            for rows in (1, 2, 3, 4):
                x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)) * 2
                x[0, 3], x[-1, 5] = 0.0, -0.0
                for n_threads in (1, 2):
                    torch.set_num_threads(n_threads)
                    for ws, ts, b in ((parts, types, bias), (parts[:1], types[:1], None)):
                        got = ops.gguf_linear(x, ws, ts, b)
                        ref = ops.gguf_linear_direct_reference(x, ws, ts, b)
                        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (cols, rows, n_threads)
    finally:
        torch.set_num_threads(threads)


def test_embedding_reads_only_its_rows():
    w, ref = _weight(Q.Q6_K, 100, 256, seed=5)
    emb = BlocksEmbedding(w)
    ids = torch.tensor([[3, 99], [0, 3]])
    out = emb(ids)
    assert out.shape == (2, 2, 256)
    assert torch.equal(out[0, 0], torch.from_numpy(ref[3])) and torch.equal(out[1, 1], out[0, 0])
    with pytest.raises(RuntimeError, match="out of range"):
        emb(torch.tensor([100]))


def test_bad_weights_are_clear_errors():
    w, _ = _weight(Q.Q4_K, 8, 256, seed=1)
    with pytest.raises(UnsupportedWeightType, match="IQ2_XXS"):
        BlockWeight(w.data, Q.IQ2_XXS, 256)
    with pytest.raises(ValueError, match="bytes per row"):
        BlockWeight(w.data, Q.Q6_K, 256)
    with pytest.raises(ValueError, match="same in_features"):
        BlocksLinear([w, _weight(Q.Q8_0, 8, 512, seed=2)[0]])
    with pytest.raises(RuntimeError, match="in_features"):
        ops.gguf_linear(torch.randn(2, 128), [w.data], [int(Q.Q4_K)], None)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        ops.gguf_linear(torch.randn(2, 256), [w.data], [int(Q.IQ2_XXS)], None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.gguf_linear(torch.randn(2, 256), [w.data], [int(Q.Q4_K)], torch.randn(9))


def test_float_tensors_are_kept_in_their_dtype():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        t = torch.randn(24, 64).to(dtype)
        w = BlockWeight.from_tensor(t)
        assert w.nbytes == t.numel() * t.element_size()
        assert torch.equal(w.dequantize(), t.float())
        x = torch.randn(5, 64)
        _close(BlocksLinear([w])(x), x, t.float().numpy())


# ---- the gguf mode: the blocks times int8 activations ------------------------------

# x is quantized per group of 32 inputs, or of 256 for the types with their own K-quant
# kernels (llama.cpp's Q8_K).
INT8_GROUP = {Q.Q4_K: 256, Q.Q6_K: 256}


def _quantized_x(x: torch.Tensor, group: int) -> torch.Tensor:
    """x with each group rounded to int8 of scale max|x| / 127 (ties to even), as floats."""
    g = x.reshape(x.shape[0], -1, group)
    d = g.abs().amax(-1, keepdim=True) / 127
    return (torch.round(g / torch.where(d > 0, d, torch.ones_like(d))) * d).reshape(x.shape)


@pytest.mark.parametrize("ggml_type", [t for t in TYPES if t not in (Q.F32, Q.F16, Q.BF16)], ids=lambda t: t.name)
def test_int8_linear_is_the_product_with_quantized_activations(ggml_type):
    """Integer dot products are exact, so the result is W x' for the quantized x' up to
    float32 rounding, and a row's result does not depend on its step."""
    w, ref = _weight(ggml_type, 21, 512, seed=200 + ggml_type.value)
    layer = BlocksLinear([w])
    layer.int8_activations = True
    g = torch.Generator().manual_seed(ggml_type.value)
    x = torch.randn(300, 512, generator=g)
    y = layer(x)
    _close(y, _quantized_x(x, INT8_GROUP.get(ggml_type, 32)), ref)
    # 1-2 rows of the 32-weight types read the blocks directly (int8_dot32), more
    # decode rows first (int8_dot): the same bits.
    for rows in (1, 2, 3, 17, 64, 65):
        assert torch.equal(layer(x[:rows]), y[:rows])
    assert torch.equal(layer(x[150:151])[0], y[150])
    assert torch.equal(layer(x[150:152]), y[150:152])


@pytest.mark.parametrize("ggml_type", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_k_quant_panel_kernels_give_the_one_channel_kernels_bits(ggml_type, monkeypatch):
    """On AVX2 (PAGODA_CPU_ISA=avx2 on any CPU), steps of 8 rows or more multiply panels
    of 8 channels (the channels in the lanes, int16 sums per sub-block), fewer rows one
    channel at a time: the same integers per block and the same float32 operations, so
    a row's bits are those of the row alone, for long rows, channel counts that leave
    single channels after the panels, stacked parts of both types with a bias, extreme
    activations, and one thread or two."""
    monkeypatch.setenv("PAGODA_CPU_ISA", "avx2")
    threads = torch.get_num_threads()
    try:
        for cols, rows_w in ((256, (37, 8)), (2048, (24, 5)), (8192, (9, 16))):
            rng = np.random.default_rng(cols + ggml_type.value)
            other = Q.Q6_K if ggml_type == Q.Q4_K else Q.Q4_K
            ws = [torch.from_numpy(random_blocks(t, n, cols, rng)) for t, n in zip((ggml_type, other), rows_w)]
            ts = [ggml_type.value, other.value]
            q6 = ws[ts.index(Q.Q6_K.value)].view(-1, cols // 256, 210)
            # Q6_K channels of all -32 and all 31 at full-scale sub-block scales: with x's
            # rows of all +127 / -127 below, the panels' int16 sums at their extremes.
            q6[0, :, :192], q6[0, :, 192:208] = 0, 127
            q6[1, :, :192], q6[1, :, 192:208] = 0xFF, 0x80
            bias = torch.randn(sum(rows_w), generator=torch.Generator().manual_seed(cols))
            x = torch.randn(70, cols, generator=torch.Generator().manual_seed(cols)) * 3
            x[3, :256] = 0.0  # a block of zeros: scale 0
            x[5, 7] = 1e4  # one outlier: the rest of its block rounds to small integers
            x[6], x[9] = 2.0, -2.0  # every input +127 / -127
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                for parts, types, b in ((ws, ts, bias), (ws[:1], ts[:1], None)):
                    alone = torch.cat([ops.gguf_linear_int8(x[i : i + 1], parts, types, b) for i in range(70)])
                    for rows in (7, 8, 9, 23, 64, 70):
                        got = ops.gguf_linear_int8(x[:rows], parts, types, b)
                        assert torch.equal(got.view(torch.int32), alone[:rows].view(torch.int32)), (cols, rows, n_threads)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("ggml_type", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_k_quant_one_row_kernel_gives_the_per_channel_bits(ggml_type):
    """Up to 7 rows (decode steps of a few streams, an expert's few tokens) multiply 8
    channels at a time, 1-4 rows a pass, their integer sums reduced together and the float32
    operations in the lanes (Q4_K at 4 and 5 rows one channel at a time). A row's bits are the
    same in every step: rows longer than the kernel's blocks at a time (32 / rows), channel
    counts that leave single channels, stacked parts of both types with a bias, one thread
    or two."""
    threads = torch.get_num_threads()
    try:
        for cols, rows_w in ((2048, (19, 8)), (33 * 256, (11, 3))):
            rng = np.random.default_rng(cols + 7 * ggml_type.value)
            other = Q.Q6_K if ggml_type == Q.Q4_K else Q.Q4_K
            ws = [torch.from_numpy(random_blocks(t, n, cols, rng)) for t, n in zip((ggml_type, other), rows_w)]
            ts = [ggml_type.value, other.value]
            bias = torch.randn(sum(rows_w), generator=torch.Generator().manual_seed(cols))
            x = torch.randn(7, cols, generator=torch.Generator().manual_seed(cols + 1)) * 3
            x[1, 256:512] = 0.0  # a block of zeros: scale 0
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                for parts, types, b in ((ws, ts, bias), (ws[:1], ts[:1], None)):
                    together = ops.gguf_linear_int8(x, parts, types, b)
                    alone = torch.cat([ops.gguf_linear_int8(x[i : i + 1], parts, types, b) for i in range(7)])
                    for rows in range(2, 8):
                        got = ops.gguf_linear_int8(x[7 - rows:], parts, types, b)
                        assert torch.equal(got.view(torch.int32), alone[7 - rows:].view(torch.int32)), (cols, rows)
                    ref = x @ torch.cat([ops.gguf_dequantize(p, t, cols, None) for p, t in zip(parts, types)]).T
                    ref = ref if b is None else ref + b
                    assert (together - ref).abs().max() <= 0.02 * ref.abs().max()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(ops is None or not ops.avx512_enabled(), reason="needs a CPU with AVX-512 VNNI")
@pytest.mark.parametrize("ggml_type", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_k_quant_vnni_kernels_give_the_avx2_kernels_bits(ggml_type, monkeypatch):
    """From 8 rows the K-quant products run 16 rows at a time on AVX-512 VNNI, and 2-7 rows
    sum their products with vpdpwssd; the same step through the AVX2 kernels
    (PAGODA_CPU_ISA=avx2, read at every call) gives the same bits: the same integers per
    block, the same float32 operations."""
    w, ref = _weight(ggml_type, 37, 768, seed=300 + ggml_type.value)  # 4 panels of 8, then single channels
    bias = torch.randn(37, generator=torch.Generator().manual_seed(1))
    layer = BlocksLinear([w], bias=bias)
    layer.int8_activations = True
    x = torch.randn(130, 768, generator=torch.Generator().manual_seed(2)) * 3
    for rows in (1, 2, 3, 4, 7, 8, 16, 23, 64, 130):
        monkeypatch.delenv("PAGODA_CPU_ISA", raising=False)
        vnni = layer(x[:rows])
        monkeypatch.setenv("PAGODA_CPU_ISA", "avx2")
        avx2 = layer(x[:rows])
        assert torch.equal(vnni, avx2), rows
    _close(vnni - bias, _quantized_x(x, 256), ref)


def test_int8_linear_refuses_float_weights():
    t = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="quantized blocks"):
        ops.gguf_linear_int8(torch.randn(2, 64), [BlockWeight.from_tensor(t).data], [int(Q.F32)], None)


# ---- pages of file-mapped weights ------------------------------------------------------

def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_drop_pages_releases_a_mapped_weight_and_keeps_its_values(tmp_path):
    """The int8 / q4 modes drop each converted layer's pages of the file map: RSS falls by
    the weight's size, and the weight still reads the file's bytes (refaulted)."""
    rows, cols = 2048, 1024  # 8 MiB of float32
    values = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    path = tmp_path / "w.bin"
    values.tofile(path)
    view = np.memmap(path, dtype=np.uint8, mode="c").reshape(rows, cols * 4)
    w = BlockWeight(torch.from_numpy(np.asarray(view)), Q.F32, cols, file_mapped=True)
    assert torch.equal(w.dequantize(), torch.from_numpy(values))  # every page resident now
    before = _rss_bytes()
    w.drop_pages()
    assert before - _rss_bytes() > 6 << 20
    assert torch.equal(w.dequantize(), torch.from_numpy(values))


def test_drop_pages_leaves_memory_that_is_not_a_file_map_alone():
    t = torch.randn(64, 64)
    w = BlockWeight.from_tensor(t)
    w.drop_pages()  # not file-mapped: must not zero anonymous memory
    assert torch.equal(w.dequantize(), t)


def test_int8_mode_quantizes_blocks_a_block_of_rows_at_a_time(monkeypatch):
    """The int8 mode converts a kept layer from blocks of rows dequantized afresh (no float
    copy of the whole weight): the int8 weights, scales and float outlier columns are those
    of the whole dequantized weight quantized at once, rows crossing the parts' boundary."""
    from pagoda.model.layers import quantization as qz

    monkeypatch.setattr(qz, "QUANTIZE_ROWS", 7)   # blocks of 7 rows over 19 + 12 channels
    parts = [_weight(Q.Q4_K, 19, 512, seed=1)[0], _weight(Q.Q8_0, 12, 512, seed=2)[0]]
    layer = BlocksLinear(parts, bias=torch.randn(31, generator=torch.Generator().manual_seed(0)))
    idx = torch.tensor([3, 200, 511, 64])
    got = qz.Int8Linear(layer, idx)

    whole = layer.dequantized()
    assert torch.equal(torch.cat([layer.dequantized_rows(r, min(r + 5, 31)) for r in range(0, 31, 5)]), whole)
    order = idx.sort().values
    outliers = whole[:, order].t().contiguous()
    inliers = whole.clone()
    inliers[:, order] = 0.0
    qweight, scales = qz.int8_per_channel(inliers)
    assert torch.equal(got.int8_weight(), qweight)
    assert torch.equal(got.weight_scale, scales)
    assert torch.equal(got.outlier_weight, outliers)
    assert torch.equal(got.outlier_idx, order)
    assert torch.equal(got.bias, layer.bias)
    # And the same layer as the float nn.Linear the conversion used to take.
    lin = torch.nn.Linear(512, 31)
    with torch.no_grad():
        lin.weight.copy_(whole)
        lin.bias.copy_(layer.bias)
    from_float = qz.Int8Linear(lin, idx)
    assert torch.equal(from_float.int8_weight(), qweight) and torch.equal(from_float.weight_scale, scales)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    assert torch.equal(got(x), from_float(x))


# ---- K-quants repacked with 16 channels in the lanes (the gguf mode on AVX-512 VNNI) ----
vnni_only = pytest.mark.skipif(ops is None or not ops.avx512_enabled(), reason="needs a CPU with AVX-512 VNNI")
X16 = {Q.Q4_K: 204, Q.Q6_K: 205, Q.Q4_0: 206, Q.Q4_1: 207, Q.Q8_0: 208}
X16.update({Q.IQ4_NL: 209, Q.MXFP4: 210, Q.Q5_K: 211, Q.Q3_K: 212, Q.Q2_K: 213, Q.Q5_0: 214, Q.Q5_1: 215, Q.IQ4_XS: 216})
X32_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4]
# The repacked types that take x in groups of 256 (llama.cpp's Q8_K) where their plain
# kernels take groups of 32.
Q8K_TYPES = (Q.Q5_K, Q.Q3_K, Q.Q2_K)
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Repacked bytes per channel and block, where they differ from the plain type's.
X16_BYTES = {Q.Q4_K: 148, Q.Q5_K: 180, Q.Q3_K: 114, Q.IQ4_XS: 138}
# Types of 256-weight blocks.
BLOCKS256 = (*K_QUANTS, Q.IQ4_XS)


@pytest.mark.parametrize("ggml_type", list(X16), ids=lambda t: t.name)
def test_repacked_blocks_hold_the_same_weights(ggml_type):
    """gguf_repack_x16 rearranges 16 channels' blocks (any CPU): each channel reads back as
    its own blocks (the dequantized values of every row, and of rows picked by index)."""
    rng = np.random.default_rng(ggml_type.value)
    block = 256 if ggml_type in BLOCKS256 else 32
    for rows, cols in ((16, block), (48, 2048), (32, 33 * block)):
        raw = torch.from_numpy(random_blocks(ggml_type, rows, cols, rng))
        packed = ops.gguf_repack_x16(raw, ggml_type.value, cols)
        assert packed.shape == ((rows, cols // block * X16_BYTES[ggml_type]) if ggml_type in X16_BYTES else raw.shape)
        plain = ops.gguf_dequantize(raw, ggml_type.value, cols, None)
        assert torch.equal(ops.gguf_dequantize(packed, X16[ggml_type], cols, None), plain)
        idx = torch.tensor([rows - 1, 0, 5, 15])
        assert torch.equal(ops.gguf_dequantize(packed, X16[ggml_type], cols, idx), plain[idx])
    with pytest.raises(RuntimeError, match="multiple of 16 channels"):
        ops.gguf_repack_x16(torch.from_numpy(random_blocks(ggml_type, 24, 256, rng)), ggml_type.value, 256)
    with pytest.raises(RuntimeError, match="only Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, "
                       "IQ4_XS and MXFP4"):
        ops.gguf_repack_x16(torch.from_numpy(random_blocks(Q.F16, 16, 256, rng)), Q.F16.value, 256)


def _x16_case(ggml_type, rows_w, cols, rng, rows_x):
    """A Q4_K / Q6_K weight (its first channels at the extremes: Q6_K values of -32 / 31
    under scales of 127 / -128, Q4_K nibbles of 15 under scales and minimums of 63), it
    repacked, a Q8_0 part to stack after it, a bias, and rows_x rows of x with a block of
    zeros and full-scale rows: (raw, packed, other, bias, x)."""
    raw = torch.from_numpy(random_blocks(ggml_type, rows_w, cols, rng))
    if ggml_type == Q.Q6_K:
        q6 = raw.view(rows_w, -1, 210)
        q6[0, :, :192], q6[0, :, 192:208] = 0, 127
        q6[1, :, :192], q6[1, :, 192:208] = 0xFF, 0x80
    else:
        q4 = raw.view(rows_w, -1, 144)
        q4[0, :, 4:16], q4[0, :, 16:] = 0xFF, 0xFF
    return _lanes_case(ggml_type, raw, cols, rng, rows_x, Q.Q8_0, 8, 256)


def _lanes_case(ggml_type, raw, cols, rng, rows_x, other_type, other_rows, zeros):
    """raw repacked, other_rows channels of other_type to stack after it, a bias, and rows_x
    rows of x (row 1's first `zeros` inputs zero, rows 6 and 9 at full scale): (raw, packed,
    other, bias, x)."""
    packed = ops.gguf_repack_x16(raw, ggml_type.value, cols)
    other = torch.from_numpy(random_blocks(other_type, other_rows, cols, rng))
    bias = torch.randn(raw.shape[0] + other_rows, generator=torch.Generator().manual_seed(cols))
    x = torch.randn(rows_x, cols, generator=torch.Generator().manual_seed(cols + 1)) * 3
    x[1, :zeros] = 0.0
    x[6], x[9] = 2.0, -2.0
    return raw, packed, other, bias, x


@vnni_only
@pytest.mark.parametrize("ggml_type", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_repacked_k_quant_kernels_give_the_k_quant_kernels_bits(ggml_type):
    """The repacked layout's kernel (16 channels in the lanes, 1-4 rows a pass) computes the
    same integers per block and the same float32 operations as the Q4_K / Q6_K kernels of
    every step size: the same bits, for long rows, a block of zeros, full-scale inputs,
    weights at their extremes, a bias, stacked parts of both layouts, one thread or two."""
    threads = torch.get_num_threads()
    try:
        rng = np.random.default_rng(40 + ggml_type.value)
        for rows_w, cols in ((32, 256), (48, 2048), (16, 33 * 256)):
            raw, packed, other, bias, x = _x16_case(ggml_type, rows_w, cols, rng, 40)
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                for rows in (*range(1, 10), 16, 17, 23, 40):
                    plain = ops.gguf_linear_int8(x[:rows], [raw, other], [ggml_type.value, Q.Q8_0.value], bias)
                    lanes = ops.gguf_linear_int8(x[:rows], [packed, other], [X16[ggml_type], Q.Q8_0.value], bias)
                    assert torch.equal(lanes.view(torch.int32), plain.view(torch.int32)), (cols, rows, n_threads)
    finally:
        torch.set_num_threads(threads)


amx_only = pytest.mark.skipif(ops is None or not hasattr(ops, "amx_enabled") or not ops.amx_enabled(),
                              reason="needs a CPU with AMX int8 tiles")


def _x32_case(ggml_type, rows_w, cols, rng, rows_x):
    """A weight of a repacked type but Q4_K / Q6_K (its first channels at the extremes: the
    largest and smallest values under a large scale), it repacked, a Q4_K part
    (Q8_0 where the columns are not whole Q4_K blocks) to stack after it, a bias, and rows_x
    rows of x with a block of zeros and full-scale rows: (raw, packed, other, bias, x)."""
    raw = torch.from_numpy(random_blocks(ggml_type, rows_w, cols, rng))
    nbytes = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q5_1: 24, Q.Q8_0: 34, Q.IQ4_NL: 18, Q.IQ4_XS: 136, Q.MXFP4: 17,
              Q.Q5_K: 176, Q.Q3_K: 110, Q.Q2_K: 84}[ggml_type]
    blocks = raw.view(rows_w, -1, nbytes)
    if ggml_type == Q.Q5_K:   # scales and minimums of 63 and values of 31; values of 0
        blocks[0, :, 4:], blocks[1, :, 16:] = 0xFF, 0
        return _lanes_case(ggml_type, raw, cols, rng, rows_x, Q.Q4_K, 16, 64)
    if ggml_type == Q.Q3_K:   # values of 3 under scales of 31; values of -4 under scales of -32
        blocks[0, :, :108], blocks[1, :, :108] = 0xFF, 0
        return _lanes_case(ggml_type, raw, cols, rng, rows_x, Q.Q4_K, 16, 64)
    if ggml_type == Q.Q2_K:   # values of 3 under scales and minimums of 15; values of 0, minimums of 0
        blocks[0, :, :80], blocks[1, :, :16], blocks[1, :, 16:80] = 0xFF, 0x0F, 0
        return _lanes_case(ggml_type, raw, cols, rng, rows_x, Q.Q4_K, 16, 64)
    values = {Q.Q4_1: 4, Q.Q5_1: 4, Q.MXFP4: 1}.get(ggml_type, 2)
    # a large scale: float16 256.0, or E8M0 2^8 (halved, as the values are doubled)
    big = torch.tensor([0x89] if ggml_type == Q.MXFP4 else [0x00, 0x5C], dtype=torch.uint8)
    blocks[0, :, :values] = blocks[1, :, :values] = big if values != 4 else torch.tensor([0, 0x5C, 0, 0x5C])
    blocks[0, :, values:] = 0x7F if ggml_type == Q.Q8_0 else 0xFF if ggml_type != Q.MXFP4 else 0x77   # largest
    blocks[1, :, values:] = 0x80 if ggml_type == Q.Q8_0 else 0x00 if ggml_type != Q.MXFP4 else 0xFF   # smallest
    return _lanes_case(ggml_type, raw, cols, rng, rows_x, Q.Q4_K if cols % 256 == 0 else Q.Q8_0, 16, 64)


@vnni_only
@pytest.mark.parametrize("ggml_type", [*X32_TYPES, *Q8K_TYPES], ids=lambda t: t.name)
def test_repacked_32_weight_kernels_multiply_quantized_x_the_same_at_every_step(ggml_type):
    """The repacked 32-weight layouts' kernel (16 channels in the lanes, each block's
    integer sum whole, then one float32 step a block) gives the plain layout's kernel's
    products (W x' for the int8 x': the same integers, float32 sums in another order), and
    a row's bits do not depend on its step (1-40 rows, long rows, a block of zeros,
    full-scale inputs, weights at their extremes, a bias, stacked with a repacked Q4_K part,
    one thread or two). Q5_K, Q3_K and Q2_K take x in groups of 256 (llama.cpp's Q8_K; their plain
    kernels take groups of 32): against W x' for that x'."""
    threads = torch.get_num_threads()
    try:
        rng = np.random.default_rng(90 + ggml_type.value)
        for rows_w, cols in ((32, 256), (48, 2048), (16, 33 * 32 * 8)):
            raw, packed, other, bias, x = _x32_case(ggml_type, rows_w, cols, rng, 40)
            packed_k = ops.gguf_repack_x16(other, Q.Q4_K.value, cols)
            whole = ops.gguf_linear_int8(x, [packed, packed_k], [X16[ggml_type], X16[Q.Q4_K]], bias)
            plain = ops.gguf_linear_int8(x, [raw, other], [ggml_type.value, Q.Q4_K.value], bias)
            w = ops.gguf_dequantize(raw, ggml_type.value, cols, None)
            if ggml_type in Q8K_TYPES:
                _close(whole[:, :rows_w], _quantized_x(x, 256), w.numpy(), bias[:rows_w])
            else:   # float32 sums of the same integer products: within float32 rounding of |W| |x'|
                tol = 8 * cols ** 0.5 * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().T) + 1e-6
                assert bool(((whole[:, :rows_w] - plain[:, :rows_w]).abs() <= tol).all())
            assert torch.equal(whole[:, rows_w:], plain[:, rows_w:])    # the Q4_K part: its own bits
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                for rows in (*range(1, 10), 16, 17, 23, 40):
                    got = ops.gguf_linear_int8(x[:rows], [packed, packed_k], [X16[ggml_type], X16[Q.Q4_K]], bias)
                    assert torch.equal(got.view(torch.int32), whole[:rows].view(torch.int32)), (cols, rows, n_threads)
                last = ops.gguf_linear_int8(x[39:], [packed, packed_k], [X16[ggml_type], X16[Q.Q4_K]], bias)
                assert torch.equal(last, whole[39:])
    finally:
        torch.set_num_threads(threads)


@amx_only
@pytest.mark.parametrize("ggml_type", list(X16), ids=lambda t: t.name)
def test_amx_tiles_give_the_vnni_kernels_bits(ggml_type, monkeypatch):
    """On AMX CPUs steps of 16+ rows multiply the repacked parts on int8 tiles (the K-quants
    with their scales folded into the weights; the 32-weight types a tile product a block,
    signed values against x, Q4_1's unsigned): the same integers and float32 operations as
    the VNNI kernels (PAGODA_CPU_ISA=avx512), so the same bits: whole and partial groups of 16
    rows, steps past one unit's 512 rows, an odd count of 32-weight blocks, extreme values, a
    bias, stacked parts, one thread or two."""
    threads = torch.get_num_threads()
    k_quant = ggml_type in (Q.Q4_K, Q.Q6_K)
    try:
        rng = np.random.default_rng(70 + ggml_type.value)
        for rows_w, cols in ((32, 256), (48, 7 * 256 if ggml_type in BLOCKS256 else 57 * 32)):
            case = _x16_case if k_quant else _x32_case
            _, packed, other, bias, x = case(ggml_type, rows_w, cols, rng, 600)
            other_type = Q.Q8_0 if k_quant or cols % 256 else Q.Q4_K
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                for rows in (16, 17, 31, 32, 100, 600):
                    args = (x[:rows], [packed, other], [X16[ggml_type], other_type.value], bias)
                    monkeypatch.setenv("PAGODA_CPU_ISA", "avx512")
                    assert not ops.amx_enabled()
                    vnni = ops.gguf_linear_int8(*args)
                    monkeypatch.delenv("PAGODA_CPU_ISA")
                    tiles = ops.gguf_linear_int8(*args)
                    assert torch.equal(tiles.view(torch.int32), vnni.view(torch.int32)), (cols, rows, n_threads)
    finally:
        torch.set_num_threads(threads)


@vnni_only
def test_blocks_linear_repacks_for_the_gguf_mode_only():
    """repack_for_lanes swaps the parts of 16-channel multiples for their repacked layout
    and leaves the rest; the K-quants' results keep their bits, the 32-weight types' within
    float32 rounding; the exact mode refuses the layout by name."""
    parts = [_weight(Q.Q4_K, 32, 512, seed=1)[0], _weight(Q.Q6_K, 16, 512, seed=2)[0],
             _weight(Q.Q4_K, 8, 512, seed=3)[0], _weight(Q.Q5_0, 16, 512, seed=4)[0],
             _weight(Q.Q8_0, 16, 512, seed=5)[0], _weight(Q.Q4_0, 8, 512, seed=6)[0]]
    layer = BlocksLinear(parts)
    with pytest.raises(RuntimeError, match="gguf mode"):
        layer.repack_for_lanes()
    layer.int8_activations = True
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(5))
    before = layer(x)
    assert layer.repack_for_lanes() == 4
    assert [p.ggml_type.name for p in layer.parts] == ["Q4_K_X16", "Q6_K_X16", "Q4_K", "Q5_0_X16", "Q8_0_X16", "Q4_0"]
    after = layer(x)
    blocks32 = slice(56, 88)   # the Q5_0 and Q8_0 parts
    assert torch.equal(after[:, :56], before[:, :56]) and torch.equal(after[:, 88:], before[:, 88:])
    assert torch.allclose(after[:, blocks32], before[:, blocks32], rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.dequantized(), torch.cat([p.dequantize() for p in parts]))
    with pytest.raises(RuntimeError, match="gguf mode only"):
        ops.gguf_linear(x, layer._data, layer._types, None)
