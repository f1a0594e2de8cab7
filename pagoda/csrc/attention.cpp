// Attention (pagoda/csrc/kernels.h):
//
// paged_decode_attention: one query token per sequence against its K/V read in
//   place from the paged cache through the block table (no gathered, padded
//   copy). Each (sequence, query head) has a fixed summation order, so a
//   sequence's result does not depend on its batch.
//
// Split-K: a sequence's positions are cut into chunks of kChunk (a fixed length, so the
//   cut depends on the sequence alone, never on its batch); each chunk is a work unit that
//   leaves its partial softmax (the maximum score m, the sum l of e^(s - m) and the
//   unnormalised sum of the weighted V rows), and a merge combines a sequence's chunks in
//   order: out = sum_i e^(m_i - M) o_i / (sum_i e^(m_i - M) l_i [+ e^(sink - M)]), M the
//   largest m (and sink). A long lone sequence so keeps every core reading its KV, where one
//   unit per sequence (or per KV head) left them idle or unevenly loaded.
//
// float32, float16 or int8 caches; an AVX2 kernel, and for head sizes a multiple of 16 on a CPU
// with AVX-512 (unless PAGODA_CPU_ISA=avx2) one with 16-lane passes that reads the K/V rows in
// place, converting in registers, with software prefetch of the rows ahead (decode_heads512:
// a fixed order of arithmetic per head too, other last bits).

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

using pagoda::hsum256;

// e^x for x <= 0 (softmax after subtracting the maximum), 8 lanes: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative error < 2e-8 there, below
// float rounding), 2^n put into the exponent bits. Below -87 the result is 0.
// e^r's Taylor coefficients, r^7's first (Horner's order).
constexpr float kExpTaylor[8] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
inline __m256 exp_neg(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, ln2 split in a high part exact in float and a low correction.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int k = 1; k < 8; ++k) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[k]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// K/V elements: float32, or float16 (uint16_t bits) converted on load (F16C).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float to_float(float v) { return v; }
inline float to_float(int8_t v) { return static_cast<float>(v); }
inline float to_float(uint16_t v) { return _cvtsh_ss(v); }

// Eight 8-lane vectors -> one vector of their eight horizontal sums.
inline __m256 hsum8x8(const __m256 a[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// KV heads [kv0, kv1) of one sequence's decode attention, D % 8 == 0 and G query heads
// per KV head, G <= 8. Three passes, each head's arithmetic in a fixed order (so a
// head's result does not depend on the batch or on which heads share the call):
// 1. scores, eight positions at a time: every KV head's K rows against its G queries,
//    one horizontal reduction per head and eight positions;
// 2. a vector softmax per query head;
// 3. the weighted sum of V, eight positions at a time: per KV head, NCH 8-wide slices
//    with G x NCH independent accumulators (one chain per head and slice would wait on
//    the FMA latency at every position), kept in the output between blocks; each sums
//    the positions in order.
// Passes 1 and 3 first copy the block's rows into a float32 buffer, row after row (see
// below; the AVX-512 version reads them in place): measured B=64, context 192, 30 layers,
// one thread: float32 cache 69 -> 38 ms, float16 47 -> 29 ms. Reading them in place as the
// AVX-512 version does (G x J accumulators, at most 12 of the 16 registers) measured 0.75-0.94x
// of this (a Zen 4 running this kernel, float16 cache, 4k-16k contexts, pools swept out of
// the L3): the copies stay here.
// rows[p]: offset of position p's K (and V) row, all KV heads, in the cache.
// An int8 cache (ks, vs non-null): K of position p and KV head h is ks[srows[p] + h] times
// its int8 values (V likewise with vs); the K scale multiplies the score, the V scale
// the softmax weight.
// Attention logit soft-capping: s -> cap * tanh(s / cap), as transformers rounds it.
inline void soft_cap(float* s, int64_t n, float cap) {
  for (int64_t p = 0; p < n; ++p) s[p] = cap * std::tanh(s[p] / cap);
}

// The chunk's softmax over the len real positions, query heads of the KV heads [kv0, kv1):
// scores[h * padded + p] -> e^(s - m_h) (0 on the padding lanes, which repeat the last key),
// mo[h] = m_h, lo[h] = the sum; an int8 cache's V scales folded into the weights.
inline void chunk_softmax(float* scores, int64_t padded, int64_t len, int64_t G, int64_t kv0, int64_t kv1, float* mo,
                          float* lo, const float* vs, const int64_t* srows, float softcap) {
  for (int64_t h = kv0 * G; h < kv1 * G; ++h) {
    float* sg = scores + h * padded;
    if (softcap > 0.f) soft_cap(sg, padded, softcap);
    // The maximum over the padding too: its lanes repeat the last position's score.
    __m256 vmx = _mm256_loadu_ps(sg);
    for (int64_t p0 = 8; p0 < padded; p0 += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(sg + p0));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmx);
    const float mx = *std::max_element(lanes, lanes + 8);
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 tot = _mm256_setzero_ps();
    for (int64_t p0 = 0; p0 < padded; p0 += 8) {
      __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sg + p0), mv));
      if (p0 + 8 > len) {
        alignas(32) int32_t keep[8];
        for (int j = 0; j < 8; ++j) keep[j] = p0 + j < len ? -1 : 0;
        e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(keep))));
      }
      _mm256_storeu_ps(sg + p0, e);
      tot = _mm256_add_ps(tot, e);
    }
    mo[h] = mx;
    lo[h] = hsum256(tot);
    if (vs) {
      const int64_t kvh = h / G;
      for (int64_t p = 0; p < len; ++p) sg[p] *= vs[srows[p] + kvh];
    }
  }
}

