"""Fused elementwise Triton kernels for the GPU path: RMSNorm (with the residual add),
rotate-half RoPE in place on q and k, and the gated MLP's activation times up
(SiLU and tanh-approximated GELU), each with a thin launcher.

The numbers follow the plain-torch layers they replace (``pagoda.model.layers``):

* ``rms_norm`` follows ``RMSNorm``: with a residual, ``residual += x`` rounded to x's
  dtype (as ``residual.add_(x)``), then the norm of that rounded sum in float32
  (``x * rsqrt(mean(x^2) + eps)``), cast to x's dtype, then times the weight. The
  product is done as torch does ``weight * x.to(dtype)``: in the promoted dtype of the
  two, which for a float32 weight and a bfloat16/float16 x is float32 (the output is then
  float32, as torch's is), and for equal dtypes is the float32 product rounded once to
  that dtype (exact for float16*float16 and bfloat16*bfloat16, whose products fit in
  float32, so the same bits as torch's). The launcher allocates its output in
  ``torch.promote_types(weight.dtype, x.dtype)``; a caller-given ``out`` gets its own dtype.
* ``rope`` follows ``apply_rope``: ``x * cos + rotate_half(x) * sin`` over the first
  ``rotary_dim`` dims, the others left as they are; each half reads its own cos/sin entries.
* ``silu_mul`` / ``gelu_tanh_mul``: ``act(gate) * up`` of a [T, 2I] gate_up (gate the
  first I columns); GELU's tanh form is computed as ``x * sigmoid(2u)``
  (= 0.5 x (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3)) since Triton has no tanh
  that the interpreter runs.

Loads are converted to float32, the math is float32, stores are in the destination's
dtype (one rounding where torch's float16/bfloat16 ops round after each op: within an
ulp of torch there, not the same bits; in float32 the rms norm and rope are torch's
operations in torch's order, the same bits but for the order of the mean's sum, and on
a GPU the compiler may fuse a multiply-add). The launchers do no host syncs (shapes,
strides and dtypes only) and take an optional ``out`` buffer so CUDA graphs can reuse it.

Without Triton the module imports and ``available()`` is False; the launchers then raise
RuntimeError. ``TRITON_INTERPRET=1`` set before Triton is imported runs the kernels in
Triton's interpreter on CPU tensors (the tests); ``INTERPRETED`` says which mode the
kernels were built in.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install
    triton = None
    tl = None

INTERPRETED = False
_MAX_ROW = 65536          # the widest row one rms_norm program takes
_ACT_BLOCK = 1024         # columns per program of the activation kernels (at most)

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, x_stride, res_stride, out_stride, N, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            # residual.add_(x): the sum rounded to the residual's (= x's) dtype, and the
            # norm taken of that rounded sum.
            res_row = res_ptr + row * res_stride + cols
            s = (x + tl.load(res_row, mask=mask, other=0.0).to(tl.float32)).to(res_ptr.dtype.element_ty)
            tl.store(res_row, s, mask=mask)
            x = s.to(tl.float32)
        mean_sq = tl.sum(x * x, axis=0) / N
        y = x * tl.rsqrt(mean_sq + eps)
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)     # .to(dtype) before the weight
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_heads(ptr, s0, s1, s2, t, h0, n_heads, c1, c2, sn1, sn2, d, d_mask, HALF,
                    BLOCK_H: tl.constexpr):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < n_heads)[:, None] & d_mask[None, :]
        base = ptr + t * s0 + heads[:, None].to(tl.int64) * s1
        p1 = base + d[None, :] * s2
        p2 = base + (d[None, :] + HALF) * s2
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
        # apply_rope: x * cos + cat(-x2, x1) * sin, each half with its own table entries.
        o1 = x1 * c1[None, :] - x2 * sn1[None, :]
        o2 = x2 * c2[None, :] + x1 * sn2[None, :]
        tl.store(p1, o1.to(ptr.dtype.element_ty), mask=mask)
        tl.store(p2, o2.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr,
                     q_s0, q_s1, q_s2, k_s0, k_s1, k_s2, c_s0, c_s1, sn_s0, sn_s1,
                     H, KVH, HALF, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h0 = tl.program_id(1) * BLOCK_H
        d = tl.arange(0, BLOCK_HALF)
        d_mask = d < HALF
        c1 = tl.load(cos_ptr + t * c_s0 + d * c_s1, mask=d_mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t * c_s0 + (d + HALF) * c_s1, mask=d_mask, other=0.0).to(tl.float32)
        sn1 = tl.load(sin_ptr + t * sn_s0 + d * sn_s1, mask=d_mask, other=0.0).to(tl.float32)
        sn2 = tl.load(sin_ptr + t * sn_s0 + (d + HALF) * sn_s1, mask=d_mask, other=0.0).to(tl.float32)
        _rope_heads(q_ptr, q_s0, q_s1, q_s2, t, h0, H, c1, c2, sn1, sn2, d, d_mask, HALF, BLOCK_H)
        _rope_heads(k_ptr, k_s0, k_s1, k_s2, t, h0, KVH, c1, c2, sn1, sn2, d, d_mask, HALF, BLOCK_H)

    @triton.jit
    def _act_mul_kernel(gu_ptr, out_ptr, I, gu_stride, out_stride, GELU: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * gu_stride + I + cols, mask=mask, other=0.0).to(tl.float32)
        if GELU:
            # 0.5 g (1 + tanh(z)) = g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3);
            # the limits come out right (exp overflow gives g / inf = 0).
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = g / (1.0 + tl.exp(-2.0 * z))
        else:
            a = g / (1.0 + tl.exp(-g))     # silu, as torch writes it
        tl.store(out_ptr + row * out_stride + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)

    INTERPRETED = type(_rms_norm_kernel).__name__ == "InterpretedFunction"


def available() -> bool:
    """Whether the kernels can run here: Triton is installed and there is a CUDA device,
    or the kernels were built for Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    return triton is not None and (INTERPRETED or torch.cuda.is_available())


