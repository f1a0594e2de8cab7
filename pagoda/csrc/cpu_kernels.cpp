// pagoda's CPU kernels, built on first use with torch.utils.cpp_extension
// (pagoda/ops/cpu_kernels.py), where plain torch leaves most of the machine unused or
// spends a decode step on per-op overhead:
//
// q4_linear: y = x W^T with W in 4-bit groups of 32 (asymmetric: w = d*q + m, d and m fp16,
//   q in 0..15; the GGUF Q4_1 scheme, with the nibble order of ggml: byte j of a
//   group holds weights j (low nibble) and j + 16 (high nibble)), x quantized to int8
//   per row and group of 32 (llama.cpp's Q4_1 x Q8_1): integer dot products on
//   maddubs. Single-stream decode reads every weight once per token, so its speed is
//   set by bytes per weight: 5 bits here against 32 for fp32.
// q8_linear: the same with int8 weights per output channel (q4 mode's LM head).
// i8_mm / int8_linear: int8 mode's per-token int8 x int8 products.
// gguf_linear / gguf_dequantize (gguf_blocks.cpp): exact mode's float32 products with
//   weights kept in the file's GGUF blocks, every type.
// paged_decode_attention: one query token per sequence against its K/V read in
//   place from the paged cache through the block table (no gathered, padded
//   copy). Each (sequence, query head) has a fixed summation order, so a
//   sequence's result does not depend on its batch.
// rms_norm, rope_qkv: a layer's elementwise work in one call each.
//
// Every kernel computes a row of x the same way whatever the number of rows, so a
// request's numbers do not depend on its batch, its chunking or its prefix-cache hits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <strings.h>
#include <type_traits>
#include <vector>

#include "f32_tiles.h"

namespace {

constexpr int kGroup = 32;

using pagoda::h2f;
using pagoda::hsum256;

// Unpacks one group's 16 bytes into 4 x 8 floats (weights 0-7, 8-15, 16-23, 24-31),
// still as the integers q (0..15).
inline void unpack_group(const uint8_t* p, __m256 w[4]) {
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m128i lo = _mm_and_si128(bytes, mask);
  __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

// Activations in int8 groups of 32 (what llama.cpp calls Q8_1): per row r and group g,
// x ~ xd[r, g] * xq[r, g, :], with xd = max|x| / 127 and xq rounded to nearest (ties to
// even). s[r, g] = xd * sum(xq), for the weights' minimum term: with it the kernel
// computes exactly W x' for the quantized x' (the float sum of x instead would weigh
// the quantization error by w - min rather than by w: measured 2.5x the error).
// Each row is quantized on its own, so a row's numbers do not depend on its batch.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

inline QuantizedRows quantize_rows_q8(const float* x, int64_t M, int64_t K) {
  const int64_t groups = K / kGroup;
  QuantizedRows out;
  out.q.resize(M * K);
  out.d.resize(M * groups);
  out.s.resize(M * groups);
  for (int64_t i = 0; i < M * groups; ++i) {
    const float* xg = x + i * kGroup;
    float amax = 0.f;
    for (int j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(xg[j]));
    const float d = amax / 127.f;
    const float inv = d > 0.f ? 1.f / d : 0.f;
    int8_t* qg = out.q.data() + i * kGroup;
    int32_t sum = 0;
    for (int j = 0; j < kGroup; ++j) {
      qg[j] = static_cast<int8_t>(std::nearbyint(xg[j] * inv));
      sum += qg[j];
    }
    out.d[i] = d;
    out.s[i] = d * static_cast<float>(sum);
  }
  return out;
}

// Sum of 32 products of unsigned bytes (0..127) and signed bytes as 8 float lanes.
inline __m256 dot_u8s8(__m256i u, __m256i s) {
  const __m256i ones = _mm256_set1_epi16(1);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
}

// Rows [r0, r0 + MR) of the quantized x against output channels [n0, n1) of the 4-bit
// W. Per group: sum_j (dw q_j + mw) (dx xq_j) = dw dx (q . xq) + mw dx sum(xq); the
// integer dot runs on maddubs (the 4-bit values are the unsigned operand). The
// unpacked group is reused for the MR rows.
template <int MR>
void q4_rows(const QuantizedRows& xr, int64_t K, const uint8_t* qw, const uint16_t* scales,
             const uint16_t* mins, const float* bias, float* y, int64_t N, int64_t r0, int64_t n0,
             int64_t n1) {
  const int64_t groups = K / kGroup;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wrow = qw + n * (K / 2);
    const uint16_t* d = scales + n * groups;
    const uint16_t* m = mins + n * groups;
    __m256 acc[MR];
    float macc[MR];
    for (int r = 0; r < MR; ++r) {
      acc[r] = _mm256_setzero_ps();
      macc[r] = 0.f;
    }
    for (int64_t g = 0; g < groups; ++g) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + g * 16));
      // Low lane: weights 0-15 (low nibbles); high lane: weights 16-31 (high nibbles).
      const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low);
      const float dw = h2f(d[g]), mw = h2f(m[g]);
      for (int r = 0; r < MR; ++r) {
        const int64_t i = (r0 + r) * groups + g;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.q.data() + i * kGroup));
        acc[r] = _mm256_fmadd_ps(dot_u8s8(w, xv), _mm256_set1_ps(dw * xr.d[i]), acc[r]);
        macc[r] += mw * xr.s[i];
      }
    }
    for (int r = 0; r < MR; ++r) {
      float v = hsum256(acc[r]) + macc[r];
      if (bias) v += bias[n];
      y[(r0 + r) * N + n] = v;
    }
  }
}

