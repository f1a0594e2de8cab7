"""Triton kernels for paged attention over pagoda's KV cache, and their launchers.

One layer's cache is ``cache[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K,
1 = V) in float32 / float16 / bfloat16, or 8-bit (int8, or uint8 holding float8_e4m3fn
bytes) with ``scales[2, num_blocks, block_size, num_kv_heads]`` float32 (value = stored *
scale, one scale per token per KV head, see ``pagoda.attention.kv_quant``).

- ``store_kv``: writes new tokens' K and V into their slots (``block_id * block_size +
  offset``), quantizing bit for bit like ``QuantizedKVCache.write`` for an 8-bit cache.
- ``paged_decode``: one query token per sequence; one program per (sequence, KV head,
  split) handles that KV head's G query heads at once (G padded to >= 16 rows for
  ``tl.dot``); ``num_splits > 1`` is split-KV ("flash decoding") with a small combine kernel.
- ``paged_extend``: variable-length prefill / extend over a cached prefix, all requests of a
  step in one launch; one program per (request, KV head, block of query tokens) with the
  block's rows being (token, query head of the group) pairs.

Keys are processed in tiles of BLOCK_N that may span several pages: each key's page is
looked up in the block table per key, so the page size (1..256) never constrains a tile.
Loads are converted to float32 and accumulation is float32; the products (``tl.dot``) take
float16 / bfloat16 operands for a half-precision q (tensor cores on a GPU: its q, K and V
are exact in their type, the probabilities are rounded as FlashAttention rounds them) and
float32 ones with ``input_precision="ieee"`` otherwise. Nothing in the launchers syncs with the device (no ``.item()``,
no data-dependent shapes), so they can be captured in a CUDA graph.

On a machine without a GPU the kernels run under the Triton interpreter
(``TRITON_INTERPRET=1`` in the environment before this module is imported) on CPU tensors.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

# Tile sizes (constexpr; no autotuning), halved for head_dim > 128 to bound registers.
DECODE_BLOCK_N = 32      # keys per tile in decode
EXTEND_BLOCK_M = 64      # rows (query tokens x padded group heads) per extend program
EXTEND_BLOCK_N = 32      # keys per tile in extend
_NO_WINDOW = 1 << 30     # window=0 becomes this: every key is inside it

_QUANT_NONE, _QUANT_INT8, _QUANT_FP8 = 0, 1, 2


def available() -> bool:
    """Whether triton is installed (the kernels exist)."""
    return triton is not None


def _require() -> None:
    if triton is None:
        raise RuntimeError("pagoda.ops.triton_attention needs the `triton` package, which is not installed")


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _interpreter_numpy_compat() -> None:
    """Under the Triton interpreter every scalar is a 1-element numpy array, and the
    interpreter turns loop bounds into ints with ``int(array)``, which NumPy >= 2.4 refuses
    for 1-d arrays ("only 0-dimensional arrays can be converted to Python scalars"), so any
    ``range()`` over runtime bounds fails. Where that is the case, make the interpreter's
    ``tensor.__index__`` take the single element instead. Interpreter only; idempotent."""
    import numpy as np
    from triton.runtime import interpreter as ti

    try:
        int(np.ones(1, dtype=np.int32))
        return
    except TypeError:
        pass
    orig = getattr(ti, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_pagoda_compat", False):
        return

    def _patch_lang_tensor(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _patch_lang_tensor._pagoda_compat = True
    ti._patch_lang_tensor = _patch_lang_tensor


def interpreted() -> bool:
    """Whether this module's kernels were defined for the Triton interpreter (TRITON_INTERPRET=1
    at import): they then run on CPU tensors."""
    return triton is not None and type(_store_kv_kernel).__name__ == "InterpretedFunction"


if triton is not None:

    @triton.jit
    def _tanh(x):
        # tanh from exp (portable: the interpreter has no libdevice); |error| ~1e-7.
        t = tl.exp(-2.0 * tl.abs(x))
        y = (1.0 - t) / (1.0 + t)
        return tl.where(x < 0, -y, y)

    @triton.jit
    def _fp8e4m3_to_f32(raw):
        # float8_e4m3fn bytes (uint8) -> float32, exactly, with integer ops (no native fp8
        # conversion: works before sm89 and in the interpreter).
        b = raw.to(tl.int32) & 0xFF
        e = (b >> 3) & 0xF
        m = b & 0x7
        normal = ((e + 120) << 23) | (m << 20)          # exponent bias 7 -> 127
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
        mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
        return tl.where((b & 0x80) != 0, -mag, mag)

    @triton.jit
    def _f32_to_fp8e4m3(x):
        # float32 -> float8_e4m3fn bits as int32 in [0, 255]: c10's fp8e4m3fn_from_fp32_value
        # (round to nearest even, >= 480 and NaN -> 0x7F), so bytes match torch's `.to()`.
        bits = x.to(tl.int32, bitcast=True)
        a = bits & 0x7FFFFFFF
        sign = tl.where(bits < 0, 0x80, 0)
        # below 2^-6 (subnormal in e4m3): let the float adder round, 2^14 = 141 << 23
        sub = ((a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23))
        mant_odd = (a >> 20) & 1
        nrm = (a + (-120 << 23) + 0x7FFFF + mant_odd) >> 20
        r = tl.where(a < (121 << 23), sub, nrm)
        r = tl.where(a >= (1087 << 20), 0x7F, r)
        return (r & 0x7F) | sign

    @triton.jit
    def _store_one(src_ptr, dst_ptr, scale_ptr, t, blk, off, offs_h, offs_d, mask, mask_h,
                   s_t, s_h, s_d, s_cb, s_co, s_ch, s_cd, s_sb, s_so, s_sh,
                   QUANT: tl.constexpr):  # fmt: skip
        x = tl.load(src_ptr + t * s_t + offs_h[:, None] * s_h + offs_d[None, :] * s_d, mask=mask, other=0.0)
        dst = dst_ptr + blk * s_cb + off * s_co + offs_h[:, None] * s_ch + offs_d[None, :] * s_cd
        if QUANT == 0:
            tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=mask)
        else:
            xf = x.to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-12)          # [BLOCK_H]
            if QUANT == 1:
                sc = tl.math.div_rn(amax, 127.0)
            else:
                sc = tl.math.div_rn(amax, 448.0)
            qv = tl.math.div_rn(xf, sc[:, None])
            if QUANT == 1:
                # round half to even: adding 1.5 * 2^23 leaves no fraction bits (|qv| <= 127)
                r = (qv + 12582912.0) - 12582912.0
                r = tl.minimum(tl.maximum(r, -127.0), 127.0)
                tl.store(dst, r.to(tl.int8), mask=mask)
            else:
                tl.store(dst, _f32_to_fp8e4m3(qv).to(tl.uint8), mask=mask)
            tl.store(scale_ptr + blk * s_sb + off * s_so + offs_h * s_sh, sc, mask=mask_h)

    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, KVH, D, block_size,
                         s_kt, s_kh, s_kd, s_vt, s_vh, s_vd, s_cb, s_co, s_ch, s_cd, s_sb, s_so, s_sh,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        ok = slot >= 0
        slot = tl.maximum(slot, 0)
        blk = slot // block_size
        off = slot % block_size
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_h = ok & (offs_h < KVH)
        mask = mask_h[:, None] & (offs_d[None, :] < D)
        _store_one(k_ptr, kc_ptr, ks_ptr, t, blk, off, offs_h, offs_d, mask, mask_h,
                   s_kt, s_kh, s_kd, s_cb, s_co, s_ch, s_cd, s_sb, s_so, s_sh, QUANT)  # fmt: skip
        _store_one(v_ptr, vc_ptr, vs_ptr, t, blk, off, offs_h, offs_d, mask, mask_h,
                   s_vt, s_vh, s_vd, s_cb, s_co, s_ch, s_cd, s_sb, s_so, s_sh, QUANT)  # fmt: skip

    @triton.jit
    def _load_kv_tile(c_ptr, s_ptr, bt_row_ptr, offs_n, mask_n, kvh, offs_d, mask_d, block_size,
                      s_cb, s_co, s_ch, s_cd, s_sb, s_so, s_sh, QUANT: tl.constexpr):  # fmt: skip
        """Keys (or values) offs_n of one sequence, one KV head: [BLOCK_N, BLOCK_D] float32
        (raw 8-bit values when quantized) and their per-key scales [BLOCK_N] (ones if not)."""
        page = offs_n // block_size
        off = (offs_n % block_size).to(tl.int64)
        blk = tl.load(bt_row_ptr + page, mask=mask_n, other=0).to(tl.int64)
        base = blk * s_cb + off * s_co + kvh * s_ch
        m2 = mask_n[:, None] & mask_d[None, :]
        raw = tl.load(c_ptr + base[:, None] + offs_d[None, :] * s_cd, mask=m2, other=0)
        if QUANT == 2:
            x = _fp8e4m3_to_f32(raw)
        else:
            x = raw.to(tl.float32)
        if QUANT == 0:
            sc = tl.full(offs_n.shape, 1.0, tl.float32)
        else:
            sc = tl.load(s_ptr + blk * s_sb + off * s_so + kvh * s_sh, mask=mask_n, other=0.0)
        return x, sc

    @triton.jit
    def _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row_ptr, offs_n, mask_n, valid,
                     kvh, offs_d, mask_d, block_size, scale, softcap,
                     s_cb, s_co, s_ch, s_cd, s_sb, s_so, s_sh,
                     QUANT: tl.constexpr, USE_SOFTCAP: tl.constexpr, HALF_DOT: tl.constexpr):  # fmt: skip
        """One online-softmax step: rows q [M, D] against keys offs_n; valid [M, N] masks scores.
        HALF_DOT: the products' operands in float32 (0, exact: ``ieee``), float16 (1) or
        bfloat16 (2), with float32 accumulation: a half-precision model's q, K and V are
        exact in their own type (8-bit caches' values too), so only the probabilities are
        rounded, as FlashAttention rounds them; on a GPU these run on the tensor cores."""
        k, ksc = _load_kv_tile(k_ptr, ks_ptr, bt_row_ptr, offs_n, mask_n, kvh, offs_d, mask_d, block_size,
                               s_cb, s_co, s_ch, s_cd, s_sb, s_so, s_sh, QUANT)  # fmt: skip
        if HALF_DOT == 1:
            s = tl.dot(q.to(tl.float16), tl.trans(k.to(tl.float16)))
        elif HALF_DOT == 2:
            s = tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        if QUANT != 0:
            s = s * ksc[None, :]
        s = s * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with nothing visible yet
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v, vsc = _load_kv_tile(v_ptr, vs_ptr, bt_row_ptr, offs_n, mask_n, kvh, offs_d, mask_d, block_size,
                               s_cb, s_co, s_ch, s_cd, s_sb, s_so, s_sh, QUANT)  # fmt: skip
        if QUANT != 0:
            p = p * vsc[None, :]
        if HALF_DOT == 1:
            pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
        elif HALF_DOT == 2:
            pv = tl.dot(p.to(tl.bfloat16), v.to(tl.bfloat16))
        else:
            pv = tl.dot(p, v, input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc

    @triton.jit
    def _finish(m_i, l_i, acc, sink, HAS_SINKS: tl.constexpr):
        """acc / (l + exp(sink - m)), with zero rows (nothing seen, no sink) giving 0."""
        if HAS_SINKS:
            m_f = tl.maximum(m_i, sink)
            m_f = tl.where(m_f == float("-inf"), 0.0, m_f)
            a = tl.exp(m_i - m_f)
            l_i = l_i * a + tl.exp(sink - m_f)
            acc = acc * a[:, None]
        return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seqlens_ptr, sinks_ptr, out_ptr, ws_ptr,
                       scale, softcap, window, G, D, block_size,
                       s_qb, s_qh, s_qd, s_cb, s_co, s_ch, s_cd, s_sb, s_so, s_sh, s_bt,
                       s_ob, s_oh, s_od, s_wb, s_wh, s_ws,
                       BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                       QUANT: tl.constexpr, USE_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
                       DIRECT: tl.constexpr, HALF_DOT: tl.constexpr):  # fmt: skip
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        num_splits = tl.num_programs(2)
        seq_len = tl.load(seqlens_ptr + b)
        # the query sits at seq_len - 1 and sees keys (seq_len - 1 - window, seq_len - 1]
        start = tl.maximum(seq_len - window, 0)
        chunk = tl.cdiv(seq_len - start, num_splits)
        lo = tl.minimum(start + sp * chunk, seq_len)
        hi = tl.minimum(lo + chunk, seq_len)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        mask_g = offs_g < G
        mask_d = offs_d < D
        heads = kvh * G + offs_g
        b64 = b.to(tl.int64)
        q = tl.load(q_ptr + b64 * s_qb + heads[:, None] * s_qh + offs_d[None, :] * s_qd,
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # fmt: skip
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        bt_row = bt_ptr + b64 * s_bt
        for j0 in range(lo, hi, BLOCK_N):
            offs_n = j0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, offs_n, mask_n,
                                         mask_n[None, :], kvh, offs_d, mask_d, block_size, scale, softcap,
                                         s_cb, s_co, s_ch, s_cd, s_sb, s_so, s_sh, QUANT, USE_SOFTCAP, HALF_DOT)  # fmt: skip
        if DIRECT:
            if HAS_SINKS:
                sink = tl.load(sinks_ptr + heads, mask=mask_g, other=0.0).to(tl.float32)
            else:
                sink = m_i
            o = _finish(m_i, l_i, acc, sink, HAS_SINKS)
            tl.store(out_ptr + b64 * s_ob + heads[:, None] * s_oh + offs_d[None, :] * s_od,
                     o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])  # fmt: skip
        else:
            # partial (acc, max, sum) of this split: ws[b, head, split, :D], [D], [D + 1]
            w = ws_ptr + b64 * s_wb + heads * s_wh + sp * s_ws
            tl.store(w[:, None] + offs_d[None, :], acc, mask=mask_g[:, None] & mask_d[None, :])
            tl.store(w + D, m_i, mask=mask_g)
            tl.store(w + D + 1, l_i, mask=mask_g)

    @triton.jit
    def _combine_kernel(ws_ptr, sinks_ptr, out_ptr, num_splits, D,
                        s_wb, s_wh, s_ws, s_ob, s_oh, s_od,
                        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        mask_s = offs_s < num_splits
        mask_d = offs_d < D
        w = ws_ptr + b * s_wb + h * s_wh + offs_s * s_ws
        m = tl.load(w + D, mask=mask_s, other=float("-inf"))
        l_s = tl.load(w + D + 1, mask=mask_s, other=0.0)
        acc = tl.load(w[:, None] + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        m_max = tl.max(m, axis=0)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + h).to(tl.float32)
            m_max = tl.maximum(m_max, sink)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        a = tl.exp(m - m_max)
        l_tot = tl.sum(l_s * a, axis=0)
        if HAS_SINKS:
            l_tot += tl.exp(sink - m_max)
        o = tl.sum(acc * a[:, None], axis=0) / tl.where(l_tot == 0.0, 1.0, l_tot)
        tl.store(out_ptr + b * s_ob + h * s_oh + offs_d * s_od, o.to(out_ptr.dtype.element_ty), mask=mask_d)

    @triton.jit
    def _extend_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, qsl_ptr, seqlens_ptr, sinks_ptr, out_ptr,
                       scale, softcap, window, G, D, block_size,
                       s_qt, s_qh, s_qd, s_cb, s_co, s_ch, s_cd, s_sb, s_so, s_sh, s_bt, s_ot, s_oh, s_od,
                       BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_N: tl.constexpr, QUANT: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                       HAS_SINKS: tl.constexpr, HALF_DOT: tl.constexpr):  # fmt: skip
        n = tl.program_id(0)
        kvh = tl.program_id(1)
        qb = tl.program_id(2)
        q_beg = tl.load(qsl_ptr + n)
        q_len = tl.load(qsl_ptr + n + 1) - q_beg
        first = qb * BLOCK_Q
        if first >= q_len:
            return
        seq_len = tl.load(seqlens_ptr + n)
        ctx = seq_len - q_len

        BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
        offs_m = tl.arange(0, BLOCK_M)
        tok = first + offs_m // BLOCK_G          # query row within the request
        g = offs_m % BLOCK_G                     # query head within the group
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        row_ok = (tok < q_len) & (g < G)
        heads = kvh * G + g
        rows = (q_beg + tok).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * s_qt + heads[:, None] * s_qh + offs_d[None, :] * s_qd,
                    mask=row_ok[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # fmt: skip
        pos = ctx + tok
        lower = pos - window                     # keys must be > lower (window) and <= pos (causal)
        lo = tl.maximum(ctx + first - window + 1, 0)
        hi = ctx + tl.minimum(q_len, first + BLOCK_Q)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bt_row = bt_ptr + n.to(tl.int64) * s_bt
        for j0 in range(lo, hi, BLOCK_N):
            offs_n = j0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            valid = (mask_n[None, :] & (offs_n[None, :] <= pos[:, None])) & (offs_n[None, :] > lower[:, None])
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, offs_n, mask_n,
                                         valid, kvh, offs_d, mask_d, block_size, scale, softcap,
                                         s_cb, s_co, s_ch, s_cd, s_sb, s_so, s_sh, QUANT, USE_SOFTCAP, HALF_DOT)  # fmt: skip
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32)
        else:
            sink = m_i
        o = _finish(m_i, l_i, acc, sink, HAS_SINKS)
        tl.store(out_ptr + rows[:, None] * s_ot + heads[:, None] * s_oh + offs_d[None, :] * s_od,
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])  # fmt: skip


    if interpreted():
        _interpreter_numpy_compat()


# ---------------------------------------------------------------------------------------------
# Launchers


def _quant_mode(cache: torch.Tensor, scales: torch.Tensor | None) -> tuple[int, torch.Tensor]:
    """The kernels' QUANT constant, and the cache as the kernels read it (fp8 as uint8)."""
    if scales is None:
        if cache.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"an 8-bit cache ({cache.dtype}) needs its `scales`")
        return _QUANT_NONE, cache
    if scales.dtype != torch.float32 or scales.shape != cache.shape[:4]:
        raise ValueError(f"scales must be float32 {tuple(cache.shape[:4])}, got {scales.dtype} {tuple(scales.shape)}")
    if cache.dtype == torch.int8:
        return _QUANT_INT8, cache
    if cache.dtype == torch.uint8:
        return _QUANT_FP8, cache
    if cache.dtype == torch.float8_e4m3fn:
        return _QUANT_FP8, cache.view(torch.uint8)
    raise ValueError(f"an 8-bit cache must be int8 or uint8 (float8_e4m3fn bytes), got {cache.dtype}")


