"""pagoda's fused Triton elementwise kernels (pagoda/ops/triton_elementwise.py) against the
plain-torch layers they replace: RMSNorm._norm (and its residual add), apply_rope, and the
gated MLP's silu/gelu-tanh times up.

Without a GPU they run in Triton's interpreter on CPU tensors; TRITON_INTERPRET must be set
before Triton is first imported (the kernels are built for one mode when the module is
imported). bfloat16 is not tested: the interpreter's bfloat16 is emulated."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before Triton (or pagoda's module) is imported

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from pagoda.model.layers.norm import RMSNorm  # noqa: E402
from pagoda.model.layers.rotary import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402
from pagoda.ops import triton_elementwise as te  # noqa: E402

if not te.INTERPRETED and not torch.cuda.is_available():
    pytest.skip("triton_elementwise was imported without TRITON_INTERPRET=1 (kernels built for "
                "the GPU) and there is no CUDA device: run this file on its own", allow_module_level=True)

DEVICE = "cpu" if te.INTERPRETED else "cuda"
# Bit-for-bit checks hold in the interpreter (numpy's float32, one op at a time); a GPU
# compiler may fuse multiply-adds and use approximate rsqrt/exp.
EXACT = te.INTERPRETED
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3)}
EPS = 1e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype).to(DEVICE)


def _torch_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], EPS).to(DEVICE)
    norm.weight.data = weight
    return norm._norm(x)


# --- rms_norm ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [64, 576])
def test_rms_norm_matches_rmsnorm(dtype, n):
    x = _randn(5, n, dtype=dtype, seed=1, scale=2.0)
    w = _randn(n, dtype=dtype, seed=2, scale=0.5) + 1
    y = te.rms_norm(x, w, EPS)
    ref = _torch_norm(x, w)
    assert y.dtype == ref.dtype == dtype and y.shape == (5, n)
    torch.testing.assert_close(y, ref, **TOL[dtype])
    # Not trivially equal: the norm changed the numbers, by a per-row factor.
    assert (y.float() - (x * w).float()).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_residual_adds_in_place(dtype):
    n = 576
    x = _randn(4, n, dtype=dtype, seed=3)
    r = _randn(4, n, dtype=dtype, seed=4, scale=3.0)
    w = _randn(n, dtype=dtype, seed=5, scale=0.5) + 1
    residual = r.clone()
    y, res_out = te.rms_norm(x, w, EPS, residual=residual)
    assert res_out is residual                       # the caller's tensor, updated in place
    expected_sum = r.clone().add_(x)                 # RMSNorm.forward: residual.add_(x)
    assert torch.equal(residual, expected_sum)       # the sum rounded once to dtype, like torch
    assert not torch.equal(residual, r)
    torch.testing.assert_close(y, _torch_norm(expected_sum, w), **TOL[dtype])
    assert x.equal(_randn(4, n, dtype=dtype, seed=3))   # x itself untouched


@pytest.mark.skipif(not EXACT, reason="bit-for-bit only in the interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_bit_exact_when_the_mean_is_exact(dtype):
    # Integer-valued rows: the sum of squares is exact in any order, so the only difference
    # left (the mean's summation order) is gone, and every later rounding is torch's.
    n = 576
    x = torch.randint(-8, 9, (6, n), generator=_gen(6)).to(dtype)
    r = torch.randint(-8, 9, (6, n), generator=_gen(7)).to(dtype)
    w = _randn(n, dtype=dtype, seed=8, scale=0.3) + 1
    assert torch.equal(te.rms_norm(x.to(DEVICE), w, EPS), _torch_norm(x.to(DEVICE), w))
    # Residual sums that float16 rounds (1030.5 -> 1030, ...) to integers: the norm must be
    # taken of the rounded sum, as RMSNorm's residual.add_ then _norm does.
    r[:, :4] = torch.tensor([1000.5, -1000.5, 900.5, 1020.5], dtype=dtype)
    x[:, :4] = torch.tensor([30.0, -41.0, 200.0, 5.0], dtype=dtype)
    x, r = x.to(DEVICE), r.to(DEVICE)
    if dtype == torch.float16:
        assert not torch.equal((r + x).float(), r.float() + x.float())   # the test rounds
    residual = r.clone()
    y, _ = te.rms_norm(x, w, EPS, residual=residual)
    assert torch.equal(residual, r + x)
    assert torch.equal(y, _torch_norm(r + x, w))


def test_rms_norm_float32_weight_gives_float32_like_torch():
    # torch: float32 weight * float16 x.to(float16) promotes to float32; the kernel does
    # the same: float32 output, the product of the float16-rounded norm and the weight.
    n = 320
    x = _randn(3, n, dtype=torch.float16, seed=9)
    w = _randn(n, seed=10, scale=0.5) + 1
    y = te.rms_norm(x, w, EPS)
    ref = _torch_norm(x, w)
    assert y.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-3, atol=1e-3)
    # The norm is rounded to float16 before the weight (as in torch): y / w is on the
    # float16 grid.
    ratio = (y / w).double()
    torch.testing.assert_close(ratio, ratio.half().double(), rtol=1e-6, atol=0.0)
    if EXACT:
        xi = torch.randint(-8, 9, (3, n), generator=_gen(11)).half()
        assert torch.equal(te.rms_norm(xi, w, EPS), _torch_norm(xi, w))


def test_rms_norm_into_out_buffer_with_strided_rows():
    n = 80
    wide = _randn(4, 2 * n, seed=12)
    x = wide[:, :n]                                  # row stride 2n, no copy
    w = _randn(n, seed=13) + 1
    buf = torch.full((4, n + 16), 7.0, device=DEVICE)
    out = buf[:, :n]
    y = te.rms_norm(x, w, EPS, out=out)
    assert y is out and y.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf[:, :n], _torch_norm(x.contiguous(), w), **TOL[torch.float32])
    assert bool((buf[:, n:] == 7.0).all())            # nothing written past the row
    empty = te.rms_norm(torch.empty(0, n, device=DEVICE), w, EPS)
    assert empty.shape == (0, n)


# --- rope -------------------------------------------------------------------------------


def _qkv(t, h, kvh, d, dtype, seed):
    qkv = _randn(t, (h + 2 * kvh) * d, dtype=dtype, seed=seed)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d: (h + kvh) * d].view(t, kvh, d)
    return qkv, q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d,rotary", [(64, 64), (80, 80), (80, 48)])
def test_rope_on_views_of_qkv_matches_apply_rope(dtype, d, rotary):
    t, h, kvh = 5, 4, 2
    qkv, q, k = _qkv(t, h, kvh, d, dtype, seed=20 + d + rotary)
    before = qkv.clone()
    positions = torch.tensor([0, 1, 7, 100, 4095], device=DEVICE)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(rotary, 10000.0, None).to(DEVICE), dtype)   # [T, 1, R]
    q_ref = apply_rope(q.clone(), cos, sin)
    k_ref = apply_rope(k.clone(), cos, sin)
    assert q.stride() == ((h + 2 * kvh) * d, d, 1)
    te.rope(q, k, cos[:, 0], sin[:, 0], rotary_dim=rotary if rotary != d else None)
    if EXACT and dtype == torch.float32:
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    else:
        torch.testing.assert_close(q, q_ref, **TOL[dtype])
        torch.testing.assert_close(k, k_ref, **TOL[dtype])
    if dtype == torch.float16:
        # One rounding from float32 (torch's float16 ops round three times): within half
        # an ulp of the float32 result.
        q32 = apply_rope(before[:, : h * d].view(t, h, d).float(), cos.float(), sin.float())
        torch.testing.assert_close(q.float(), q32, rtol=2.0**-11 + 1e-4, atol=1e-5)
    # The rotation did something (position 0 is the identity), dims >= rotary and v untouched.
    assert (q.float() - before[:, : h * d].view(t, h, d).float())[1:, :, :rotary].abs().max() > 0.1
    assert torch.equal(qkv.view(t, -1, d)[:, :, rotary:], before.view(t, -1, d)[:, :, rotary:])
    assert torch.equal(qkv[:, (h + kvh) * d:], before[:, (h + kvh) * d:])


def test_rope_many_heads_k_none_and_3d_tables():
    # More heads than one program's block (16), k absent, cos/sin as rope_cos_sin gives them.
    t, h, d = 3, 20, 32
    q = _randn(t, h, d, seed=30)
    cos, sin = rope_cos_sin(torch.tensor([5, 9, 11], device=DEVICE), rope_inv_freq(d, 1e6, None).to(DEVICE),
                            torch.float32)
    ref = apply_rope(q.clone(), cos, sin)
    te.rope(q, None, cos, sin)
    torch.testing.assert_close(q, ref, rtol=1e-6, atol=1e-6)
    assert (q - _randn(t, h, d, seed=30)).abs().max() > 0.1


def test_rope_rejects_bad_rotary_dims():
    q, k = _randn(2, 2, 16, seed=31), _randn(2, 1, 16, seed=32)
    with pytest.raises(ValueError):
        te.rope(q, k, _randn(2, 6), _randn(2, 6), rotary_dim=8)      # rotary_dim != table width
    with pytest.raises(ValueError):
        te.rope(q, k, _randn(2, 5), _randn(2, 5))                    # odd
    with pytest.raises(ValueError):
        te.rope(q, k, _randn(2, 32), _randn(2, 32))                  # wider than head_dim


# --- gated activations ----------------------------------------------------------------------


def _act_ref(name: str, gate: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) if name == "silu" else F.gelu(gate, approximate="tanh")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", ["silu", "gelu"])
@pytest.mark.parametrize("inter", [200, 1100])   # 1100: two column blocks of 1024
def test_act_mul_matches_torch(dtype, name, inter):
    fn = te.silu_mul if name == "silu" else te.gelu_tanh_mul
    gate_up = _randn(3, 2 * inter, dtype=dtype, seed=40 + inter, scale=2.0)
    out = fn(gate_up)
    gate, up = gate_up.split(inter, dim=-1)
    ref = _act_ref(name, gate) * up                  # GatedMLP.forward's expression
    assert out.shape == (3, inter) and out.dtype == dtype
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(out, ref, **tol)
    if dtype == torch.float16:
        # One rounding of the float32 result.
        ref32 = _act_ref(name, gate.float()) * up.float()
        torch.testing.assert_close(out.float(), ref32, rtol=2.0**-11 + 1e-4, atol=1e-5)
    assert (out.float() - up.float()).abs().max() > 0.1


@pytest.mark.parametrize("name", ["silu", "gelu"])
def test_act_mul_extremes_and_out_buffer(name):
    fn = te.silu_mul if name == "silu" else te.gelu_tanh_mul
    gate = torch.tensor([[-60.0, -20.0, -5.0, -1e-3, 0.0, 1e-3, 0.5, 5.0, 20.0, 60.0]], device=DEVICE)
    up = torch.linspace(-2, 3, 10, device=DEVICE)[None]
    gate_up = torch.cat([gate, up], dim=1)
    buf = torch.full((1, 16), 9.0, device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # numpy's exp overflow (-> the right limit)
        out = fn(gate_up, out=buf[:, :10])
    assert out.data_ptr() == buf.data_ptr()
    ref = _act_ref(name, gate) * up
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert bool((buf[:, 10:] == 9.0).all())


# --- without Triton ---------------------------------------------------------------------------


def test_launchers_raise_without_triton(monkeypatch):
    monkeypatch.setattr(te, "triton", None)
    assert not te.available()
    x = torch.ones(2, 8)
    with pytest.raises(RuntimeError, match="Triton"):
        te.rms_norm(x, torch.ones(8), EPS)
    with pytest.raises(RuntimeError, match="Triton"):
        te.silu_mul(x)
    with pytest.raises(RuntimeError, match="Triton"):
        te.gelu_tanh_mul(x)
    with pytest.raises(RuntimeError, match="Triton"):
        te.rope(torch.ones(2, 1, 8), None, torch.ones(2, 8), torch.ones(2, 8))


def test_layer_ops_keep_the_cpu_kernels_contracts():
    """LayerOps (what a layer's fused path calls on CUDA) against pagoda's C++ ops, which
    it stands in for: the norm with its residual written in place, RoPE of a fused qkv with
    K/V stored at their slots (slot -1 skipped), SiLU times up."""
    from pagoda.ops import cpu_kernels

    ops = cpu_kernels.kernels()
    if ops is None or DEVICE != "cpu":
        pytest.skip("compared with pagoda's CPU kernels, on CPU tensors")
    torch.manual_seed(0)
    t, heads, kv_heads, d = 5, 4, 2, 16
    x, res, w = torch.randn(t, 64), torch.randn(t, 64), torch.randn(64)
    res_cpu, res_tri = res.clone(), res.clone()
    torch.testing.assert_close(te.LayerOps.rms_norm(x, w, EPS, res_tri), ops.rms_norm(x, w, EPS, res_cpu),
                               **TOL[torch.float32])
    torch.testing.assert_close(res_tri, res_cpu, rtol=0, atol=0)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    cos, sin = rope_cos_sin(torch.arange(3, 3 + t), rope_inv_freq(d, 1e4, None), torch.float32)
    cos, sin = cos.view(t, d), sin.view(t, d)
    slots = torch.tensor([5, -1, 0, 7, 2])
    caches = [torch.zeros(2, 2, 4, kv_heads, d) for _ in range(2)]
    want = ops.rope_qkv(qkv.clone(), cos, sin, heads, kv_heads, caches[0], slots.clamp(min=0), None)
    got = te.LayerOps.rope_qkv(qkv.clone(), cos, sin, heads, kv_heads, caches[1], slots, None)
    for g, wnt in zip(got, want):
        torch.testing.assert_close(g, wnt, rtol=0, atol=0)
    keep = slots >= 0   # the C++ op has no skipped slot: compare the written ones
    flat = [c.view(2, -1, kv_heads, d)[:, slots[keep]] for c in caches]
    torch.testing.assert_close(flat[1], flat[0], rtol=0, atol=0)
    untouched = caches[1].view(2, -1, kv_heads, d)[:, 1]   # slot 1: no token wrote it
    assert torch.equal(untouched, torch.zeros_like(untouched))
    gate_up = torch.randn(t, 128)
    torch.testing.assert_close(te.LayerOps.silu_mul(gate_up), ops.silu_mul(gate_up), **TOL[torch.float32])