// Calls rows<MR>(r, n0, n1) over all M rows in blocks of four (then the remainder),
// for tiles of output channels [n0, n1) holding about 32 KiB of weights
// (row_bytes each): a tile stays in cache while every block of rows passes over it, and
// threads take whole tiles. A row's result never depends on M.
template <typename Rows4, typename Rows3, typename Rows2, typename Rows1>
void for_row_blocks(int64_t M, int64_t N, int64_t row_bytes, Rows4 r4, Rows3 r3, Rows2 r2, Rows1 r1) {
  const int64_t tile = std::max<int64_t>(4, (32768 / row_bytes) & ~int64_t(3));
  const int64_t num_tiles = (N + tile - 1) / tile;
  at::parallel_for(0, num_tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
      int64_t r = 0;
      for (; r + 4 <= M; r += 4) r4(r, n0, n1);
      switch (M - r) {
        case 3: r3(r, n0, n1); break;
        case 2: r2(r, n0, n1); break;
        case 1: r1(r, n0, n1); break;
        default: break;
      }
    }
  });
}

}  // namespace

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                        torch::Tensor mins, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  TORCH_CHECK(qweight.scalar_type() == torch::kUInt8, "qweight must be uint8");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(K % kGroup == 0, "in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(qweight.size(1) == K / 2, "qweight has ", qweight.size(1), " bytes per row, expected ", K / 2);
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == K / kGroup && mins.sizes() == scales.sizes(),
              "scales/mins must be [out_features, in_features / 32]");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat16 && mins.scalar_type() == torch::kFloat16 &&
              scales.is_contiguous() && mins.is_contiguous(), "scales/mins must be contiguous float16");
  const QuantizedRows xr = quantize_rows_q8(x.data_ptr<float>(), M, K);
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  const float* bp = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  auto rows = [&](auto mr) {
    return [&, mr](int64_t r, int64_t n0, int64_t n1) {
      q4_rows<decltype(mr)::value>(xr, K, qp, dp, mp, bp, yp, N, r, n0, n1);
    };
  };
  for_row_blocks(M, N, K / 2 + K / 8, rows(std::integral_constant<int, 4>{}), rows(std::integral_constant<int, 3>{}),
                 rows(std::integral_constant<int, 2>{}), rows(std::integral_constant<int, 1>{}));
  return y;
}

namespace {

// e^x for x <= 0 (softmax after subtracting the maximum), 8 lanes: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative error < 2e-8 there, below
// float rounding), 2^n put into the exponent bits. Below -87 the result is 0.
inline __m256 exp_neg(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, ln2 split in a high part exact in float and a low correction.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
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
// below): measured B=64, context 192, 30 layers, one thread: float32 cache 69 -> 38 ms,
// float16 47 -> 29 ms.
// rows[p]: offset of position p's K (and V) row, all KV heads, in the cache.
// An int8 cache (ks, vs non-null): K of position p and KV head h is ks[srows[p] + h] times
// its int8 values (V likewise with vs); the K scale multiplies the score, the V scale
// the softmax weight.
// Attention logit soft-capping: s -> cap * tanh(s / cap), as transformers rounds it.
inline void soft_cap(float* s, int64_t n, float cap) {
  for (int64_t p = 0; p < n; ++p) s[p] = cap * std::tanh(s[p] / cap);
}

template <int G, typename KV>
void decode_heads(const float* qb, const KV* kp, const KV* vp, const int64_t* rows, int64_t len, int64_t D,
                  int64_t kv0, int64_t kv1, float sc, float* scores, float* ob, const float* ks,
                  const float* vs, const int64_t* srows, float* buf, float softcap, const float* sinks) {
  const int64_t padded = (len + 7) / 8 * 8;
  // Eight positions' K (then V) rows, heads kv0..kv1, copied as float32 into buf (room for
  // 8 x (kv1 - kv0) x D) one row after another: read in address order, the cache streams
  // from memory (the passes below jump between rows; reading the cache that way took twice
  // as long), and a float16 or int8 element is converted once, not once per query head.
  const int64_t width = (kv1 - kv0) * D;
  for (int64_t p0 = 0; p0 < len; p0 += 8) {
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
  // Softmax over the len real positions (the padding lanes repeat the last key and are
  // set to 0 so they add nothing).
  for (int64_t h = kv0 * G; h < kv1 * G; ++h) {
    float* sg = scores + h * padded;
    if (softcap > 0.f) soft_cap(sg, padded, softcap);
    // The maximum over the padding too: its lanes repeat the last position's score.
    __m256 vmx = _mm256_loadu_ps(sg);
    for (int64_t p0 = 8; p0 < padded; p0 += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(sg + p0));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmx);
    // A sink (GPT-OSS) is one more logit in the softmax, with no value.
    const float mx = sinks ? std::max(*std::max_element(lanes, lanes + 8), sinks[h])
                           : *std::max_element(lanes, lanes + 8);
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
    const __m256 inv = _mm256_set1_ps(1.f / (hsum256(tot) + (sinks ? std::exp(sinks[h] - mx) : 0.f)));
    for (int64_t p0 = 0; p0 < padded; p0 += 8) _mm256_storeu_ps(sg + p0, _mm256_mul_ps(_mm256_loadu_ps(sg + p0), inv));
    if (vs) {
      const int64_t kvh = h / G;
      for (int64_t p = 0; p < len; ++p) sg[p] *= vs[srows[p] + kvh];
    }
  }
  // NCH slices per pass: G x NCH accumulators, at most 12 (of 16 registers).
  constexpr int NCH = G <= 3 ? 4 : (G <= 6 ? 2 : 1);
  std::fill(ob + kv0 * G * D, ob + kv1 * G * D, 0.f);
  for (int64_t p0 = 0; p0 < len; p0 += 8) {
    const int64_t p1 = std::min(len, p0 + 8);
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

template <typename KV>
void decode_attention(const float* qp, const KV* kp, const KV* vp, const int32_t* tp, const int32_t* lp,
                      float* op, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t max_blocks,
                      float sc, const float* ks, const float* vs, int64_t window, float softcap,
                      const float* sinks) {
  const int64_t G = H / KVH;
  const bool vec = D % 8 == 0 && G >= 1 && G <= 8;
  // Work units: whole sequences (their K/V rows, all KV heads, are adjacent in the
  // cache: streamed in order), or (sequence, KV head) when there are fewer sequences
  // than threads. Each head's arithmetic is the same either way, so a sequence's result
  // does not depend on its batch.
  const int64_t split = vec && B >= at::get_num_threads() ? 1 : KVH;
  at::parallel_for(0, B * split, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores, buf(8 * KVH * D);  // buf: decode_heads' rows as float32
    std::vector<int64_t> rows, srows;  // srows[p]: position p's slot x KVH (an int8 cache's scales)
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / split;
      // A windowed layer reads positions [first, seq_len): the last `window` ones.
      const int64_t first = window > 0 ? std::max<int64_t>(0, lp[b] - window) : 0, len = lp[b] - first;
      const int64_t kv0 = split == 1 ? 0 : w % split, kv1 = split == 1 ? KVH : kv0 + 1;
      const int64_t padded = (len + 7) / 8 * 8;
      scores.resize(H * padded);
      rows.resize(len);
      srows.resize(len);
      const int32_t* table = tp + b * max_blocks;
      for (int64_t i = 0; i < len; ++i) {
        const int64_t p = first + i;
        srows[i] = (table[p / bs] * bs + p % bs) * KVH;
        rows[i] = srows[i] * D;
      }
      const float* qb = qp + b * H * D;
      float* ob = op + b * H * D;
      if (!vec) {
        for (int64_t kvh = kv0; kvh < kv1; ++kvh) {
          for (int64_t i = 0; i < len; ++i) {
            const int64_t p = first + i;
            srows[i] = (table[p / bs] * bs + p % bs) * KVH + kvh;
            rows[i] = srows[i] * D;
          }
          decode_head_generic<KV>(qb + kvh * G * D, kp, vp, rows.data(), len, D, G, sc, scores.data(),
                                  ob + kvh * G * D, ks, vs, srows.data(), softcap, sinks ? sinks + kvh * G : nullptr);
        }
        continue;
      }
#define PAGODA_HEADS(NG) decode_heads<NG, KV>(qb, kp, vp, rows.data(), len, D, kv0, kv1, sc, scores.data(), ob, ks, vs, srows.data(), buf.data(), softcap, sinks); break;
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

// ---- int8 weights per output channel (w = s * q) --------------------------------
// q4 mode's 8-bit LM head: one byte per weight instead of four. Small steps quantize
// the activations in groups of 32 as q4_linear does and run integer dots; large ones
// dequantize tiles and use BLAS.

namespace {

// Rows [r0, r0 + MR) of the quantized x against output channels n .. n + NC - 1:
// per group, |w| * (x with w's sign) = w * x keeps maddubs' unsigned operand first.
template <int MR, int NC>
inline void q8_block(const QuantizedRows& xr, int64_t K, const int8_t* qw, const float* scales, float* y,
                     int64_t N, int64_t r0, int64_t n) {
  const int64_t groups = K / kGroup;
  __m256 acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i w[NC], aw[NC];
    for (int c = 0; c < NC; ++c) {
      w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + (n + c) * K + g * kGroup));
      aw[c] = _mm256_sign_epi8(w[c], w[c]);  // |w| (weights are in -127..127)
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (r0 + r) * groups + g;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.q.data() + i * kGroup));
      const __m256 dx = _mm256_set1_ps(xr.d[i]);
      for (int c = 0; c < NC; ++c)
        acc[r][c] = _mm256_fmadd_ps(dot_u8s8(aw[c], _mm256_sign_epi8(xv, w[c])), dx, acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) y[(r0 + r) * N + n + c] = hsum256(acc[r][c]) * scales[n + c];
}

template <int MR>
void q8_rows(const QuantizedRows& xr, int64_t K, const int8_t* qw, const float* scales, float* y,
             int64_t N, int64_t r0, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) q8_block<MR, 2>(xr, K, qw, scales, y, N, r0, n);
  for (; n < n1; ++n) q8_block<MR, 1>(xr, K, qw, scales, y, N, r0, n);
}

}  // namespace

// y = x W^T, W int8 per output channel [N, K], x quantized in int8 groups of 32 per
// row. Any number of rows: the output channels are cut into tiles small enough to stay
// in cache while every block of four rows of x passes over them. A row's result does
// not depend on how many rows share the call.
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  TORCH_CHECK(qweight.scalar_type() == torch::kInt8 && qweight.is_contiguous(), "qweight must be contiguous int8");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K && K % kGroup == 0, "qweight must be [out, in] with in % 32 == 0");
  TORCH_CHECK(scales.numel() == N && scales.scalar_type() == torch::kFloat32, "scales must be float32 [out_features]");
  const QuantizedRows xr = quantize_rows_q8(x.data_ptr<float>(), M, K);
  auto y = torch::empty({M, N}, x.options());
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto rows = [&](auto mr) {
    return [&, mr](int64_t r, int64_t n0, int64_t n1) {
      q8_rows<decltype(mr)::value>(xr, K, qp, sp, yp, N, r, n0, n1);
    };
  };
  for_row_blocks(M, N, K, rows(std::integral_constant<int, 4>{}), rows(std::integral_constant<int, 3>{}),
                 rows(std::integral_constant<int, 2>{}), rows(std::integral_constant<int, 1>{}));
  return y;
}