// Positions [p, p + n) of a chunk's K (or V) rows, heads [offset / D, ...) of width floats,
// asked for ahead of their use, into the L2. A block's rows are adjacent, but
// blocks lie anywhere in the pool, so the hardware's stream prefetch starts over at every
// block. Into the L2, not the L1: on a Zen 4 the L1 hint did nothing measurable (as if no
// prefetch; its few L1 miss buffers were full) and the L2 hint gave 1.3-1.66x with the pools
// swept out of the L3 (`pagoda bench attention`); on an Emerald Rapids Xeon the hints and
// distances measured within noise of each other. 32 positions ahead: 64 was within 1-7%,
// 128 and 256 5-20% slower (a Zen 4). The K pass asks for the V rows of the positions it is
// at as well (the chunk's V rows are in the L2 when its V pass starts, and the memory is busy
// through the softmax): 1.03-1.20x more in the AVX-512 kernel (float16 and float32 caches; the V
// pass still asks 32 positions ahead: without it 0.93-1.03x), 0.87-0.93x in the AVX2 one
// (float16; there the K pass asks for the first V rows at its end only). The AVX-512 V pass asks
// for the K rows of the thread's next unit of work meanwhile (it reads from the L2, the memory
// would idle): 1.01-1.17x more.
template <typename KV>
inline void prefetch_rows(const KV* base, const int64_t* rows, int64_t p, int64_t n, int64_t len, int64_t offset,
                          int64_t width) {
  const int64_t bytes = width * static_cast<int64_t>(sizeof(KV));
  for (int64_t q = p; q < std::min(p + n, len); ++q) {
    const char* row = reinterpret_cast<const char*>(base + rows[q] + offset);
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(row + o, _MM_HINT_T1);
  }
}
constexpr int64_t kAhead = 32;  // positions ahead

// A unit of work's rows as prefetch_rows reads them (decode_heads512's next unit).
struct RowSpan {
  const int64_t* rows;
  int64_t len, offset, width;
};

