// pagoda's float32 micro-kernel (gguf_blocks.cpp's small steps): rows of x times a few
// dequantized weight rows held in a small buffer. The shared SIMD helpers are in simd.h.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "simd.h"

namespace pagoda {

// y[r0 + r, n + c] = the lanes of acc[r][c] summed (+ bias[n + c]).
template <int MR, int NC>
inline void store_sums(const __m256 (&acc)[MR][NC], const float* bias, float* y, int64_t N, int64_t r0, int64_t n) {
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) {
      float v = hsum256(acc[r][c]);
      if (bias) v += bias[n + c];
      y[(r0 + r) * N + n + c] = v;
    }
}

// y[r, n + c] for rows [r0, r0 + MR) of x and NC buffered weight rows: eight lanes of
// partial sums over k, then their horizontal sum (the same order for every M).
template <int MR, int NC>
inline void f32_block(const float* x, int64_t K, const float* w, const float* bias, float* y, int64_t N,
                      int64_t r0, int64_t n) {
  __m256 acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = _mm256_loadu_ps(w + c * K + k);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + (r0 + r) * K + k);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  store_sums<MR, NC>(acc, bias, y, N, r0, n);
}

// Rows [r0, r0 + MR) of x against weight rows [n0, n1), held row-major in buf.
template <int MR>
inline void f32_rows(const float* x, int64_t K, const float* buf, const float* bias, float* y, int64_t N,
                     int64_t r0, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 3 <= n1; n += 3) f32_block<MR, 3>(x, K, buf + (n - n0) * K, bias, y, N, r0, n);
  for (; n < n1; ++n) f32_block<MR, 1>(x, K, buf + (n - n0) * K, bias, y, N, r0, n);
}

// All M rows of x against weight rows [n0, n1) in buf, four rows of x at a time.
inline void f32_all_rows(const float* x, int64_t M, int64_t K, const float* buf, const float* bias, float* y,
                         int64_t N, int64_t n0, int64_t n1) {
  int64_t r = 0;
  for (; r + 4 <= M; r += 4) f32_rows<4>(x, K, buf, bias, y, N, r, n0, n1);
  switch (M - r) {
    case 3: f32_rows<3>(x, K, buf, bias, y, N, r, n0, n1); break;
    case 2: f32_rows<2>(x, K, buf, bias, y, N, r, n0, n1); break;
    case 1: f32_rows<1>(x, K, buf, bias, y, N, r, n0, n1); break;
    default: break;
  }
}

}  // namespace pagoda