// ---- int8 x int8 -> int32, for small steps of int8 mode ------------------------
// Exact integer dot products, so a token's result is bit-identical to what
// torch._int_mm gives it in a large step: int8 mode's numbers do not depend on the
// step size (batch, prefix-cache hits, chunking).

namespace {

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

template <int MR>
void i8_rows(const int8_t* x, int64_t K, const int8_t* qw, int32_t* y, int64_t N, int64_t r0,
             int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wrow = qw + n * K;
    __m256i acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K; k += 16) {
      __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + k)));
      for (int r = 0; r < MR; ++r) {
        __m256i xv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + (r0 + r) * K + k)));
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(w, xv));
      }
    }
    for (int r = 0; r < MR; ++r) y[(r0 + r) * N + n] = hsum_epi32(acc[r]);
  }
}

}  // namespace

torch::Tensor i8_mm(torch::Tensor xq, torch::Tensor qweight) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == torch::kInt8, "xq must be a 2-D int8 tensor");
  TORCH_CHECK(qweight.scalar_type() == torch::kInt8 && qweight.is_contiguous(), "qweight must be contiguous int8");
  xq = xq.contiguous();
  const int64_t M = xq.size(0), K = xq.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K && K % 16 == 0, "qweight must be [out, in] with in % 16 == 0");
  auto y = torch::empty({M, N}, xq.options().dtype(torch::kInt32));
  const int8_t* xp = xq.data_ptr<int8_t>();
  const int8_t* qp = qweight.data_ptr<int8_t>();
  int32_t* yp = y.data_ptr<int32_t>();
  auto rows = [&](auto mr) {
    return [&, mr](int64_t r, int64_t n0, int64_t n1) { i8_rows<decltype(mr)::value>(xp, K, qp, yp, N, r, n0, n1); };
  };
  for_row_blocks(M, N, K, rows(std::integral_constant<int, 4>{}), rows(std::integral_constant<int, 3>{}),
                 rows(std::integral_constant<int, 2>{}), rows(std::integral_constant<int, 1>{}));
  return y;
}

// ---- int8 mode's linear layer, whole ----------------------------------------------
// A few input channels (outlier_idx, chosen at load time where activations are
// largest) stay in float32 (outlier_w [k, N], their weight columns transposed); the
// rest go through per-token quantization (scale max|x| / 127 over the other channels,
// values round(x / scale)), the int8 x int8 product and the rescale by (token scale x
// channel scale), plus bias, plus the outlier channels' float products (fused
// multiply-adds), in one call; the plain-torch version of Int8Linear computes the same
// to rounding.
//
// The product runs one of two ways, with the same integers (exact sums) and the same
// float epilogue, operation for operation, so both give every element the same bits:
// - AVX2 (any x86-64 CPU the kernels build for): i8_mm's GEMV up to small_rows rows,
//   torch._int_mm above, then the epilogue over the int32 products;
// - AVX-512 VNNI, when the CPU has it and the layer was packed for it (int8_pack_vnni):
//   vpdpbusd (64 u8 x s8 products a instruction, int32 sums) for every step size, and
//   the epilogue applied to each tile while its sums are in registers (no int32
//   product matrix in memory). See int8_vnni_tiles.