def _require(*tensors: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("pagoda.ops.triton_elementwise needs Triton, which is not installed")
    if not INTERPRETED:
        for t in tensors:
            if t.device.type == "cpu":
                raise RuntimeError("Triton kernels need GPU tensors (CPU tensors only under "
                                   "TRITON_INTERPRET=1, set before Triton is imported)")


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None):
    """RMSNorm of the rows of x [T, N] (RMSNorm.forward's numbers). Without ``residual``:
    norm(x). With ``residual`` ([T, N], x's dtype): ``residual += x`` in place, and returns
    (norm(residual), residual). The output is ``promote_types(weight.dtype, x.dtype)``
    (torch's ``weight * x.to(dtype)``), or written into ``out`` ([T, N], its dtype)."""
    _require(x, weight)
    if x.dim() != 2:
        raise ValueError(f"rms_norm: x must be [T, N], got shape {tuple(x.shape)}")
    T, N = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.shape != (N,) or weight.stride(0) != 1:
        raise ValueError(f"rms_norm: weight must be a contiguous [{N}], got {tuple(weight.shape)}")
    if N > _MAX_ROW:
        raise ValueError(f"rms_norm: rows wider than {_MAX_ROW} are not supported (got {N})")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
            raise ValueError("rms_norm: residual must be [T, N] in x's dtype with contiguous rows, got "
                             f"{tuple(residual.shape)} {residual.dtype} strides {residual.stride()}")
    if out is None:
        out = torch.empty((T, N), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    elif out.shape != x.shape or out.stride(1) != 1:
        raise ValueError(f"rms_norm: out must be [T, N] with contiguous rows, got {tuple(out.shape)}")
    if T > 0:
        block = triton.next_power_of_2(N)
        res = residual if residual is not None else x   # an unused pointer when there is none
        _rms_norm_kernel[(T,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), N, float(eps),
                               HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block))
    return out if residual is None else (out, residual)


