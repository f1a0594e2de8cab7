"""pagoda.ops.triton_attention against a plain-torch float64 reference.

Without a GPU the kernels run under the Triton interpreter on CPU tensors: TRITON_INTERPRET
must be set before the module defines its kernels (triton reads it when @triton.jit runs),
hence the environment line above every import. Shapes are tiny: the interpreter is slow.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402

from pagoda.attention.kv_quant import QuantizedKVCache  # noqa: E402
from pagoda.ops import triton_attention as ta  # noqa: E402

if ta.interpreted():
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:  # pragma: no cover
    pytest.skip("pagoda.ops.triton_attention defined its kernels without the Triton interpreter (imported "
                "before TRITON_INTERPRET=1 was set, or with it 0) and there is no CUDA device to run them",
                allow_module_level=True)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Helpers


def _paged_cache(gen, seq_lens, *, block_size, kvh, d, dtype, extra_blocks=3, nan_before=None):
    """A cache whose live slots (keys 0..seq_len-1 of each sequence, through a block table of
    shuffled physical blocks) hold random values and every other slot NaN (as do the block
    table's padding entries' blocks), so a kernel reading anything it should not shows up.
    ``nan_before[i]``: keys of sequence i before this index are NaN too (skipped window keys)."""
    pages = [-(-int(s) // block_size) for s in seq_lens]
    max_blocks = max(max(pages), 1) + 2
    num_blocks = sum(pages) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    spare = perm[-1]  # never live: padding entries point here
    bt = torch.full((len(seq_lens), max_blocks), int(spare), dtype=torch.int32)
    cache = torch.full((2, num_blocks, block_size, kvh, d), float("nan"), dtype=torch.float32)
    c = 0
    for i, (s, n) in enumerate(zip(seq_lens, pages)):
        bt[i, :n] = perm[c:c + n]
        c += n
        j = torch.arange(int(s))
        if nan_before is not None:
            j = j[j >= nan_before[i]]
        blk, off = bt[i, j // block_size].long(), j % block_size
        cache[:, blk, off] = torch.randn(2, len(j), kvh, d, generator=gen)
    return cache.to(dtype), bt


def _gather(cache, scales, bt, i, L):
    """Keys and values 0..L-1 of sequence i in float64 [L, KVH, D], dequantized."""
    bs = cache.shape[2]
    j = torch.arange(L)
    blk, off = bt[i, j // bs].long(), j % bs
    kv = cache[:, blk, off]
    if kv.dtype == torch.uint8:
        kv = kv.view(torch.float8_e4m3fn)
    kv = kv.double()
    if scales is not None:
        kv = kv * scales[:, blk, off].double()[..., None]
    return kv[0], kv[1]


def _reference(q, cache, bt, qsl, seq_lens, scale, *, window=0, softcap=0.0, sinks=None, scales=None):
    """Attention in float64: request i's rows qsl[i]:qsl[i+1] sit at the last positions of its
    seq_lens[i] keys; causal, optional sliding window, softcap and sink logits."""
    q, cache, bt, qsl, seq_lens = (x.cpu() for x in (q, cache, bt, qsl, seq_lens))
    scales = None if scales is None else scales.cpu()
    H = q.shape[1]
    G = H // cache.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(len(seq_lens)):
        L, a, b = int(seq_lens[i]), int(qsl[i]), int(qsl[i + 1])
        if L == 0 or a == b:
            continue
        K, V = _gather(cache, scales, bt, i, L)
        K, V = K.repeat_interleave(G, 1), V.repeat_interleave(G, 1)    # [L, H, D]
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), K) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        pos = L - (b - a) + torch.arange(b - a)
        j = torch.arange(L)
        vis = j[None, :] <= pos[:, None]
        if window > 0:
            vis &= j[None, :] > pos[:, None] - window
        s = s.masked_fill(~vis, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.cpu().double()[:, None, None].expand(H, b - a, 1)], -1)
        p = torch.softmax(s, -1)[..., :L]
        out[a:b] = torch.einsum("hqk,khd->qhd", p, torch.where(vis.any(0)[:, None, None], V, 0).nan_to_num(0.0))
    return out


def _close(out, ref, tol):
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)


def _quantized(cache, kind):
    """The same contents in an 8-bit cache written by QuantizedKVCache (live slots only)."""
    _, nb, bs, kvh, d = cache.shape
    qc = QuantizedKVCache(nb, bs, kvh, d, torch.int8 if kind == "int8" else torch.float8_e4m3fn, "cpu")
    qc.data.zero_()
    qc.scales.zero_()
    flat = cache.view(2, -1, kvh, d)
    live = torch.nonzero(~torch.isnan(flat[0, :, 0, 0])).flatten()
    qc.write(live, flat[0, live], flat[1, live])
    return qc.data, qc.scales


def _to(*xs):
    return [None if x is None else x.to(DEVICE) for x in xs]


# ---------------------------------------------------------------------------------------------
# store_kv


@pytest.mark.parametrize("dtype,slot_dtype", [(torch.float32, torch.int64), (torch.float16, torch.int32)])
def test_store_kv_skips_padding_and_leaves_other_slots(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(1)
    nb, bs, kvh, d = 5, 4, 3, 80
    cache = torch.randn(2, nb, bs, kvh, d, generator=gen).to(dtype)
    # k, v as strided views of one fused buffer (T, 2, KVH, D) in float32: converted like torch
    kv = torch.randn(6, 2, kvh, d, generator=gen)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.tensor([7, -1, 0, 19, -1, 12], dtype=slot_dtype)
    expected = cache.clone()
    ok = slots >= 0
    for i in (0, 1):
        expected[i].view(-1, kvh, d)[slots[ok].long()] = kv[ok, i].to(dtype)
    cache, k, v, slots = _to(cache, k, v, slots)
    ta.store_kv(k, v, cache, slots)
    assert torch.equal(cache.cpu(), expected)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_store_kv_8bit_matches_quantized_cache(kind):
    gen = torch.Generator().manual_seed(2)
    nb, bs, kvh, d = 6, 4, 2, 64
    T = 9
    k = torch.randn(T, kvh, d, generator=gen) * 3
    v = torch.randn(T, kvh, d, generator=gen)
    # magnitudes over many octaves (fp8 subnormals), a zero vector (the 1e-12 clamp),
    # and exact .5 ties for int8 (absmax 127 gives scale 1): round half to even
    k[1, 0] = torch.exp(torch.linspace(-14.0, 3.0, d)) * torch.where(torch.arange(d) % 2 == 0, 1.0, -1.0)
    k[2, 1] = 0.0
    v[3, 0] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5] * (d // 8))
    k[4] = k[4].half().float()
    # absmax 448 gives scale 1 for fp8: exact ties between e4m3 neighbours (normal and
    # subnormal), which round to the even mantissa
    ties = torch.tensor([448.0, 1.0625, 1.1875, -1.3125, 3 * 2**-10, 2**-10, -5 * 2**-10, 13.0, 208.0, -240.0])
    k[5, 1] = torch.cat([ties, torch.zeros(d - len(ties))])
    slots = torch.tensor([3, 22, -1, 0, 9, 17, -1, 14, 5])
    ok = slots >= 0
    ref = QuantizedKVCache(nb, bs, kvh, d, torch.int8 if kind == "int8" else torch.float8_e4m3fn, "cpu")
    ref.data.copy_(torch.randint(-100, 100, ref.data.shape, generator=gen).to(ref.data.dtype))
    ref.scales.copy_(torch.rand(ref.scales.shape, generator=gen))
    data, scales = ref.data.clone(), ref.scales.clone()
    ref.write(slots[ok], k[ok], v[ok])
    data, scales, kk, vv, ss = _to(data, scales, k, v, slots.to(torch.int32))
    ta.store_kv(kk, vv, data, ss, scales=scales)
    assert torch.equal(data.cpu(), ref.data)
    assert torch.equal(scales.cpu(), ref.scales)


# ---------------------------------------------------------------------------------------------
# paged_decode


def test_paged_decode_fp8_decodes_every_byte():
    """One key per sequence: the output is that key's value, so every float8_e4m3fn byte
    (NaN codes included) must read back as torch reads it."""
    d = 64
    cache = torch.zeros(2, 4, 1, 1, d, dtype=torch.uint8)
    cache[1] = torch.arange(256, dtype=torch.uint8).view(4, 1, 1, d)
    scales = torch.ones(2, 4, 1, 1)
    bt = torch.tensor([[2], [0], [3], [1]], dtype=torch.int32)
    q = torch.randn(4, 2, d, generator=torch.Generator().manual_seed(6))
    sl = torch.ones(4, dtype=torch.int32)
    expected = cache[1, bt[:, 0].long(), 0].view(torch.float8_e4m3fn).float().expand(4, 2, d)
    q, cache, bt, sl, scales = _to(q, cache, bt, sl, scales)
    out = ta.paged_decode(q, cache, bt, sl, 1.0, scales=scales)
    torch.testing.assert_close(out.cpu(), expected, atol=0, rtol=0, equal_nan=True)

# bfloat16 (an 8-bit mantissa: its output alone rounds by up to 2^-9 of the value) runs in the
# interpreter with float32 products (ta._half_dot), on a GPU with bfloat16 ones.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

DECODE_CASES = [
    # (dtype, kv heads, group, head_dim, block_size, window, softcap, sinks, splits, 8-bit)
    pytest.param(torch.float32, 2, 1, 64, 16, 0, 0.0, False, (1, 2, 3), None, id="f32-g1-d64"),
    pytest.param(torch.float32, 2, 3, 80, 4, 7, 3.0, True, (1, 3), None, id="f32-g3-d80-window-softcap-sinks"),
    pytest.param(torch.float32, 1, 8, 96, 32, 0, 0.0, True, (2,), None, id="f32-g8-d96-sinks"),
    pytest.param(torch.float16, 2, 4, 64, 16, 11, 0.0, False, (1, 3), None, id="f16-g4-window"),
    pytest.param(torch.bfloat16, 2, 2, 64, 16, 0, 4.0, True, (1, 3), None, id="bf16-g2-softcap-sinks"),
    pytest.param(torch.float32, 2, 2, 64, 16, 9, 0.0, True, (1, 3), "int8", id="int8-g2-window-sinks"),
    pytest.param(torch.float32, 1, 2, 80, 4, 0, 4.0, False, (2,), "fp8", id="fp8-g2-d80-softcap"),
]


@pytest.mark.parametrize("dtype,kvh,group,d,bs,window,softcap,use_sinks,splits,quant", DECODE_CASES)
def test_paged_decode(dtype, kvh, group, d, bs, window, softcap, use_sinks, splits, quant):
    gen = torch.Generator().manual_seed(3 + d + bs + group)
    seq_lens = [1, 0, 13, 70, 3, 0]  # 0: padded rows of a CUDA-graph batch
    H = kvh * group
    # decode never reads keys before the window: make them NaN
    nan_before = [max(0, s - window) for s in seq_lens] if window else None
    cache, bt = _paged_cache(gen, seq_lens, block_size=bs, kvh=kvh, d=d, dtype=dtype, nan_before=nan_before)
    scales = None
    if quant is not None:
        cache, scales = _quantized(cache, quant)
    q = (torch.randn(len(seq_lens), H, d, generator=gen) * 2).to(dtype)
    sinks = torch.randn(H, generator=gen) * 2 if use_sinks else None
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    scale = d**-0.5
    kw = dict(window=window, softcap=softcap, sinks=sinks, scales=scales)
    ref = _reference(q, cache, bt, torch.arange(len(seq_lens) + 1, dtype=torch.int32), sl, scale, **kw)
    tol = TOL[dtype]
    q, cache, bt, sl, sinks, scales = _to(q, cache, bt, sl, sinks, scales)
    kw.update(sinks=sinks, scales=scales)
    for n in splits:
        out = ta.paged_decode(q, cache, bt, sl, scale, num_splits=n, **kw)
        assert out.dtype == dtype and out.shape == q.shape
        _close(out, ref, tol)
        assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu()))
    # into a given buffer, with a caller-owned workspace (larger batch than needed, as a graph's)
    out = torch.full_like(q, float("nan"))
    ws = ta.decode_workspace(len(seq_lens) + 2, H, d, 3, DEVICE).fill_(float("nan"))
    res = ta.paged_decode(q, cache, bt, sl, scale, num_splits=3, out=out, workspace=ws, **kw)
    assert res is out
    _close(out, ref, tol)


def test_paged_decode_matches_extend_of_one_token():
    """Decode of sequence i equals extend with a one-token query at the same position; and
    splits that leave most ranges empty (short sequences, many splits) change nothing."""
    gen = torch.Generator().manual_seed(4)
    seq_lens = [2, 1, 5]
    cache, bt = _paged_cache(gen, seq_lens, block_size=4, kvh=2, d=64, dtype=torch.float32)
    q = torch.randn(3, 4, 64, generator=gen)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.arange(4, dtype=torch.int32)
    q, cache, bt, sl, qsl = _to(q, cache, bt, sl, qsl)
    dec = ta.paged_decode(q, cache, bt, sl, 0.3, num_splits=4)
    ext = ta.paged_extend(q, cache, bt, qsl, sl, 0.3, max_query_len=1)
    torch.testing.assert_close(dec, ext, atol=1e-6, rtol=1e-6)
    _close(dec, _reference(q, cache, bt, qsl, sl, 0.3), 1e-5)


# ---------------------------------------------------------------------------------------------
# paged_extend

EXTEND_CASES = [
    # (dtype, kv heads, group, head_dim, block_size, window, softcap, sinks, 8-bit)
    pytest.param(torch.float32, 2, 1, 256, 16, 0, 0.0, False, None, id="f32-g1-d256"),
    pytest.param(torch.float32, 2, 3, 80, 4, 10, 5.0, True, None, id="f32-g3-d80-window-softcap-sinks"),
    pytest.param(torch.float32, 1, 4, 96, 32, 0, 0.0, True, None, id="f32-g4-d96-sinks"),
    pytest.param(torch.float16, 2, 2, 64, 4, 6, 0.0, False, None, id="f16-g2-window"),
    pytest.param(torch.bfloat16, 2, 2, 64, 16, 0, 0.0, False, None, id="bf16-g2"),
    pytest.param(torch.float32, 1, 2, 64, 16, 0, 3.0, True, "int8", id="int8-g2-softcap-sinks"),
    pytest.param(torch.float32, 2, 1, 80, 4, 9, 0.0, False, "fp8", id="fp8-g1-d80-window"),
]


@pytest.mark.parametrize("dtype,kvh,group,d,bs,window,softcap,use_sinks,quant", EXTEND_CASES)
def test_paged_extend(dtype, kvh, group, d, bs, window, softcap, use_sinks, quant):
    gen = torch.Generator().manual_seed(5 + d + bs + group)
    # (context, query) per request: fresh prefill, empty query, short prefix, a prefix across
    # several pages, a single token (decode-like) and a long query
    ctx_q = [(0, 7), (5, 0), (3, 1), (45, 12), (9, 1), (2, 37)]
    seq_lens = [c + n for c, n in ctx_q]
    H = kvh * group
    cache, bt = _paged_cache(gen, seq_lens, block_size=bs, kvh=kvh, d=d, dtype=dtype)
    scales = None
    if quant is not None:
        cache, scales = _quantized(cache, quant)
    qlens = torch.tensor([n for _, n in ctx_q])
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), qlens.cumsum(0)]).to(torch.int32)
    T = int(qsl[-1])
    # q as a strided view (the query part of a fused qkv buffer)
    qkv = (torch.randn(T, H + 2, d, generator=gen) * 2).to(dtype)
    q = qkv[:, :H]
    sinks = torch.randn(H, generator=gen) * 2 if use_sinks else None
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    scale = d**-0.5
    kw = dict(window=window, softcap=softcap, sinks=sinks, scales=scales)
    ref = _reference(q, cache, bt, qsl, sl, scale, **kw)
    q, cache, bt, qsl, sl, sinks, scales = _to(q, cache, bt, qsl, sl, sinks, scales)
    kw.update(sinks=sinks, scales=scales)
    # max_query_len is an upper bound: programs past a request's rows exit
    out = ta.paged_extend(q, cache, bt, qsl, sl, scale, max_query_len=int(qlens.max()) + 5, **kw)
    assert out.dtype == dtype and out.shape == q.shape
    _close(out, ref, TOL[dtype])