namespace {

// Per-token quantization of x's inlier channels: xs[m] = max|x[m, inliers]| / 127,
// q[m, k] = round(x[m, k] / xs[m]) (ties to even; 0 at the outlier channels), stored as
// int8, or as unsigned q + 128 when to_unsigned (VNNI's unsigned operand). xo[m, j]:
// the outlier channels' float activations.
void quantize_tokens(const float* xp, int64_t M, int64_t K, const int64_t* oi, int64_t NO, bool to_unsigned,
                     int8_t* qp, float* xs, float* xo) {
  std::vector<float> row(K);
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  const __m128i flip = _mm_set1_epi8(to_unsigned ? static_cast<char>(0x80) : 0);
  for (int64_t m = 0; m < M; ++m) {
    std::copy(xp + m * K, xp + (m + 1) * K, row.begin());
    for (int64_t j = 0; j < NO; ++j) {
      xo[m * NO + j] = row[oi[j]];
      row[oi[j]] = 0.f;
    }
    const float* r = row.data();
    int8_t* q = qp + m * K;
    int64_t k = 0;
    __m256 vmax = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(r + k)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    float amax = *std::max_element(lanes, lanes + 8);
    for (; k < K; ++k) amax = std::max(amax, std::fabs(r[k]));
    const float sc = std::max(amax, 1e-12f) / 127.f;
    xs[m] = sc;
    // round(x / scale), ties to even (the default rounding of cvtps_epi32 and nearbyint).
    const __m256 scv = _mm256_set1_ps(sc);
    for (k = 0; k + 8 <= K; k += 8) {
      const __m256i i32 = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(r + k), scv));
      const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_xor_si128(_mm_packs_epi16(i16, i16), flip));
    }
    for (; k < K; ++k) {
      const int8_t v = static_cast<int8_t>(std::nearbyint(r[k] / sc));
      q[k] = to_unsigned ? static_cast<int8_t>(static_cast<uint8_t>(v) ^ 0x80u) : v;
    }
  }
}

struct Int8Epilogue {
  const float* xs;   // [M] token scales
  const float* ws;   // [N] channel scales
  const float* bias; // [N] or null
  const float* xo;   // [M, NO] outlier activations
  const float* wo;   // [NO, N] outlier weights
  int64_t NO, N;
  float* y;          // [M, N]
};

// The AVX2 epilogue over the int32 products ap [M, N]: y = ap * (xs x ws) + bias, then
// the outlier channels' products in index order.
void int8_epilogue_avx2(const int32_t* ap, int64_t M, const Int8Epilogue& e) {
  const int64_t N = e.N, NO = e.NO;
  auto init = [&](int64_t m, int64_t n) {
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ap + m * N + n))),
                             _mm256_mul_ps(_mm256_set1_ps(e.xs[m]), _mm256_loadu_ps(e.ws + n)));
    return e.bias ? _mm256_add_ps(v, _mm256_loadu_ps(e.bias + n)) : v;
  };
  // Blocks of 256 channels, so a block's outlier weights (NO x 256 floats) stay in
  // cache while every row passes; within a block, MR rows and 32 channels at a time
  // (MR x 4 accumulators: each outlier weight load serves MR rows), then eight channels,
  // then one. Every output element gets the same operations in the same order whatever
  // the blocking (rescale, bias, then the outlier channels' products in index order),
  // so a row's result does not depend on M.
  auto rows_block = [&](auto mr, int64_t m0, int64_t n0, int64_t n1) {
    constexpr int MR = decltype(mr)::value;
    int64_t n = n0;
    for (; n + 32 <= n1; n += 32) {
      __m256 v[MR][4];
      for (int r = 0; r < MR; ++r)
        for (int c = 0; c < 4; ++c) v[r][c] = init(m0 + r, n + 8 * c);
      for (int64_t j = 0; j < NO; ++j) {
        const float* wj = e.wo + j * N + n;
        __m256 w[4];
        for (int c = 0; c < 4; ++c) w[c] = _mm256_loadu_ps(wj + 8 * c);
        for (int r = 0; r < MR; ++r) {
          const __m256 xj = _mm256_broadcast_ss(e.xo + (m0 + r) * NO + j);
          for (int c = 0; c < 4; ++c) v[r][c] = _mm256_fmadd_ps(xj, w[c], v[r][c]);
        }
      }
      for (int r = 0; r < MR; ++r)
        for (int c = 0; c < 4; ++c) _mm256_storeu_ps(e.y + (m0 + r) * N + n + 8 * c, v[r][c]);
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t m = m0 + r;
      const float* xm = e.xo + m * NO;
      float* ym = e.y + m * N;
      int64_t k = n;
      for (; k + 8 <= n1; k += 8) {
        __m256 v = init(m, k);
        for (int64_t j = 0; j < NO; ++j) v = _mm256_fmadd_ps(_mm256_set1_ps(xm[j]), _mm256_loadu_ps(e.wo + j * N + k), v);
        _mm256_storeu_ps(ym + k, v);
      }
      for (; k < n1; ++k) {
        float v = static_cast<float>(ap[m * N + k]) * (e.xs[m] * e.ws[k]);
        if (e.bias) v += e.bias[k];
        for (int64_t j = 0; j < NO; ++j) v = std::fma(xm[j], e.wo[j * N + k], v);
        ym[k] = v;
      }
    }
  };
  constexpr int64_t kBlock = 256;
  for (int64_t n0 = 0; n0 < N; n0 += kBlock) {
    const int64_t n1 = std::min(N, n0 + kBlock);
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) rows_block(std::integral_constant<int, 3>{}, m, n0, n1);
    for (; m + 2 <= M; m += 2) rows_block(std::integral_constant<int, 2>{}, m, n0, n1);
    for (; m < M; ++m) rows_block(std::integral_constant<int, 1>{}, m, n0, n1);
  }
}

// ---- AVX-512 VNNI ----
// Compiled for AVX-512 whatever the build flags (function attribute), called only when
// the CPU has it (use_avx512 / avx512_enabled). Weights packed per tile of 64 output channels:
// [N/64][K/4][64][4] (int8_pack_vnni), so one step of four input channels is 256
// contiguous bytes, four registers of 16 channels x 4 bytes: vpdpbusd adds, per channel,
// the four products of a broadcast 4-byte group of the (unsigned) activations. Signed x
// signed runs as (q + 128) x w, the 128 x sum(w) of each channel subtracted by starting
// its sums at comp[n] = -128 x sum_k w[n, k]: exact, the same integers as q x w.
#define PAGODA_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

