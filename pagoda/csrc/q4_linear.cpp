// q4 mode's products (pagoda/csrc/kernels.h):
//
// q4_linear: y = x W^T with W in 4-bit groups of 32 (asymmetric: w = d*q + m, d and m fp16,
//   q in 0..15; the GGUF Q4_1 scheme, with the nibble order of ggml: byte j of a
//   group holds weights j (low nibble) and j + 16 (high nibble)), x quantized to int8
//   per row and group of 32 (llama.cpp's Q4_1 x Q8_1): integer dot products on
//   maddubs. Single-stream decode reads every weight once per token, so its speed is
//   set by bytes per weight: 5 bits here against 32 for fp32.
// q8_linear: the same with int8 weights per output channel (q4 mode's LM head).
//
// Both quantize x in int8 groups of 32 (quantize_rows_q8) and run integer dots on maddubs.

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

constexpr int kGroup = 32;

using pagoda::h2f;
using pagoda::hsum256;
using pagoda::for_row_blocks;

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