// The positions are one chunk (rows[0..len)); the output is the chunk's partial softmax:
// per query head h of the KV heads [kv0, kv1), ob[h * D..] the sum of e^(s_p - m_h) V_p,
// mo[h] = m_h (the chunk's largest score), lo[h] the sum of e^(s_p - m_h).
template <int G, typename KV>
void decode_heads(const float* qb, const KV* kp, const KV* vp, const int64_t* rows, int64_t len, int64_t D,
                  int64_t kv0, int64_t kv1, float sc, float* scores, float* ob, float* mo, float* lo,
                  const float* ks, const float* vs, const int64_t* srows, float* buf, float softcap) {
  const int64_t padded = (len + 7) / 8 * 8;
  // Eight positions' K (then V) rows, heads kv0..kv1, copied as float32 into buf (room for
  // 8 x (kv1 - kv0) x D) one row after another: read in address order, the cache streams
  // from memory (the passes below jump between rows; reading the cache that way took twice
  // as long), and a float16 or int8 element is converted once, not once per query head.
  const int64_t width = (kv1 - kv0) * D;
  prefetch_rows(kp, rows, 0, kAhead, len, kv0 * D, width);
  for (int64_t p0 = 0; p0 < len; p0 += 8) {
    prefetch_rows(kp, rows, p0 + kAhead, 8, len, kv0 * D, width);
    if (p0 + 8 >= len) prefetch_rows(vp, rows, 0, kAhead, len, kv0 * D, width);
    const float* keys[8];  // keys[j] + (kvh - kv0) * D: position p0 + j's K for head kvh
    for (int j = 0; j < 8; ++j) {
      const KV* src = kp + rows[std::min(p0 + j, len - 1)] + kv0 * D;
      float* dst = buf + j * width;
      for (int64_t i = 0; i < width; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
      keys[j] = dst;
    }
    for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
      __m256 scale = _mm256_set1_ps(sc);
      if (ks) {
        alignas(32) float kscale[8];
        for (int j = 0; j < 8; ++j) kscale[j] = ks[srows[std::min(p0 + j, len - 1)] + kvh];
        scale = _mm256_mul_ps(scale, _mm256_load_ps(kscale));
      }
      for (int g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        const float* qg = qb + h * D;
        __m256 acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) {
          const __m256 qv = _mm256_loadu_ps(qg + i);
          for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[j] + (kvh - kv0) * D + i), acc[j]);
        }
        _mm256_storeu_ps(scores + h * padded + p0, _mm256_mul_ps(hsum8x8(acc), scale));
      }
    }
  }
  chunk_softmax(scores, padded, len, G, kv0, kv1, mo, lo, vs, srows, softcap);
  // NCH slices per pass: G x NCH accumulators, at most 12 (of 16 registers).
  constexpr int NCH = G <= 3 ? 4 : (G <= 6 ? 2 : 1);
  std::fill(ob + kv0 * G * D, ob + kv1 * G * D, 0.f);
  for (int64_t p0 = 0; p0 < len; p0 += 8) {
    const int64_t p1 = std::min(len, p0 + 8);
    prefetch_rows(vp, rows, p0 + kAhead, 8, len, kv0 * D, width);
    const float* vals[8];  // vals[p - p0] + (kvh - kv0) * D: position p's V for head kvh
    for (int64_t p = p0; p < p1; ++p) {
      const KV* src = vp + rows[p] + kv0 * D;
      float* dst = buf + (p - p0) * width;
      for (int64_t i = 0; i < width; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
      vals[p - p0] = dst;
    }
    for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
      const float* sk = scores + kvh * G * padded;
      float* ok = ob + kvh * G * D;
      int64_t i = 0;
      auto pass = [&](auto nch) {
        constexpr int C = decltype(nch)::value;
        __m256 acc[G][C];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c) acc[g][c] = _mm256_loadu_ps(ok + g * D + i + 8 * c);
        for (int64_t p = p0; p < p1; ++p) {
          const float* vrow = vals[p - p0] + (kvh - kv0) * D + i;
          // The G weights in registers, then one V slice at a time: G x C + G + 1
          // registers (16 for G = 3, C = 4: all of AVX2's; holding all C slices
          // instead spilled an accumulator, and its store-load chain set the pace).
          __m256 s[G];
          for (int g = 0; g < G; ++g) s[g] = _mm256_broadcast_ss(sk + g * padded + p);
          for (int c = 0; c < C; ++c) {
            const __m256 vv = _mm256_loadu_ps(vrow + 8 * c);
            for (int g = 0; g < G; ++g) acc[g][c] = _mm256_fmadd_ps(s[g], vv, acc[g][c]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c) _mm256_storeu_ps(ok + g * D + i + 8 * c, acc[g][c]);
        i += 8 * C;
      };
      for (; i + 8 * NCH <= D;) pass(std::integral_constant<int, NCH>{});
      for (; i < D;) pass(std::integral_constant<int, 1>{});
    }
  }
}