constexpr int64_t kVnniTile = 64;

// The integer sums of MR rows x 64 channels into sums[MR][64] (its own function: with
// the epilogue beside it, GCC spilled the accumulators to the stack at every step).
template <int MR>
PAGODA_AVX512 __attribute__((noinline)) void vnni_dot(const uint8_t* x0, int64_t K, const int8_t* wt,
                                                      const int32_t* comp, int32_t* sums) {
  __m512i acc[MR][4];
  const __m512i c0 = _mm512_loadu_si512(comp), c1 = _mm512_loadu_si512(comp + 16);
  const __m512i c2 = _mm512_loadu_si512(comp + 32), c3 = _mm512_loadu_si512(comp + 48);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = c0;
    acc[r][1] = c1;
    acc[r][2] = c2;
    acc[r][3] = c3;
  }
  for (int64_t k = 0; k < K; k += 4, wt += 256) {
    const __m512i w0 = _mm512_loadu_si512(wt), w1 = _mm512_loadu_si512(wt + 64);
    const __m512i w2 = _mm512_loadu_si512(wt + 128), w3 = _mm512_loadu_si512(wt + 192);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t g;
      std::memcpy(&g, x0 + r * K + k, 4);
      const __m512i xb = _mm512_set1_epi32(g);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xb, w1);
      acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], xb, w2);
      acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], xb, w3);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_si512(sums + r * 64, acc[r][0]);
    _mm512_storeu_si512(sums + r * 64 + 16, acc[r][1]);
    _mm512_storeu_si512(sums + r * 64 + 32, acc[r][2]);
    _mm512_storeu_si512(sums + r * 64 + 48, acc[r][3]);
  }
}

// MR rows from m0 against one tile (channels n0 .. n0 + 64, the last tile masked to N),
// then the epilogue in the same order of operations as int8_epilogue_avx2's.
template <int MR>
PAGODA_AVX512 void vnni_rows(const uint8_t* xu, int64_t K, const int8_t* wt, const int32_t* comp, int64_t m0,
                             int64_t n0, const Int8Epilogue& e) {
  alignas(64) int32_t sums[MR * 64];
  vnni_dot<MR>(xu + m0 * K, K, wt, comp + n0, sums);
  const int64_t N = e.N, NO = e.NO;
  __mmask16 mask[4];
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const int64_t left = N - (n0 + 16 * c);
    mask[c] = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
  }
  __m512 v[MR][4];
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512 ws = _mm512_maskz_loadu_ps(mask[c], e.ws + n0 + 16 * c);
    const __m512 bs = e.bias ? _mm512_maskz_loadu_ps(mask[c], e.bias + n0 + 16 * c) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      v[r][c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + r * 64 + 16 * c)), _mm512_mul_ps(_mm512_set1_ps(e.xs[m0 + r]), ws));
      if (e.bias) v[r][c] = _mm512_add_ps(v[r][c], bs);
    }
  }
  for (int64_t j = 0; j < NO; ++j) {
    const float* wj = e.wo + j * N + n0;
    const __m512 o0 = _mm512_maskz_loadu_ps(mask[0], wj), o1 = _mm512_maskz_loadu_ps(mask[1], wj + 16);
    const __m512 o2 = _mm512_maskz_loadu_ps(mask[2], wj + 32), o3 = _mm512_maskz_loadu_ps(mask[3], wj + 48);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 xj = _mm512_set1_ps(e.xo[(m0 + r) * NO + j]);
      v[r][0] = _mm512_fmadd_ps(xj, o0, v[r][0]);
      v[r][1] = _mm512_fmadd_ps(xj, o1, v[r][1]);
      v[r][2] = _mm512_fmadd_ps(xj, o2, v[r][2]);
      v[r][3] = _mm512_fmadd_ps(xj, o3, v[r][3]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_mask_storeu_ps(e.y + (m0 + r) * N + n0 + 16 * c, mask[c], v[r][c]);
}

// Tiles [t0, t1) of 64 channels, every row: rows go six at a time (24 accumulators),
// then the remainder; a tile's weights (64 x K bytes) stay in cache while the rows pass.
// A row's numbers do not depend on M or on which rows share its block.
PAGODA_AVX512 void int8_vnni_tiles(const uint8_t* xu, int64_t M, int64_t K, const int8_t* packed,
                                   const int32_t* comp, const Int8Epilogue& e, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const int8_t* wt = packed + t * kVnniTile * K;
    const int64_t n0 = t * kVnniTile;
    int64_t m = 0;
    for (; m + 6 <= M; m += 6) vnni_rows<6>(xu, K, wt, comp, m, n0, e);
    switch (M - m) {
      case 5: vnni_rows<5>(xu, K, wt, comp, m, n0, e); break;
      case 4: vnni_rows<4>(xu, K, wt, comp, m, n0, e); break;
      case 3: vnni_rows<3>(xu, K, wt, comp, m, n0, e); break;
      case 2: vnni_rows<2>(xu, K, wt, comp, m, n0, e); break;
      case 1: vnni_rows<1>(xu, K, wt, comp, m, n0, e); break;
      default: break;
    }
  }
}

}  // namespace

bool cpu_has_avx512_vnni() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return has;
}

// Whether the AVX-512 versions run: the CPU has them and PAGODA_CPU_ISA is not "avx2"
// (any case; read at every call, so a test can compare the two versions in one process).
bool use_avx512() {
  const char* isa = std::getenv("PAGODA_CPU_ISA");
  return cpu_has_avx512_vnni() && !(isa && strcasecmp(isa, "avx2") == 0);
}