def _half_dot(q: torch.Tensor) -> int:
    """The products' operand type: q's own where it is float16 (1) or bfloat16 (2), else
    float32 (0). Under the interpreter a bfloat16 model's products take float32 operands:
    its ``tl.dot`` of bfloat16 operands gives garbage (~1e10 off on a 16 x 16 product of
    normal values, Triton 3.6), while its bfloat16 loads, stores and casts are right, so the
    rest of the kernels' bfloat16 path is still tested on the CPU."""
    if q.dtype == torch.bfloat16 and interpreted():
        return 0
    return {torch.float16: 1, torch.bfloat16: 2}.get(q.dtype, 0)


def _check_cache(cache: torch.Tensor) -> None:
    if cache.dim() != 5 or cache.shape[0] != 2:
        raise ValueError(f"cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(cache.shape)}")


def _cache_args(cache: torch.Tensor, scales: torch.Tensor | None):
    """(K, V, K scales, V scales, cache strides (block, offset, head, dim), scale strides)."""
    if scales is None:
        # unused by the kernels (QUANT == 0): any pointer will do
        return cache[0], cache[1], cache[0], cache[1], tuple(cache.stride()[1:]), (0, 0, 0)
    return cache[0], cache[1], scales[0], scales[1], tuple(cache.stride()[1:]), tuple(scales.stride()[1:])


