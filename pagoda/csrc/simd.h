// Shared by pagoda's CPU kernels (every pagoda/csrc/*.cpp): horizontal sums, float16
// conversion, the AVX-512 function attribute and the run-time CPU checks that choose
// between the AVX2 and AVX-512 versions, and the tiling of the integer GEMMs' rows.
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

// Compiled for AVX-512 whatever the build flags (function attribute), called only when
// the CPU has it (use_avx512 / avx512_enabled).
#define PAGODA_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

// cpu_features.cpp: whether the CPU has AVX-512 (F, BW, DQ, VL) with VNNI, and whether
// the AVX-512 versions run (that, and PAGODA_CPU_ISA is not "avx2").
bool cpu_has_avx512_vnni();
bool use_avx512();

// AMX int8 tiles (with AVX-512 for the rest of such a kernel): cpu_has_amx_int8 (the CPU
// has them and the process was granted the tile state), use_amx (that, and
// PAGODA_CPU_ISA is neither "avx2" nor "avx512").
#define PAGODA_AMX __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,amx-tile,amx-int8")))
bool cpu_has_amx_int8();
bool use_amx();

namespace pagoda {

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

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

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

}  // namespace pagoda