// qweight [N, K] int8 -> (packed [ceil(N/64) * 64 * K] int8 in the tile layout above,
// zero channels past N; comp [ceil(N/64) * 64] int32 = -128 x each channel's sum).
std::vector<torch::Tensor> int8_pack_vnni(torch::Tensor qweight) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == torch::kInt8, "qweight must be a 2-D int8 tensor");
  qweight = qweight.contiguous();
  const int64_t N = qweight.size(0), K = qweight.size(1);
  TORCH_CHECK(K % 4 == 0, "in_features must be a multiple of 4, got ", K);
  const int64_t tiles = (N + kVnniTile - 1) / kVnniTile;
  auto packed = torch::zeros({tiles * kVnniTile * K}, qweight.options());
  auto comp = torch::zeros({tiles * kVnniTile}, qweight.options().dtype(torch::kInt32));
  const int8_t* w = qweight.data_ptr<int8_t>();
  int8_t* p = packed.data_ptr<int8_t>();
  int32_t* cp = comp.data_ptr<int32_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = n / kVnniTile, c = n % kVnniTile;
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      p[t * kVnniTile * K + (k / 4) * (kVnniTile * 4) + c * 4 + k % 4] = w[n * K + k];
      sum += w[n * K + k];
    }
    cp[n] = -128 * sum;
  }
  return {packed, comp};
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor weight_scale,
                          c10::optional<torch::Tensor> bias, int64_t small_rows,
                          torch::Tensor outlier_idx, torch::Tensor outlier_w,
                          c10::optional<torch::Tensor> vnni_weight, c10::optional<torch::Tensor> vnni_comp) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  x = x.contiguous();
  // N from the scales: with the VNNI layout given, qweight may be empty (the layer keeps
  // one copy of its int8 weights, in that layout).
  const int64_t M = x.size(0), K = x.size(1), N = weight_scale.numel(), NO = outlier_idx.numel();
  const bool vnni = vnni_weight.has_value() && vnni_weight->defined();
  TORCH_CHECK((vnni && qweight.numel() == 0) || (qweight.dim() == 2 && qweight.size(0) == N && qweight.size(1) == K),
              "qweight does not match x and weight_scale");
  TORCH_CHECK(outlier_idx.scalar_type() == torch::kInt64 && outlier_w.scalar_type() == torch::kFloat32 &&
              outlier_w.is_contiguous() && outlier_w.size(0) == NO && (NO == 0 || outlier_w.size(1) == N),
              "outlier_idx must be int64 [k] and outlier_w contiguous float32 [k, out_features]");
  TORCH_CHECK(weight_scale.scalar_type() == torch::kFloat32 && weight_scale.numel() == N && weight_scale.is_contiguous(),
              "weight_scale must be contiguous float32 [out_features]");
  const float* bp = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  TORCH_CHECK(!bp || (bias->numel() == N && bias->is_contiguous()), "bias must be contiguous [out_features]");
  const int64_t* oi = outlier_idx.data_ptr<int64_t>();
  for (int64_t j = 0; j < NO; ++j) TORCH_CHECK(oi[j] >= 0 && oi[j] < K, "outlier index out of range");
  const int64_t tiles = (N + kVnniTile - 1) / kVnniTile;
  if (vnni) {
    TORCH_CHECK(cpu_has_avx512_vnni(), "vnni_weight given but this CPU lacks AVX-512 VNNI");
    TORCH_CHECK(vnni_comp.has_value() && vnni_comp->defined(), "vnni_weight needs vnni_comp");
    TORCH_CHECK(vnni_weight->scalar_type() == torch::kInt8 && vnni_weight->is_contiguous() &&
                vnni_weight->numel() == tiles * kVnniTile * K && K % 4 == 0,
                "vnni_weight must be int8_pack_vnni(qweight)'s packed tensor");
    TORCH_CHECK(vnni_comp->scalar_type() == torch::kInt32 && vnni_comp->is_contiguous() &&
                vnni_comp->numel() == tiles * kVnniTile, "vnni_comp must be int8_pack_vnni(qweight)'s sums");
  }
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  std::vector<float> xs(M), xo(M * NO);
  quantize_tokens(x.data_ptr<float>(), M, K, oi, NO, vnni, xq.data_ptr<int8_t>(), xs.data(), xo.data());
  auto y = torch::empty({M, N}, x.options());
  const Int8Epilogue e{xs.data(), weight_scale.data_ptr<float>(), bp, xo.data(), outlier_w.data_ptr<float>(),
                       NO, N, y.data_ptr<float>()};
  if (vnni) {
    const uint8_t* xu = reinterpret_cast<const uint8_t*>(xq.data_ptr<int8_t>());
    const int8_t* pw = vnni_weight->data_ptr<int8_t>();
    const int32_t* cp = vnni_comp->data_ptr<int32_t>();
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) { int8_vnni_tiles(xu, M, K, pw, cp, e, t0, t1); });
    return y;
  }
  auto acc = M <= small_rows ? i8_mm(xq, qweight) : at::_int_mm(xq, qweight.t());
  int8_epilogue_avx2(acc.data_ptr<int32_t>(), M, e);
  return y;
}

// ---- SiLU(gate) * up --------------------------------------------------------------
// The MLP's activation in one pass over the fused gate/up projection's output, with
// torch's own arithmetic: ATen's vectorised SiLU is x / (1 + exp(-x)) with exp from
// SLEEF (Sleef_expf16_u10 / Sleef_expf8_u10, exported by libtorch_cpu), and the
// product by up is one rounding more, so every element has the bits of
// F.silu(gate) * up (tested). Rows whose width is not a multiple of 32 would meet
// ATen's scalar tail (libm's expf), so the caller keeps torch for those.

extern "C" __m512 Sleef_expf16_u10(__m512);
extern "C" __m256 Sleef_expf8_u10(__m256);

namespace {

PAGODA_AVX512 void silu_mul_rows512(const float* gu, float* out, int64_t M, int64_t I) {
  const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gu + m * 2 * I;
    const float* u = g + I;
    float* o = out + m * I;
    for (int64_t i = 0; i < I; i += 16) {
      const __m512 x = _mm512_loadu_ps(g + i);
      const __m512 e = Sleef_expf16_u10(_mm512_xor_ps(sign, x));
      _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
    }
  }
}

void silu_mul_rows256(const float* gu, float* out, int64_t M, int64_t I) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gu + m * 2 * I;
    const float* u = g + I;
    float* o = out + m * I;
    for (int64_t i = 0; i < I; i += 8) {
      const __m256 x = _mm256_loadu_ps(g + i);
      const __m256 e = Sleef_expf8_u10(_mm256_xor_ps(sign, x));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
  }
}

}  // namespace

// SiLU(gate) x up for M rows of [gate | up] (width 2I, I a multiple of 32), the bits of
// silu_mul (used by the MoE kernel in gguf_blocks.cpp).
void pagoda_silu_mul_rows(const float* gu, float* out, int64_t M, int64_t I) {
  if (use_avx512())
    silu_mul_rows512(gu, out, M, I);
  else
    silu_mul_rows256(gu, out, M, I);
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == torch::kFloat32 && gate_up.is_contiguous(),
              "gate_up must be a contiguous 2-D float32 tensor");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I && I % 32 == 0, "gate_up's width must be 2 x a multiple of 32");
  auto out = torch::empty({M, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool wide = use_avx512();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    if (wide)
      silu_mul_rows512(gp + m0 * 2 * I, op + m0 * I, m1 - m0, I);
    else
      silu_mul_rows256(gp + m0 * 2 * I, op + m0 * I, m1 - m0, I);
  });
  return out;
}