def decode_workspace(batch: int, num_heads: int, head_dim: int, num_splits: int,
                     device: torch.device | str) -> torch.Tensor:  # fmt: skip
    """The float32 scratch ``paged_decode`` uses for ``num_splits > 1``: per (sequence, head,
    split) the unnormalised partial output [head_dim], its running max and its sum. Allocate it
    once per captured batch shape and pass it as ``workspace=`` (CUDA graphs) or let
    ``paged_decode`` allocate one per call."""
    return torch.empty(batch, num_heads, num_splits, head_dim + 2, dtype=torch.float32, device=device)


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
             scales: torch.Tensor | None = None) -> None:  # fmt: skip
    """Write k, v ([T, KVH, D]) into ``cache`` at ``slot_mapping`` ([T]; slots < 0 are skipped).

    With ``scales`` the cache is 8-bit and each vector is quantized exactly like
    ``QuantizedKVCache.write`` (per token per head absmax scale; int8 rounds half to even and
    clamps to +-127, fp8 rounds like torch's float8_e4m3fn conversion)."""
    _require()
    _check_cache(cache)
    quant, cache = _quant_mode(cache, scales)
    T, KVH, D = k.shape
    if v.shape != k.shape or cache.shape[3:] != (KVH, D) or slot_mapping.shape != (T,):
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(cache.shape)}, "
                         f"slot_mapping {tuple(slot_mapping.shape)} do not agree")  # fmt: skip
    if T == 0:
        return
    if quant == _QUANT_NONE and k.dtype != cache.dtype:
        # torch's rounding (the interpreter's float32 -> bfloat16 cast truncates)
        k, v = k.to(cache.dtype), v.to(cache.dtype)
    kc, vc, ks, vs, cs, ss = _cache_args(cache, scales)
    _store_kv_kernel[(T,)](
        k, v, kc, vc, ks, vs, slot_mapping, KVH, D, cache.shape[2],
        *k.stride(), *v.stride(), *cs, *ss,
        BLOCK_H=_next_pow2(KVH), BLOCK_D=_next_pow2(D), QUANT=quant,
    )  # fmt: skip