// K/V elements as 16 float32 lanes (AVX-512).
PAGODA_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
PAGODA_AVX512 inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
PAGODA_AVX512 inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Eight 16-lane vectors -> one 8-lane vector of their eight horizontal sums, by halving
// (128-bit lanes, then within lanes): 24 instructions where two 8-lane halves and hsum8x8
// took 37.
PAGODA_AVX512 inline __m256 hsum8x16(const __m512 a[8]) {
  __m512 b[4];
  for (int k = 0; k < 4; ++k)  // [a_2k: 8 partial sums, a_2k+1: 8]
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x44), _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xEE));
  __m512 c[2];
  for (int k = 0; k < 2; ++k)  // four positions, four partial sums each (one per 128-bit lane)
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88), _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xDD));
  // lane k: [x0, x1, x2, x3] of position k (c[0]) and of position k + 4 (c[1])
  const __m512 s = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  const __m512 u = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));  // lane k: [p_k, p_k+4, p_k, p_k+4]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, u));
}

// exp_neg with 16 lanes (the same steps).
PAGODA_AVX512 inline __m512 exp_neg512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int k = 1; k < 8; ++k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[k]));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), p, _mm512_castsi512_ps(bits));
}

// chunk_softmax with 16 lanes (padded is a multiple of 8: the last vector may be half).
PAGODA_AVX512 inline void chunk_softmax512(float* scores, int64_t padded, int64_t len, int64_t G, int64_t kv0,
                                           int64_t kv1, float* mo, float* lo, const float* vs,
                                           const int64_t* srows, float softcap) {
  for (int64_t h = kv0 * G; h < kv1 * G; ++h) {
    float* sg = scores + h * padded;
    if (softcap > 0.f) soft_cap(sg, padded, softcap);
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    for (int64_t p0 = 0; p0 < padded; p0 += 16) {
      const __mmask16 in = padded - p0 >= 16 ? 0xFFFF : 0x00FF;
      vmx = _mm512_max_ps(vmx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), in, sg + p0));
    }
    const float mx = _mm512_reduce_max_ps(vmx);
    const __m512 mv = _mm512_set1_ps(mx);
    __m512 tot = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < padded; p0 += 16) {
      const __mmask16 in = padded - p0 >= 16 ? 0xFFFF : 0x00FF;
      const __mmask16 real = len - p0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - p0)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(real, exp_neg512(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, sg + p0), mv)));
      _mm512_mask_storeu_ps(sg + p0, in, e);
      tot = _mm512_add_ps(tot, e);
    }
    mo[h] = mx;
    lo[h] = _mm512_reduce_add_ps(tot);
    if (vs) {
      const int64_t kvh = h / G;
      for (int64_t p = 0; p < len; ++p) sg[p] *= vs[srows[p] + kvh];
    }
  }
}