// ---- per-layer elementwise work -------------------------------------------------------
// A decode step of a small model is dominated by per-op overhead: each torch op costs a
// few microseconds whatever its size, and a layer had ~40 of them. These fuse the
// elementwise runs into one call each.

// Index of each row's largest element, as torch.argmax(dim=-1) gives it (the first of
// equal maxima; the first NaN if a row has one), in two vector passes over the row
// instead of torch's scalar index-tracking loop: the greedy sampler's argmax over the
// vocabulary was 2.6 ms for 64 rows of 49,152, this is about a tenth of that.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) > 0,
              "x must be a 2-D float32 tensor with at least one column");
  x = x.contiguous();
  const int64_t M = x.size(0), N = x.size(1);
  auto out = torch::empty({M}, x.options().dtype(torch::kInt64));
  int64_t* op = out.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* r = xp + m * N;
    __m256 vmax = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= N; i += 8) {
      const __m256 v = _mm256_loadu_ps(r + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      vmax = _mm256_max_ps(vmax, v);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    float best = *std::max_element(lanes, lanes + 8);
    bool has_nan = _mm256_movemask_ps(nan) != 0;
    for (; i < N; ++i) {
      has_nan |= std::isnan(r[i]);
      best = std::max(best, r[i]);
    }
    int64_t idx = 0;
    if (has_nan) {
      while (!std::isnan(r[idx])) ++idx;
    } else {
      const __m256 target = _mm256_set1_ps(best);
      i = 0;
      for (; i + 8 <= N; i += 8) {
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + i), target, _CMP_EQ_OQ));
        if (mask) break;
      }
      while (r[i] != best) ++i;
      idx = i;
    }
    op[m] = idx;
  }
  return out;
}

// RMSNorm of each row: w * x / sqrt(mean(x^2) + eps). With a residual: the residual
// becomes residual + x (in place) and is what gets normalized, the pre-norm
// transformer's "add, then norm" in one pass.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                       c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous 2-D float32 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(weight.numel() == K && weight.scalar_type() == torch::kFloat32, "weight must be float32 [hidden]");
  float* rp = nullptr;
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                residual->scalar_type() == torch::kFloat32, "residual must match x");
    rp = residual->data_ptr<float>();
  }
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* src = xp + m * K;
    if (rp) {
      float* r = rp + m * K;
      for (int64_t k = 0; k < K; ++k) r[k] += src[k];
      src = r;
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t k = 0; k < K; ++k) ss += src[k] * src[k];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(K) + static_cast<float>(eps));
    float* dst = op + m * K;
    for (int64_t k = 0; k < K; ++k) dst[k] = wp[k] * (src[k] * inv);
  }
  return out;
}

// Rotary embedding (rotate-half layout) of the q and k parts of the fused qkv
// projection, returned as contiguous q [T, H, D], k and v [T, KVH, D]. With a float32
// cache, k and v are also written to their slots (slot_mapping), so attention only
// reads (a float16 cache gets them rounded to float16). cos and sin: [T, D] (the two
// halves repeat).
std::vector<torch::Tensor> rope_qkv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                    int64_t num_heads, int64_t num_kv_heads,
                                    c10::optional<torch::Tensor> kv_cache,
                                    c10::optional<torch::Tensor> slot_mapping,
                                    c10::optional<torch::Tensor> kv_scales) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat32, "qkv must be a 2-D float32 tensor");
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t T = qkv.size(0);
  TORCH_CHECK(qkv.size(1) % (num_heads + 2 * num_kv_heads) == 0, "qkv width does not match the heads");
  const int64_t D = qkv.size(1) / (num_heads + 2 * num_kv_heads), half = D / 2;
  TORCH_CHECK(cos.size(0) == T && cos.size(-1) == D && sin.sizes() == cos.sizes(), "cos/sin must be [T, head_dim]");
  auto q = torch::empty({T, num_heads, D}, qkv.options());
  auto k = torch::empty({T, num_kv_heads, D}, qkv.options());
  auto v = torch::empty({T, num_kv_heads, D}, qkv.options());
  float *kc = nullptr, *vc = nullptr;
  uint16_t *kh = nullptr, *vh = nullptr;  // a float16 cache
  int8_t *k8 = nullptr, *v8 = nullptr;      // an int8 cache, with a scale per (slot, KV head)
  float *k8s = nullptr, *v8s = nullptr;
  const int64_t* slots = nullptr;
  torch::Tensor slot_t;
  if (kv_cache.has_value() && kv_cache->defined()) {
    const auto kind = kv_cache->scalar_type();
    const bool half = kind == torch::kFloat16;
    TORCH_CHECK((half || kind == torch::kFloat32 || kind == torch::kInt8) && kv_cache->is_contiguous() &&
                kv_cache->dim() == 5 && kv_cache->size(3) == num_kv_heads && kv_cache->size(4) == D,
                "kv_cache must be a contiguous float32, float16 or int8 [2, blocks, block_size, kv_heads, head_dim]");
    TORCH_CHECK(slot_mapping.has_value() && slot_mapping->numel() == T &&
                slot_mapping->scalar_type() == torch::kInt64, "slot_mapping must be int64 [T]");
    const int64_t num_slots = kv_cache->size(1) * kv_cache->size(2);
    const int64_t v_offset = num_slots * num_kv_heads * D;
    slot_t = slot_mapping->contiguous();
    slots = slot_t.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
    if (kind == torch::kInt8) {
      TORCH_CHECK(kv_scales.has_value() && kv_scales->defined() && kv_scales->is_contiguous() &&
                  kv_scales->scalar_type() == torch::kFloat32 && kv_scales->numel() == 2 * num_slots * num_kv_heads,
                  "an int8 cache needs contiguous float32 scales [2, blocks, block_size, kv_heads]");
      k8 = kv_cache->data_ptr<int8_t>();
      v8 = k8 + v_offset;
      k8s = kv_scales->data_ptr<float>();
      v8s = k8s + num_slots * num_kv_heads;
    } else if (half) {
      kh = reinterpret_cast<uint16_t*>(kv_cache->data_ptr<at::Half>());
      vh = kh + v_offset;
    } else {
      kc = kv_cache->data_ptr<float>();
      vc = kc + v_offset;
    }
  }
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const int64_t width = qkv.size(1);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = src + t * width;
    const float* c = cp + t * D;
    const float* sn = sp + t * D;
    auto rotate = [&](const float* in, float* out, int64_t heads) {
      const __m256 sign_bit = _mm256_set1_ps(-0.f);
      for (int64_t h = 0; h < heads; ++h) {
        const float* x = in + h * D;
        float* y = out + h * D;
        int64_t i = 0;
        // Eight lanes at a time, the same multiplies and add per element as below.
        for (; i + 8 <= half; i += 8) {
          const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + half);
          _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                                _mm256_mul_ps(_mm256_xor_ps(b, sign_bit), _mm256_loadu_ps(sn + i))));
          _mm256_storeu_ps(y + i + half, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + i + half)),
                                                       _mm256_mul_ps(a, _mm256_loadu_ps(sn + i + half))));
        }
        for (; i < half; ++i) {
          y[i] = x[i] * c[i] + (-x[i + half]) * sn[i];
          y[i + half] = x[i + half] * c[i + half] + x[i] * sn[i + half];
        }
      }
    };
    rotate(row, qp + t * num_heads * D, num_heads);
    rotate(row + num_heads * D, kp + t * num_kv_heads * D, num_kv_heads);
    std::copy(row + (num_heads + num_kv_heads) * D, row + width, vp + t * num_kv_heads * D);
    const int64_t off = slots ? slots[t] * num_kv_heads * D : 0, width_kv = num_kv_heads * D;
    if (kc) {
      std::copy(kp + t * width_kv, kp + (t + 1) * width_kv, kc + off);
      std::copy(vp + t * width_kv, vp + (t + 1) * width_kv, vc + off);
    } else if (kh) {
      // Round to nearest float16, as torch's .to(torch.float16) does.
      int64_t i = 0;
      for (; i + 8 <= width_kv; i += 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(kh + off + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(kp + t * width_kv + i), _MM_FROUND_TO_NEAREST_INT));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(vh + off + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(vp + t * width_kv + i), _MM_FROUND_TO_NEAREST_INT));
      }
      for (; i < width_kv; ++i) {
        kh[off + i] = _cvtss_sh(kp[t * width_kv + i], _MM_FROUND_TO_NEAREST_INT);
        vh[off + i] = _cvtss_sh(vp[t * width_kv + i], _MM_FROUND_TO_NEAREST_INT);
      }
    } else if (k8) {
      // As QuantizedKVCache.write: per (token, KV head) scale max|x| / 127 (at least
      // 1e-12 / 127), values round(x / scale) to nearest, ties to even.
      auto quantize = [&](const float* x, int8_t* q, float* scale) {
        float amax = 0.f;
        for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float sc = std::max(amax, 1e-12f) / 127.f;
        *scale = sc;
        for (int64_t i = 0; i < D; ++i)
          q[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(x[i] / sc))));
      };
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        quantize(kp + t * width_kv + h * D, k8 + off + h * D, k8s + slots[t] * num_kv_heads + h);
        quantize(vp + t * width_kv + h * D, v8 + off + h * D, v8s + slots[t] * num_kv_heads + h);
      }
    }
  }
  return {q, k, v};
}