def rope(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
         rotary_dim: int | None = None) -> None:
    """Rotate-half RoPE in place on q [T, H, D] and k [T, KVH, D] (any strides: views of a
    fused qkv are fine; k may be None). cos/sin [T, R] (or rope_cos_sin's [T, 1, R]), each
    frequency twice; the first R = rotary_dim dims rotate (R even, <= D), the rest are left
    untouched. rotary_dim defaults to cos's width and must equal it when given."""
    _require(q, cos, sin)
    if cos.dim() == 3 and cos.shape[1] == 1:
        cos = cos[:, 0]
    if sin.dim() == 3 and sin.shape[1] == 1:
        sin = sin[:, 0]
    if q.dim() != 3 or (k is not None and (k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2])):
        raise ValueError(f"rope: q [T, H, D] and k [T, KVH, D] expected, got {tuple(q.shape)} and "
                         f"{None if k is None else tuple(k.shape)}")
    T, H, D = q.shape
    R = cos.shape[-1] if rotary_dim is None else rotary_dim
    if cos.dim() != 2 or cos.shape != (T, R) or sin.shape != (T, R):
        raise ValueError(f"rope: cos and sin must be [T={T}, rotary_dim={R}], got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if R % 2 or R > D:
        raise ValueError(f"rope: rotary_dim must be even and at most head_dim {D}, got {R}")
    KVH = 0 if k is None else k.shape[1]
    if T == 0 or R == 0:
        return
    kk = q if k is None else k          # an unused pointer when there is no k
    half = R // 2
    block_h = min(triton.next_power_of_2(max(H, KVH)), 16)
    block_half = triton.next_power_of_2(half)
    grid = (T, triton.cdiv(max(H, KVH), block_h))
    _rope_kernel[grid](q, kk, cos, sin, *q.stride(), *kk.stride(), *cos.stride(), *sin.stride(),
                       H, KVH, half, BLOCK_H=block_h, BLOCK_HALF=block_half,
                       num_warps=_warps(block_h * block_half * 2))


def _act_mul(gate_up: torch.Tensor, out: torch.Tensor | None, gelu: bool, name: str) -> torch.Tensor:
    _require(gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"{name}: gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (T, I) or out.stride(1) != 1:
        raise ValueError(f"{name}: out must be [T={T}, I={I}] with contiguous rows, got {tuple(out.shape)}")
    if T > 0 and I > 0:
        block = min(triton.next_power_of_2(I), _ACT_BLOCK)
        _act_mul_kernel[(T, triton.cdiv(I, block))](gate_up, out, I, gate_up.stride(0), out.stride(0),
                                                    GELU=gelu, BLOCK=block, num_warps=_warps(block))
    return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2I] (gate the first I columns, up the last I) -> [T, I]
    in gate_up's dtype, or into ``out``."""
    return _act_mul(gate_up, out, False, "silu_mul")


def gelu_tanh_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up of gate_up [T, 2I] -> [T, I] (or into ``out``)."""
    return _act_mul(gate_up, out, True, "gelu_tanh_mul")


class LayerOps:
    """These kernels under the names and contracts of pagoda's CPU kernels (``rms_norm``,
    ``rope_qkv``, ``silu_mul``), so a layer's one fused path (``fused_ops`` in
    pagoda/model/layers/norm.py) serves CUDA tensors too."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """norm(x), or with ``residual``: norm(x + residual), the sum written into ``residual``."""
        if residual is None:
            return rms_norm(x, weight, eps)
        return rms_norm(x, weight, eps, residual)[0]

    @staticmethod
    def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                 kv_cache: torch.Tensor | None, slot_mapping: torch.Tensor | None,
                 kv_scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """(q, k, v) [T, heads, D] of a fused qkv [T, (H + 2 KVH) D], q and k rotated (in place
        in ``qkv``); with ``kv_cache``, k and v also stored at ``slot_mapping``."""
        t = qkv.shape[0]
        d = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
        heads = qkv.view(t, num_heads + 2 * num_kv_heads, d)
        q, k, v = heads.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        rope(q, k, cos, sin)
        if kv_cache is not None:
            from pagoda.ops import triton_attention

            triton_attention.store_kv(k, v, kv_cache, slot_mapping, kv_scales)
        return q, k, v

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)


_LAYER_OPS = LayerOps()


@functools.lru_cache(maxsize=1)
def _layer_ops_enabled() -> bool:
    return available() and os.environ.get("PAGODA_TRITON_LAYER_OPS", "1") != "0"


def layer_ops(x: torch.Tensor) -> LayerOps | None:
    """``LayerOps`` for a CUDA tensor where Triton runs (None elsewhere, or with
    ``PAGODA_TRITON_LAYER_OPS=0`` at start-up: the layers' torch path, for comparisons).
    Called by every layer of a step: the environment is read once."""
    return _LAYER_OPS if x.device.type == "cuda" and _layer_ops_enabled() else None
