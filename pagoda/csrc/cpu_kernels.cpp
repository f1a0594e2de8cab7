// pagoda's CPU kernels, built on first use with torch.utils.cpp_extension
// (pagoda/ops/cpu_kernels.py). Two kernels where plain torch leaves most of the
// machine unused:
//
// q4_linear: y = x W^T with W in 4-bit groups of 32 (asymmetric: w = d*q + m, d and m fp16,
//   q in 0..15; the GGUF Q4_1 scheme, with the nibble order of ggml: byte j of a
//   group holds weights j (low nibble) and j + 16 (high nibble)). Single-stream
//   decode reads every weight once per token, so its speed is set by bytes per
//   weight: 4.5 bits here against 32 for fp32. Rows of x are processed four at a
//   time against each unpacked group, so small batches reuse the unpacked weights.
//
// paged_decode_attention: one query token per sequence against its K/V read in
//   place from the paged cache through the block table (no gathered, padded
//   copy). Each (sequence, kv head) is independent work with a fixed summation
//   order, so a sequence's result does not depend on its batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int kGroup = 32;

inline float hsum256(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 shuf = _mm_movehdup_ps(lo);
  __m128 sums = _mm_add_ps(lo, shuf);
  shuf = _mm_movehl_ps(shuf, sums);
  sums = _mm_add_ss(sums, shuf);
  return _mm_cvtss_f32(sums);
}

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

// Rows [r0, r0 + MR) of x against output channels [n0, n1).
inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

template <int MR>
void q4_rows(const float* x, const float* xsum, int64_t K, const uint8_t* qw,
             const uint16_t* scales, const uint16_t* mins, const float* bias, float* y,
             int64_t N, int64_t r0, int64_t n0, int64_t n1) {
  const int64_t groups = K / kGroup;
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
      __m256 w[4];
      unpack_group(wrow + g * 16, w);
      const __m256 dg = _mm256_set1_ps(h2f(d[g]));
      const float mg = h2f(m[g]);
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + (r0 + r) * K + g * kGroup;
        __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
        t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), t);
        t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), t);
        t = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), t);
        acc[r] = _mm256_fmadd_ps(dg, t, acc[r]);
        macc[r] += mg * xsum[(r0 + r) * groups + g];
      }
    }
    for (int r = 0; r < MR; ++r) {
      float v = hsum256(acc[r]) + macc[r];
      if (bias) v += bias[n];
      y[(r0 + r) * N + n] = v;
    }
  }
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
  const int64_t groups = K / kGroup;
  auto xsum = x.view({M, groups, kGroup}).sum(-1).contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* sp = xsum.data_ptr<float>();
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  const float* bp = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Split the output channels across threads; each thread streams its own rows of
  // W once per four rows of x.
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) q4_rows<4>(xp, sp, K, qp, dp, mp, bp, yp, N, r, n0, n1);
    switch (M - r) {
      case 3: q4_rows<3>(xp, sp, K, qp, dp, mp, bp, yp, N, r, n0, n1); break;
      case 2: q4_rows<2>(xp, sp, K, qp, dp, mp, bp, yp, N, r, n0, n1); break;
      case 1: q4_rows<1>(xp, sp, K, qp, dp, mp, bp, yp, N, r, n0, n1); break;
      default: break;
    }
  });
  return y;
}

// Large batches are compute-bound: dequantize W a tile of output channels at a time
// into a cache-resident float32 buffer and multiply it with BLAS, so the weights
// stay 4-bit in memory and are read once per step.
namespace {

// y = x W^T for large batches: W dequantized a tile of output channels at a time
// (dequant_row(n, dst) writes row n as K floats) into a cache-resident buffer, then BLAS.
template <typename DequantRow>
torch::Tensor tiled_linear(torch::Tensor x, int64_t N, DequantRow dequant_row) {
  const int64_t M = x.size(0), K = x.size(1);
  constexpr int64_t kTile = 128;
  auto yt = torch::empty({N, M}, x.options());  // y transposed: each tile writes whole rows
  auto xt = x.t();
  const int64_t num_tiles = (N + kTile - 1) / kTile;
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, num_tiles, 1, [&](int64_t t0, int64_t t1) {
    // Worker threads do not inherit the caller's inference mode.
    c10::InferenceMode guard(inference);
    std::vector<float> buf(kTile * K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTile, rows = std::min(kTile, N - n0);
      for (int64_t r = 0; r < rows; ++r) dequant_row(n0 + r, buf.data() + r * K);
      auto w = torch::from_blob(buf.data(), {rows, K}, x.options());
      auto out = yt.narrow(0, n0, rows);
      at::mm_out(out, w, xt);
    }
  });
  return yt.t().contiguous();
}

}  // namespace

torch::Tensor q4_linear_tiled(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                              torch::Tensor mins, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  x = x.contiguous();
  const int64_t K = x.size(1), N = qweight.size(0), groups = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && qweight.size(1) == K / 2, "qweight does not match x");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat16 && mins.scalar_type() == torch::kFloat16,
              "scales/mins must be float16");
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  auto y = tiled_linear(x, N, [&](int64_t n, float* dst) {
    for (int64_t g = 0; g < groups; ++g) {
      __m256 q[4];
      unpack_group(qp + n * (K / 2) + g * 16, q);
      const __m256 d = _mm256_set1_ps(h2f(dp[n * groups + g]));
      const __m256 m = _mm256_set1_ps(h2f(mp[n * groups + g]));
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(dst + g * kGroup + 8 * i, _mm256_fmadd_ps(q[i], d, m));
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// W as float32 [N, K] (tests, and callers without the kernels' speed needs).
torch::Tensor q4_dequantize(torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins) {
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2, groups = K / kGroup;
  TORCH_CHECK(scales.scalar_type() == torch::kFloat16 && mins.scalar_type() == torch::kFloat16,
              "scales/mins must be float16");
  auto w = torch::empty({N, K}, scales.options().dtype(torch::kFloat32));
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t g = 0; g < groups; ++g) {
        __m256 q[4];
        unpack_group(qp + n * (K / 2) + g * 16, q);
        const __m256 d = _mm256_set1_ps(h2f(dp[n * groups + g]));
        const __m256 m = _mm256_set1_ps(h2f(mp[n * groups + g]));
        float* out = wp + n * K + g * kGroup;
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_fmadd_ps(q[i], d, m));
      }
    }
  });
  return w;
}