// decode_heads with 16-lane vectors, for D % 16 == 0: half the instructions in the two passes
// over the rows (the products, the weighted sums), and for G <= 4 the whole of a 64-wide
// head's V slices in one pass (G x 4 accumulators of AVX-512's 32 registers). The rows are
// read in place, each K or V slice converted to float32 in a register once for the G query
// heads (no float32 copy of the rows: with 32 registers the K pass holds G x J position
// accumulators); the scores' horizontal sums by halving (hsum8x16), the softmax 16 lanes wide.
// Measured against the copying version with the pools swept out of the L3 (float16 cache, 16k
// and 4k contexts, 1 and 4 sequences): 1.2-1.43x (a float32 cache 1.14-1.28x;
// docs/benchmarks.md; an Emerald Rapids Xeon). Each head's arithmetic still in a fixed order, so a
// sequence's result does not depend on its batch (it differs from the AVX2 version's in the
// last bits).
template <int G, typename KV>
PAGODA_AVX512 void decode_heads512(const float* qb, const KV* kp, const KV* vp, const int64_t* rows, int64_t len,
                                   int64_t D, int64_t kv0, int64_t kv1, float sc, float* scores, float* ob,
                                   float* mo, float* lo, const float* ks, const float* vs, const int64_t* srows,
                                   float softcap, const RowSpan* next) {
  const int64_t padded = (len + 7) / 8 * 8;
  const int64_t width = (kv1 - kv0) * D;
  prefetch_rows(kp, rows, 0, kAhead, len, kv0 * D, width);
  for (int64_t p0 = 0; p0 < len; p0 += 8) {
    prefetch_rows(kp, rows, p0 + kAhead, 8, len, kv0 * D, width);
    prefetch_rows(vp, rows, p0, 8, len, kv0 * D, width);  // V too, for the pass after the softmax
    const KV* keys[8];  // keys[j] + kvh * D: position p0 + j's K for head kvh, read in place
    for (int j = 0; j < 8; ++j) keys[j] = kp + rows[std::min(p0 + j, len - 1)];
    for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
      __m256 scale = _mm256_set1_ps(sc);
      if (ks) {
        alignas(32) float kscale[8];
        for (int j = 0; j < 8; ++j) kscale[j] = ks[srows[std::min(p0 + j, len - 1)] + kvh];
        scale = _mm256_mul_ps(scale, _mm256_load_ps(kscale));
      }
      // J positions at a time, each K slice converted once for the G query heads: G x J
      // accumulators (at most 24 of the 32 registers).
      constexpr int J = G <= 3 ? 8 : (G <= 6 ? 4 : 2);
      __m512 full[G][8];
      for (int j0 = 0; j0 < 8; j0 += J) {
        __m512 acc[G][J];
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < J; ++j) acc[g][j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) {
          __m512 qv[G];
          for (int g = 0; g < G; ++g) qv[g] = _mm512_loadu_ps(qb + (kvh * G + g) * D + i);
          for (int j = 0; j < J; ++j) {
            const __m512 kv = load16(keys[j0 + j] + kvh * D + i);
            for (int g = 0; g < G; ++g) acc[g][j] = _mm512_fmadd_ps(qv[g], kv, acc[g][j]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < J; ++j) full[g][j0 + j] = acc[g][j];
      }
      for (int g = 0; g < G; ++g)
        _mm256_storeu_ps(scores + (kvh * G + g) * padded + p0, _mm256_mul_ps(hsum8x16(full[g]), scale));
    }
  }
  chunk_softmax512(scores, padded, len, G, kv0, kv1, mo, lo, vs, srows, softcap);
  constexpr int NCH = G <= 4 ? 4 : 2;  // G x NCH accumulators, at most 24 (of 32 registers)
  std::fill(ob + kv0 * G * D, ob + kv1 * G * D, 0.f);
  // Positions in groups of 32: the accumulators loaded and stored once a group.
  for (int64_t p0 = 0; p0 < len; p0 += 32) {
    const int64_t p1 = std::min<int64_t>(len, p0 + 32);
    prefetch_rows(vp, rows, p0 + kAhead, 32, len, kv0 * D, width);
    // The next unit's K rows (this thread's next chunk), while this pass reads from the L2.
    if (next)
      prefetch_rows(kp, next->rows, p0 * next->len / len, 32 * next->len / len + 1, next->len, next->offset,
                    next->width);
    for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
      const float* sk = scores + kvh * G * padded;
      float* ok = ob + kvh * G * D;
      int64_t i = 0;
      auto pass = [&](auto nch) PAGODA_AVX512 {
        constexpr int C = decltype(nch)::value;
        __m512 acc[G][C];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c) acc[g][c] = _mm512_loadu_ps(ok + g * D + i + 16 * c);
        for (int64_t p = p0; p < p1; ++p) {
          const KV* vrow = vp + rows[p] + kvh * D + i;
          __m512 s[G];
          for (int g = 0; g < G; ++g) s[g] = _mm512_set1_ps(sk[g * padded + p]);
          for (int c = 0; c < C; ++c) {
            const __m512 vv = load16(vrow + 16 * c);
            for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(s[g], vv, acc[g][c]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c) _mm512_storeu_ps(ok + g * D + i + 16 * c, acc[g][c]);
        i += 16 * C;
      };
      for (; i + 16 * NCH <= D;) pass(std::integral_constant<int, NCH>{});
      for (; i < D;) pass(std::integral_constant<int, 1>{});
    }
  }
}