def _attn_common(q, cache, scales, sinks, softcap, window, block_tables):
    _check_cache(cache)
    quant, cache = _quant_mode(cache, scales)
    H, D = q.shape[1], q.shape[2]
    KVH = cache.shape[3]
    if cache.shape[4] != D or H % KVH:
        raise ValueError(f"q heads/dim {H}/{D} do not fit the cache's {KVH} KV heads of dim {cache.shape[4]}")
    if sinks is not None and (sinks.shape != (H,)):
        raise ValueError(f"sinks must be [{H}], got {tuple(sinks.shape)}")
    if block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be int32 (or int64), got {block_tables.dtype}")
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    return quant, cache, H, D, KVH, H // KVH, (window if window > 0 else _NO_WINDOW)


def paged_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, *, window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None, num_splits: int = 1, out: torch.Tensor | None = None,
                 workspace: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Attention of one query token per sequence (q [B, H, D], at position seq_len - 1) over
    its ``seq_lens[b]`` cached keys, read through ``block_tables`` [B, max_blocks] int32.

    Rows with seq_len 0 give zeros. ``num_splits > 1`` splits each sequence's keys into that
    many contiguous ranges (empty ones allowed) whose partials a second kernel combines; the
    float32 scratch for it is ``workspace`` ([>= B, H, num_splits, D + 2], see
    ``decode_workspace``) or, if not given, allocated here. Output in q's dtype (into ``out``
    if given)."""
    _require()
    quant, cache, H, D, KVH, G, win = _attn_common(q, cache, scales, sinks, softcap, window, block_tables)
    B = q.shape[0]
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if out is None:
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    elif out.shape != (B, H, D):
        raise ValueError(f"out must be {(B, H, D)}, got {tuple(out.shape)}")
    if B == 0:
        return out
    direct = num_splits == 1
    if direct:
        ws, ws_strides = out, (0, 0, 0)
    else:
        ws = workspace if workspace is not None else decode_workspace(B, H, D, num_splits, q.device)
        if (ws.dtype != torch.float32 or ws.dim() != 4 or ws.shape[0] < B or ws.shape[1:] != (H, num_splits, D + 2)
                or ws.stride(3) != 1):  # fmt: skip
            raise ValueError(f"workspace must be float32 [>={B}, {H}, {num_splits}, {D + 2}] with a contiguous "
                             f"last dim, got {ws.dtype} {tuple(ws.shape)}")  # fmt: skip
        ws_strides = ws.stride()[:3]
    kc, vc, ks, vs, cs, ss = _cache_args(cache, scales)
    BLOCK_D = max(16, _next_pow2(D))
    big = BLOCK_D > 128
    has_sinks = sinks is not None
    sk = sinks if has_sinks else q
    _decode_kernel[(B, KVH, num_splits)](
        q, kc, vc, ks, vs, block_tables, seq_lens, sk, out, ws,
        float(scale), float(softcap) if softcap > 0 else 1.0, win, G, D, cache.shape[2],
        *q.stride(), *cs, *ss, block_tables.stride(0), *out.stride(), *ws_strides,
        BLOCK_G=max(16, _next_pow2(G)), BLOCK_D=BLOCK_D, BLOCK_N=DECODE_BLOCK_N // 2 if big else DECODE_BLOCK_N,
        QUANT=quant, USE_SOFTCAP=softcap > 0, HAS_SINKS=has_sinks, DIRECT=direct, HALF_DOT=_half_dot(q),
        num_warps=8 if big else 4,
    )  # fmt: skip
    if not direct:
        _combine_kernel[(B, H)](
            ws, sk, out, num_splits, D, *ws_strides, *out.stride(),
            BLOCK_S=_next_pow2(num_splits), BLOCK_D=BLOCK_D, HAS_SINKS=has_sinks,
        )  # fmt: skip
    return out


def paged_extend(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, *, max_query_len: int, window: int = 0,
                 softcap: float = 0.0, sinks: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Causal attention for the packed queries of N requests (q [T, H, D]; request i owns rows
    ``query_start_loc[i]:query_start_loc[i+1]``) over their cached keys (``seq_lens[i]`` =
    context + query length, all already stored). Row r of request i sits at position
    ``seq_lens[i] - query_len_i + r``. ``max_query_len`` (a host int, >= every query length)
    sizes the grid. Output in q's dtype (into ``out`` if given)."""
    _require()
    quant, cache, H, D, KVH, G, win = _attn_common(q, cache, scales, sinks, softcap, window, block_tables)
    T = q.shape[0]
    N = block_tables.shape[0]
    if query_start_loc.shape != (N + 1,) or seq_lens.shape != (N,):
        raise ValueError(f"query_start_loc must be [{N + 1}] and seq_lens [{N}], got "
                         f"{tuple(query_start_loc.shape)} and {tuple(seq_lens.shape)}")  # fmt: skip
    if out is None:
        out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    elif out.shape != (T, H, D):
        raise ValueError(f"out must be {(T, H, D)}, got {tuple(out.shape)}")
    if T == 0 or N == 0 or max_query_len <= 0:
        return out
    BLOCK_D = max(16, _next_pow2(D))
    big = BLOCK_D > 128
    BLOCK_G = _next_pow2(G)
    # rows = BLOCK_Q tokens x BLOCK_G heads; tl.dot needs >= 16 rows
    BLOCK_Q = max(1, (EXTEND_BLOCK_M // 2 if big else EXTEND_BLOCK_M) // BLOCK_G, 16 // BLOCK_G)
    kc, vc, ks, vs, cs, ss = _cache_args(cache, scales)
    has_sinks = sinks is not None
    _extend_kernel[(N, KVH, triton.cdiv(max_query_len, BLOCK_Q))](
        q, kc, vc, ks, vs, block_tables, query_start_loc, seq_lens, sinks if has_sinks else q, out,
        float(scale), float(softcap) if softcap > 0 else 1.0, win, G, D, cache.shape[2],
        *q.stride(), *cs, *ss, block_tables.stride(0), *out.stride(),
        BLOCK_Q=BLOCK_Q, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, BLOCK_N=EXTEND_BLOCK_N // 2 if big else EXTEND_BLOCK_N,
        QUANT=quant, USE_SOFTCAP=softcap > 0, HAS_SINKS=has_sinks, HALF_DOT=_half_dot(q), num_warps=8 if big else 4,
    )  # fmt: skip
    return out
