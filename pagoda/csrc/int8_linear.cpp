// int8 mode's products (pagoda/csrc/kernels.h):
//
// i8_mm / int8_linear: int8 mode's per-token int8 x int8 products.
//   int8_pack_vnni packs the weights for the AVX-512 VNNI version, chosen at run time
//   (use_avx512) where the CPU has it.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

// ---- int8 x int8 -> int32, for small steps of int8 mode ------------------------
// Exact integer dot products, so a token's result is bit-identical to what
// torch._int_mm gives it in a large step: int8 mode's numbers do not depend on the
// step size (batch, prefix-cache hits, chunking).

namespace {

using pagoda::for_row_blocks;
using pagoda::hsum_epi32;

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
// the outlier channels' float activations. token_amax (or null): max|x[m, inliers]| given
// by the caller, used in place of this row's own (a row-parallel layer's tokens: the max
// over every rank's channels, so that each rank rounds with the scale one process uses).
void quantize_tokens(const float* xp, int64_t M, int64_t K, const int64_t* oi, int64_t NO, bool to_unsigned,
                     int8_t* qp, float* xs, float* xo, const float* token_amax) {
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
    if (token_amax) amax = token_amax[m];
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
// Compiled for AVX-512 whatever the build flags (function attribute: PAGODA_AVX512, simd.h),
// called only when the CPU has it (use_avx512 / avx512_enabled). Weights packed per tile of 64 output channels:
// [N/64][K/4][64][4] (int8_pack_vnni), so one step of four input channels is 256
// contiguous bytes, four registers of 16 channels x 4 bytes: vpdpbusd adds, per channel,
// the four products of a broadcast 4-byte group of the (unsigned) activations. Signed x
// signed runs as (q + 128) x w, the 128 x sum(w) of each channel subtracted by starting
// its sums at comp[n] = -128 x sum_k w[n, k]: exact, the same integers as q x w.

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
                          c10::optional<torch::Tensor> vnni_weight, c10::optional<torch::Tensor> vnni_comp,
                          c10::optional<torch::Tensor> token_amax) {
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
  const bool given = token_amax.has_value() && token_amax->defined();
  TORCH_CHECK(!given || (token_amax->scalar_type() == torch::kFloat32 && token_amax->is_contiguous() &&
                         token_amax->numel() == M), "token_amax must be contiguous float32 [M]");
  quantize_tokens(x.data_ptr<float>(), M, K, oi, NO, vnni, xq.data_ptr<int8_t>(), xs.data(), xo.data(),
                  given ? token_amax->data_ptr<float>() : nullptr);
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