// The same for any shape (D not a multiple of 8, or more than 8 query heads per KV head).
template <typename KV>
void decode_head_generic(const float* qh, const KV* kp, const KV* vp, const int64_t* rows, int64_t len,
                         int64_t D, int64_t G, float sc, float* scores, float* out, const float* ks,
                         const float* vs, const int64_t* srows, float softcap, const float* sinks) {
  auto row = [&](const KV* base, int64_t p) { return base + rows[p]; };
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * len;
    for (int64_t p = 0; p < len; ++p) {
      const KV* kk = row(kp, p);
      float s = 0.f;
      for (int64_t i = 0; i < D; ++i) s += qh[g * D + i] * to_float(kk[i]);
      sg[p] = ks ? s * (sc * ks[srows[p]]) : s * sc;
    }
    if (softcap > 0.f) soft_cap(sg, len, softcap);
    const float mx = sinks ? std::max(*std::max_element(sg, sg + len), sinks[g]) : *std::max_element(sg, sg + len);
    float total = sinks ? std::exp(sinks[g] - mx) : 0.f;
    for (int64_t p = 0; p < len; ++p) total += (sg[p] = std::exp(sg[p] - mx));
    for (int64_t p = 0; p < len; ++p) sg[p] /= total;
    if (vs)
      for (int64_t p = 0; p < len; ++p) sg[p] *= vs[srows[p]];
    float* o = out + g * D;
    std::fill(o, o + D, 0.f);
    for (int64_t p = 0; p < len; ++p) {
      const KV* vv = row(vp, p);
      for (int64_t i = 0; i < D; ++i) o[i] += sg[p] * to_float(vv[i]);
    }
  }
}

}  // namespace