// ---- GGUF blocks (gguf_blocks.cpp) -------------------------------------------------
torch::Tensor gguf_dequantize(torch::Tensor data, int64_t type, int64_t K, c10::optional<torch::Tensor> rows);
torch::Tensor gguf_linear(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<int64_t> types,
                          c10::optional<torch::Tensor> bias);
torch::Tensor gguf_linear_int8(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<int64_t> types,
                               c10::optional<torch::Tensor> bias);
torch::Tensor gguf_moe_int8(torch::Tensor x, torch::Tensor ids, torch::Tensor weights,
                            std::vector<torch::Tensor> gate_up, std::vector<int64_t> gate_up_types,
                            std::vector<torch::Tensor> down, std::vector<int64_t> down_types);
torch::Tensor gguf_moe(torch::Tensor x, torch::Tensor ids, torch::Tensor weights,
                       std::vector<torch::Tensor> gate_up, std::vector<int64_t> gate_up_types,
                       std::vector<torch::Tensor> down, std::vector<int64_t> down_types);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "x @ W^T with W in 4-bit groups of 32 (scale + min)");
  m.def("q8_linear", &q8_linear, "x @ W^T with W int8 per output channel, float activations");
  m.def("i8_mm", &i8_mm, "int8 x int8^T -> int32, exact (small steps of int8 mode)");
  m.def("int8_linear", &int8_linear, "int8 mode's linear layer: float outlier channels, per-token int8 product of the rest",
        py::arg("x"), py::arg("qweight"), py::arg("weight_scale"), py::arg("bias"), py::arg("small_rows"),
        py::arg("outlier_idx"), py::arg("outlier_w"), py::arg("vnni_weight") = py::none(),
        py::arg("vnni_comp") = py::none());
  m.def("int8_pack_vnni", &int8_pack_vnni, "int8 weights [N, K] -> (AVX-512 VNNI tile layout, -128 x channel sums)");
  m.def("avx512_enabled", &use_avx512, "whether the AVX-512 VNNI kernels run (the CPU has them, PAGODA_CPU_ISA is not avx2)");
  m.def("silu_mul", &silu_mul, "F.silu(gate) * up of the fused [M, 2 x I] gate/up output, bit for bit");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) of a 2-D float32 tensor");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, optionally of (residual += x)");
  m.def("rope_qkv", &rope_qkv, "rotary embedding of fused qkv -> q, k, v (k and v also into the cache)",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("kv_cache") = py::none(), py::arg("slot_mapping") = py::none(), py::arg("kv_scales") = py::none());
  m.def("gguf_dequantize", &gguf_dequantize, "rows of a GGUF tensor (all, or those indexed) as float32",
        py::arg("data"), py::arg("ggml_type"), py::arg("in_features"), py::arg("rows") = py::none());
  m.def("gguf_linear", &gguf_linear, "x @ W^T (+ bias) in float32, W given as GGUF parts of any supported type",
        py::arg("x"), py::arg("weights"), py::arg("ggml_types"), py::arg("bias") = py::none());
  m.def("gguf_linear_int8", &gguf_linear_int8, "x @ W^T (+ bias) with x quantized to int8 per 32 and W's GGUF blocks "
        "as integers (llama.cpp's arithmetic)",
        py::arg("x"), py::arg("weights"), py::arg("ggml_types"), py::arg("bias") = py::none());
  m.def("gguf_moe_int8", &gguf_moe_int8, "a mixture-of-experts layer in the gguf mode: tokens grouped by expert, "
        "each expert's gate/up, SiLU x up and down as gguf_linear_int8 computes them, weighted sums in expert order",
        py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("gate_up"), py::arg("gate_up_types"),
        py::arg("down"), py::arg("down_types"));
  m.def("gguf_moe", &gguf_moe, "a mixture-of-experts layer in the exact mode: gguf_moe_int8's grouping with "
        "gguf_linear's float32 products", py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("gate_up"),
        py::arg("gate_up_types"), py::arg("down"), py::arg("down_types"));
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache",
        py::arg("q"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("kv_scales") = py::none(), py::arg("window") = 0, py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none());
}