torch::Tensor paged_decode_attention(torch::Tensor q,             // [B, H, D]
                                     torch::Tensor kv_cache,      // [2, blocks, bs, KVH, D]
                                     torch::Tensor block_tables,  // [B, max_blocks] int32
                                     torch::Tensor seq_lens,      // [B] int32
                                     double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && kv_cache.scalar_type() == torch::kFloat32,
              "paged_decode_attention runs on float32");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), KVH = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && H % KVH == 0, "head shapes of q and kv_cache disagree");
  const int64_t G = H / KVH, max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = kv_cache.data_ptr<float>();
  const float* vp = kp + num_blocks * bs * KVH * D;
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * KVH, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores;
    std::vector<float> acc;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / KVH, kvh = w % KVH;
      const int64_t len = lp[b];
      TORCH_CHECK(len >= 1 && len <= max_blocks * bs, "sequence length out of range");
      scores.assign(G * len, 0.f);
      const float* qh = qp + (b * H + kvh * G) * D;
      // Scores: every key of the context against the G query heads sharing it.
      for (int64_t p = 0; p < len; ++p) {
        const int64_t blk = tp[b * max_blocks + p / bs];
        const float* kk = kp + ((blk * bs + p % bs) * KVH + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qq = qh + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < D; ++i) s += qq[i] * kk[i];
          scores[g * len + p] = s * sc;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * len;
        float mx = *std::max_element(sg, sg + len);
        float total = 0.f;
        for (int64_t p = 0; p < len; ++p) {
          sg[p] = std::exp(sg[p] - mx);
          total += sg[p];
        }
        const float inv = 1.f / total;
        for (int64_t p = 0; p < len; ++p) sg[p] *= inv;
      }
      acc.assign(G * D, 0.f);
      for (int64_t p = 0; p < len; ++p) {
        const int64_t blk = tp[b * max_blocks + p / bs];
        const float* vv = vp + ((blk * bs + p % bs) * KVH + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float s = scores[g * len + p];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] += s * vv[i];
        }
      }
      std::copy(acc.begin(), acc.end(), op + (b * H + kvh * G) * D);
    }
  });
  return out;
}

// ---- int8 weights per output channel (w = s * q), float activations ----------
// For the 8-bit LM head of q4 mode: reading 1 byte per weight instead of 4.

namespace {

template <int MR>
void q8_rows(const float* x, int64_t K, const int8_t* qw, const float* scales, float* y,
             int64_t N, int64_t r0, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wrow = qw + n * K;
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + k));
      __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
      __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + (r0 + r) * K + k;
        acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r]);
        acc[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[r]);
      }
    }
    for (int r = 0; r < MR; ++r) y[(r0 + r) * N + n] = hsum256(acc[r]) * scales[n];
  }
}

}  // namespace

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  TORCH_CHECK(qweight.scalar_type() == torch::kInt8 && qweight.is_contiguous(), "qweight must be contiguous int8");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K && K % 16 == 0, "qweight must be [out, in] with in % 16 == 0");
  TORCH_CHECK(scales.numel() == N, "scales must have out_features entries");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) q8_rows<4>(xp, K, qp, sp, yp, N, r, n0, n1);
    switch (M - r) {
      case 3: q8_rows<3>(xp, K, qp, sp, yp, N, r, n0, n1); break;
      case 2: q8_rows<2>(xp, K, qp, sp, yp, N, r, n0, n1); break;
      case 1: q8_rows<1>(xp, K, qp, sp, yp, N, r, n0, n1); break;
      default: break;
    }
  });
  return y;
}

torch::Tensor q8_linear_tiled(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  x = x.contiguous();
  const int64_t K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K, "qweight does not match x");
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  return tiled_linear(x, N, [&](int64_t n, float* dst) {
    const float s = sp[n];
    const int8_t* src = qp + n * K;
    for (int64_t k = 0; k < K; ++k) dst[k] = s * static_cast<float>(src[k]);
  });
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
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) i8_rows<4>(xp, K, qp, yp, N, r, n0, n1);
    switch (M - r) {
      case 3: i8_rows<3>(xp, K, qp, yp, N, r, n0, n1); break;
      case 2: i8_rows<2>(xp, K, qp, yp, N, r, n0, n1); break;
      case 1: i8_rows<1>(xp, K, qp, yp, N, r, n0, n1); break;
      default: break;
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "x @ W^T with W in 4-bit groups of 32 (scale + min)");
  m.def("q4_linear_tiled", &q4_linear_tiled, "x @ W^T for large batches: tiles of W dequantized, then BLAS");
  m.def("q8_linear", &q8_linear, "x @ W^T with W int8 per output channel, float activations");
  m.def("q8_linear_tiled", &q8_linear_tiled, "the same for large batches: tiles dequantized, then BLAS");
  m.def("i8_mm", &i8_mm, "int8 x int8^T -> int32, exact (small steps of int8 mode)");
  m.def("q4_dequantize", &q4_dequantize, "4-bit groups of 32 -> float32 weight");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache");
}