namespace {

// Positions per split-K chunk: a fixed length, so that how a sequence is cut (and so its
// summation order) depends on the sequence alone. 256 positions of a small model's K and V
// (3 KV heads of 64, float16) are 192 KiB: a chunk's rows stay in L2 between its K and V
// passes, and a 1k-token context already gives each of two cores two chunks.
constexpr int64_t kChunk = 256;

template <typename KV>
void decode_attention(const float* qp, const KV* kp, const KV* vp, const int32_t* tp, const int32_t* lp,
                      float* op, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t max_blocks,
                      float sc, const float* ks, const float* vs, int64_t window, float softcap,
                      const float* sinks) {
  const int64_t G = H / KVH;
  const bool vec = D % 8 == 0 && G >= 1 && G <= 8;
  auto first_of = [&](int64_t b) {  // a windowed layer reads positions [first, seq_len): the last `window`
    return window > 0 ? std::max<int64_t>(0, lp[b] - window) : int64_t{0};
  };
  if (!vec) {
    // Any other shape: one unit per (sequence, KV head), the whole context at once.
    at::parallel_for(0, B * KVH, 1, [&](int64_t w0, int64_t w1) {
      std::vector<float> scores;
      std::vector<int64_t> rows, srows;
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t b = w / KVH, kvh = w % KVH, first = first_of(b), len = lp[b] - first;
        scores.resize(G * len);
        rows.resize(len);
        srows.resize(len);
        const int32_t* table = tp + b * max_blocks;
        for (int64_t i = 0; i < len; ++i) {
          const int64_t p = first + i;
          srows[i] = (table[p / bs] * bs + p % bs) * KVH + kvh;
          rows[i] = srows[i] * D;
        }
        decode_head_generic<KV>(qp + (b * H + kvh * G) * D, kp, vp, rows.data(), len, D, G, sc, scores.data(),
                                op + (b * H + kvh * G) * D, ks, vs, srows.data(), softcap,
                                sinks ? sinks + kvh * G : nullptr);
      }
    });
    return;
  }
  // Chunks: sequence b's are [start[b], start[b + 1]).
  std::vector<int64_t> start(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) start[b + 1] = start[b] + (lp[b] - first_of(b) + kChunk - 1) / kChunk;
  const int64_t chunks = start[B];
  // Work units: chunks (their K/V rows, all KV heads, adjacent in the cache: streamed in
  // order), or (chunk, KV head) when there are fewer chunks than threads. A head's
  // arithmetic is the same either way.
  const int64_t split = chunks >= at::get_num_threads() ? 1 : KVH;
  const bool wide = D % 16 == 0 && use_avx512();  // decode_heads512 (read once per call)
  std::vector<float> part_o(chunks * H * D), part_m(chunks * H), part_l(chunks * H);
  at::parallel_for(0, chunks * split, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores(H * kChunk), buf(wide ? 0 : 8 * KVH * D);  // buf: decode_heads' rows as float32
    // rows/srows: this unit's; nrows/nsrows: the next one's, worked out ahead for the prefetch.
    std::vector<int64_t> rows(kChunk), srows(kChunk), nrows(kChunk), nsrows(kChunk);
    struct Unit { int64_t b, len, kv0, kv1; };
    auto unit = [&](int64_t w, int64_t* r, int64_t* sr) {  // srows[p]: position p's slot x KVH (int8 scales)
      const int64_t c = w / split;
      const int64_t b = std::upper_bound(start.begin(), start.end(), c) - start.begin() - 1;
      const int64_t p0 = first_of(b) + (c - start[b]) * kChunk, len = std::min<int64_t>(kChunk, lp[b] - p0);
      const int64_t kv0 = split == 1 ? 0 : w % split, kv1 = split == 1 ? KVH : kv0 + 1;
      const int32_t* table = tp + b * max_blocks;
      for (int64_t i = 0; i < len; ++i) {
        const int64_t p = p0 + i;
        sr[i] = (table[p / bs] * bs + p % bs) * KVH;
        r[i] = sr[i] * D;
      }
      return Unit{b, len, kv0, kv1};
    };
    Unit next = unit(w0, nrows.data(), nsrows.data());
    for (int64_t w = w0; w < w1; ++w) {
      rows.swap(nrows);
      srows.swap(nsrows);
      const Unit u = next;
      const int64_t c = w / split, b = u.b, len = u.len, kv0 = u.kv0, kv1 = u.kv1;
      const bool more = w + 1 < w1;
      if (more) next = unit(w + 1, nrows.data(), nsrows.data());
      const RowSpan ahead{nrows.data(), next.len, next.kv0 * D, (next.kv1 - next.kv0) * D};
      const float* qb = qp + b * H * D;
      float *ob = part_o.data() + c * H * D, *mo = part_m.data() + c * H, *lo = part_l.data() + c * H;
#define PAGODA_HEADS(NG)                                                                                  \
  if (wide)                                                                                               \
    decode_heads512<NG, KV>(qb, kp, vp, rows.data(), len, D, kv0, kv1, sc, scores.data(), ob, mo, lo, ks, vs, \
                            srows.data(), softcap, more ? &ahead : nullptr);                               \
  else                                                                                                    \
    decode_heads<NG, KV>(qb, kp, vp, rows.data(), len, D, kv0, kv1, sc, scores.data(), ob, mo, lo, ks, vs,    \
                         srows.data(), buf.data(), softcap);                                               \
  break;
      switch (G) {
        case 1: PAGODA_HEADS(1)
        case 2: PAGODA_HEADS(2)
        case 3: PAGODA_HEADS(3)
        case 4: PAGODA_HEADS(4)
        case 5: PAGODA_HEADS(5)
        case 6: PAGODA_HEADS(6)
        case 7: PAGODA_HEADS(7)
        default: PAGODA_HEADS(8)
      }
#undef PAGODA_HEADS
    }
  });
  // The merge, per (sequence, query head), its chunks in order. A sink (GPT-OSS) is one
  // more logit in the softmax, with no value.
  at::parallel_for(0, B * H, 16, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / H, h = w % H;
      float M = sinks ? sinks[h] : -INFINITY;
      for (int64_t c = start[b]; c < start[b + 1]; ++c) M = std::max(M, part_m[c * H + h]);
      float denom = sinks ? std::exp(sinks[h] - M) : 0.f;
      float* o = op + (b * H + h) * D;
      std::fill(o, o + D, 0.f);
      for (int64_t c = start[b]; c < start[b + 1]; ++c) {
        const float f = std::exp(part_m[c * H + h] - M);
        denom += f * part_l[c * H + h];
        const float* oc = part_o.data() + (c * H + h) * D;
        for (int64_t i = 0; i < D; ++i) o[i] += f * oc[i];
      }
      const float inv = 1.f / denom;
      for (int64_t i = 0; i < D; ++i) o[i] *= inv;
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q,             // [B, H, D] float32
                                     torch::Tensor kv_cache,      // [2, blocks, bs, KVH, D] float32, float16 or int8
                                     torch::Tensor block_tables,  // [B, max_blocks] int32
                                     torch::Tensor seq_lens,      // [B] int32
                                     double scale,
                                     c10::optional<torch::Tensor> kv_scales,  // [2, blocks, bs, KVH] (int8)
                                     int64_t window,    // > 0: attend to the last `window` positions only
                                     double softcap,  // > 0: scores -> softcap * tanh(scores / softcap) (Gemma 2)
                                     c10::optional<torch::Tensor> sinks) {  // [H] float32: GPT-OSS's sink logits
  const auto kind = kv_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 &&
              (kind == torch::kFloat32 || kind == torch::kFloat16 || kind == torch::kInt8),
              "paged_decode_attention takes float32 queries and a float32, float16 or int8 cache");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache must be a contiguous 5-D tensor");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), KVH = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && H % KVH == 0, "head shapes of q and kv_cache disagree");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.numel() == B, "one block table and length per query");
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= max_blocks * bs, "sequence length out of range");
    for (int64_t i = 0; i < (lp[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(tp[b * max_blocks + i] >= 0 && tp[b * max_blocks + i] < num_blocks, "block id out of range");
  }
  const float *ks = nullptr, *vs = nullptr;
  torch::Tensor scales;
  if (kind == torch::kInt8) {
    TORCH_CHECK(kv_scales.has_value() && kv_scales->defined(), "an int8 cache needs its scales");
    scales = kv_scales->contiguous();
    TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.numel() == 2 * num_blocks * bs * KVH,
                "kv_scales must be float32 [2, blocks, block_size, kv_heads]");
    ks = scales.data_ptr<float>();
    vs = ks + num_blocks * bs * KVH;
  }
  torch::Tensor sink_logits;
  const float* sp = nullptr;
  if (sinks.has_value() && sinks->defined()) {
    sink_logits = sinks->contiguous();
    TORCH_CHECK(sink_logits.scalar_type() == torch::kFloat32 && sink_logits.numel() == H,
                "sinks must be float32 [num_heads]");
    sp = sink_logits.data_ptr<float>();
  }
  auto out = torch::empty_like(q);
  const int64_t half_cache = num_blocks * bs * KVH * D;  // V starts after K
  const float sc = static_cast<float>(scale);
  auto run = [&](const auto* kp) {
    decode_attention(q.data_ptr<float>(), kp, kp + half_cache, tp, lp, out.data_ptr<float>(), B, H, KVH, D, bs,
                     max_blocks, sc, ks, vs, window, static_cast<float>(softcap), sp);
  };
  if (kind == torch::kFloat16)
    run(reinterpret_cast<const uint16_t*>(kv_cache.data_ptr<at::Half>()));
  else if (kind == torch::kInt8)
    run(kv_cache.data_ptr<int8_t>());
  else
    run(kv_cache.data_ptr<float>());
  return out;
}
