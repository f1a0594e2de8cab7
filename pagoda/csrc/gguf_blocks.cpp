// GGUF weights kept in their blocks: every tensor type people download, dequantized a
// few rows at a time inside the kernels, never as a whole model.
//
// gguf_dequantize: rows of a tensor (all, or those an index names: an embedding lookup)
//   to float32, the very values of ggml's reference dequantization (and of the gguf
//   library's numpy one, which the tests compare with bit for bit): each value is
//   scale * q (+ offset) with the multiplication and the addition rounded separately.
// gguf_linear: y = x W^T (+ bias) in float32 for W given as one or more parts (a stacked
//   q/k/v or gate/up projection whose parts may differ in type, as Q4_K_M files mix
//   Q4_K and Q6_K). Steps of up to kDirectRows rows multiply from decoded rows (int8
//   values and sub-block scales, sums in registers); up to kSmallSteps rows, tiles of
//   output channels dequantized into a buffer that stays in L1/L2 run pagoda's float32
//   micro-kernel: either way the weights are read once per step in their 4.5-8.5 bits.
//   Larger steps dequantize panels of output channels and multiply them with BLAS.
// gguf_linear_int8: the gguf mode's product, x quantized to int8 (see below).
//
// Block layouts (ggml's, byte offsets within one block; d, dmin, m are float16):
//   Q4_0   32: d, qs[16]                 w = d * (nibble - 8)
//   Q4_1   32: d, m, qs[16]              w = d * nibble + m
//   Q5_0   32: d, qh[4], qs[16]          w = d * ((nibble | bit << 4) - 16)
//   Q5_1   32: d, m, qh[4], qs[16]       w = d * (nibble | bit << 4) + m
//   Q8_0   32: d, qs[32] (int8)          w = d * q
//   IQ4_NL 32: d, qs[16]                 w = d * kvalues[nibble]
//   Q2_K  256: scales[16], qs[64], d, dmin            w = (d * sc) * q - (dmin * mn)
//   Q3_K  256: hmask[32], qs[64], scales[12], d       w = (d * (sc - 32)) * q
//   Q4_K  256: d, dmin, scales[12], qs[128]           w = (d * sc) * q - (dmin * mn)
//   Q5_K  256: d, dmin, scales[12], qh[32], qs[128]   as Q4_K with a fifth bit
//   Q6_K  256: ql[128], qh[64], scales[16] (int8), d  w = (d * sc) * (q - 32)
//   IQ4_XS 256: d, scales_h (u16), scales_l[4], qs[128]   w = (d * (sc - 32)) * kvalues[nibble]
//   MXFP4  32: e (E8M0), qs[16]          w = 2^(e - 128) * e2m1x2[nibble] (GPT-OSS's experts)
// pagoda's own (pagoda/model/hf_quant: GPTQ, AWQ, compressed-tensors' integer groups):
//   PQ4Z   32: d, z (u8), qs[16]         w = d * (nibble - z)
//   PQ8Z   32: d, z (i16), q[32] (u8)    w = d * (q - z)
//   PQ4ZF, PQ8ZF: the same with d a float32 (scales a float16 cannot hold: bfloat16's
//   smallest, float32's)
// The integer q - z is exact, so one float32 rounding: the value float32(d) * (q - z) the
// formats' reference dequantization computes (a Q4_1 block's d * q + m rounds twice).
// pagoda's own float layouts (ids 220-223; pagoda/model/hf_quant/float_blocks.py: FP8, NVFP4):
//   FP8_32   32: s (float32), q[32] (e4m3fn)       w = e4m3(q) * s        (FP8 checkpoints:
//   FP8_128 128: s (float32), q[128] (e4m3fn)      per-tensor, per-channel or block scales)
//   NVFP4_32   32: g (float32), s[2] (e4m3fn), qs[16]   w = e2m1[nibble] * (e4m3(s[j]) / g)
//   NVFP4_128 128: g (float32), s[8] (e4m3fn), qs[64]   for weights 16j .. 16j + 15
// e4m3(q) * s is one float32 product of exact factors, as the checkpoints' reference
// dequantization (w.float() * scale); NVFP4's scale is compressed-tensors' float32
// quotient e4m3(s) / g, then one product. FP8 values are not small integers: those
// types only dequantize (rows and tiles), with no decoded-row or int8 products.
// In a block of 32 with 16 bytes of nibbles, byte j holds weight j (low) and j + 16 (high).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "f32_tiles.h"
#include "kernels.h"  // pagoda_silu_mul_rows (elementwise.cpp); simd.h: use_avx512, PAGODA_AVX512

namespace {

using pagoda::f32_all_rows;

// ggml type ids (gguf.GGMLQuantizationType).
enum GgmlType : int {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23, kBF16 = 30,
  kMXFP4 = 39,
  kPQ4Z = 200, kPQ8Z = 201, kPQ4ZF = 202, kPQ8ZF = 203,  // pagoda's own (OWN_TYPES, blocks.py)
  // Q4_K repacked at load, 16 channels in the lanes (the gguf mode on AVX-512 VNNI CPUs;
  // Q4_K_X16 in blocks.py; its layout above x16_rows).
  kQ4KX16 = 204, kQ6KX16 = 205,
  // Q4_0, Q4_1, Q8_0, IQ4_NL and MXFP4 repacked the same way (their layouts above x32_rows).
  kQ40X16 = 206, kQ41X16 = 207, kQ80X16 = 208, kIQ4NLX16 = 209, kMXFP4X16 = 210,
  // Q5_K repacked as Q4_K, its fifth bits beside (layout above x16_pack_q5k_block).
  kQ5KX16 = 211,
  // Q3_K and Q2_K repacked in Q6_K_X16's shape (layouts above x16_pack_q3k_block and
  // x16_pack_q2k_block).
  kQ3KX16 = 212, kQ2KX16 = 213,
  // Q5_0, Q5_1 and IQ4_XS repacked as the 32-weight types (their layouts above x32_rows).
  kQ50X16 = 214, kQ51X16 = 215, kIQ4XSX16 = 216,
  // pagoda's own float layouts (OWN_TYPES, blocks.py; pagoda/model/hf_quant/float_blocks.py).
  kFP8_32 = 220, kFP8_128 = 221, kNVFP4_32 = 222, kNVFP4_128 = 223,
};

struct BlockFormat {
  int64_t block;  // weights per block
  int64_t bytes;  // bytes per block
};

bool known_format(int type, BlockFormat* f) {
  switch (type) {
    case kF32: *f = {1, 4}; return true;
    case kF16: *f = {1, 2}; return true;
    case kBF16: *f = {1, 2}; return true;
    case kQ4_0: *f = {32, 18}; return true;
    case kQ4_1: *f = {32, 20}; return true;
    case kQ5_0: *f = {32, 22}; return true;
    case kQ5_1: *f = {32, 24}; return true;
    case kQ8_0: *f = {32, 34}; return true;
    case kIQ4_NL: *f = {32, 18}; return true;
    case kQ2_K: *f = {256, 84}; return true;
    case kQ3_K: *f = {256, 110}; return true;
    case kQ4_K: *f = {256, 144}; return true;
    case kQ5_K: *f = {256, 176}; return true;
    case kQ6_K: *f = {256, 210}; return true;
    case kIQ4_XS: *f = {256, 136}; return true;
    case kMXFP4: *f = {32, 17}; return true;
    case kPQ4Z: *f = {32, 19}; return true;
    case kPQ8Z: *f = {32, 36}; return true;
    case kPQ4ZF: *f = {32, 21}; return true;
    case kPQ8ZF: *f = {32, 38}; return true;
    case kQ4KX16: *f = {256, 148}; return true;  // 16 channels' blocks in 2,368 bytes
    case kQ6KX16: *f = {256, 210}; return true;  // 16 channels' blocks in 3,360 bytes
    case kQ5KX16: *f = {256, 180}; return true;  // 16 channels' blocks in 2,880 bytes
    case kQ3KX16: *f = {256, 114}; return true;  // 16 channels' blocks in 1,824 bytes
    case kQ2KX16: *f = {256, 84}; return true;   // ... in 1,344 bytes
    case kQ40X16: *f = {32, 18}; return true;    // 16 channels' blocks in 288 bytes
    case kQ41X16: *f = {32, 20}; return true;    // ... in 320 bytes
    case kQ80X16: *f = {32, 34}; return true;    // ... in 544 bytes
    case kIQ4NLX16: *f = {32, 18}; return true;  // ... in 288 bytes
    case kMXFP4X16: *f = {32, 17}; return true;  // ... in 272 bytes
    case kQ50X16: *f = {32, 22}; return true;    // ... in 352 bytes
    case kQ51X16: *f = {32, 24}; return true;    // ... in 384 bytes
    case kIQ4XSX16: *f = {256, 138}; return true;  // 16 channels' 256 inputs in 2,208 bytes
    case kFP8_32: *f = {32, 36}; return true;
    case kFP8_128: *f = {128, 132}; return true;
    case kNVFP4_32: *f = {32, 22}; return true;
    case kNVFP4_128: *f = {128, 76}; return true;
    default: return false;
  }
}

// The repacked K-quant types, the repacked 32-weight ones, and either: 16 channels in the
// lanes (a part's channels in groups of 16).
constexpr bool is_x16(int type) {
  return type == kQ4KX16 || type == kQ6KX16 || type == kQ5KX16 || type == kQ3KX16 || type == kQ2KX16;
}
constexpr bool is_x32(int type) {
  return type == kQ40X16 || type == kQ41X16 || type == kQ80X16 || type == kIQ4NLX16 || type == kMXFP4X16 ||
         type == kQ50X16 || type == kQ51X16 || type == kIQ4XSX16;
}
constexpr bool is_lanes(int type) { return is_x16(type) || is_x32(type); }

BlockFormat format_of(int64_t type) {
  BlockFormat f;
  TORCH_CHECK(known_format(static_cast<int>(type), &f), "unsupported ggml type ", type);
  return f;
}

const int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// Q4_0's nibbles, centred.
const int8_t kQ4_0Values[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
// MXFP4's E2M1 values, doubled (the scale is halved to match: ggml's kvalues_mxfp4).
const int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// An E8M0 scale, halved: 2^(e - 128) (ggml_e8m0_to_fp32_half; e < 2 gives subnormals).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The float16 bits of an e4m3fn byte's value / 256: its sign, and its exponent and
// mantissa (7 bits) moved down 3 bits of exponent (float16's bias 15 is e4m3's 7 + 8).
// Subnormals map to subnormals, so the conversion and the * 256 are exact.
inline uint16_t e4m3_as_f16(uint8_t b) {
  return static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7F) << 7));
}

// An e4m3fn byte's value (S.1111.111 is NaN; e4m3fn has no infinities).
inline float e4m3_to_f32(uint8_t b) {
  if ((b & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  return pagoda::h2f(e4m3_as_f16(b)) * 256.f;
}

// y[j] = e4m3(q[j]) * s for n (a multiple of 16) bytes: one float32 product each, of
// (value / 256) and s * 256 (both exact: the same product).
inline void emit_fp8(const uint8_t* q, int n, float s, float* y) {
  const __m256 sv = _mm256_set1_ps(s * 256.f);
  const __m256 nan_bits = _mm256_set1_ps(1.875f);  // S.1111.111 / 256 as float16 bits: NaN
  const __m256 sign = _mm256_set1_ps(-0.f), nan = _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN());
  const __m256i m80 = _mm256_set1_epi16(0x80), m7f = _mm256_set1_epi16(0x7F);
  for (int j = 0; j < n; j += 16) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j)));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, m80), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(b, m7f), 7));
    for (int half = 0; half < 2; ++half) {
      __m256 f = _mm256_cvtph_ps(half ? _mm256_extracti128_si256(h, 1) : _mm256_castsi256_si128(h));
      f = _mm256_blendv_ps(f, nan, _mm256_cmp_ps(_mm256_andnot_ps(sign, f), nan_bits, _CMP_EQ_OQ));
      _mm256_storeu_ps(y + j + 8 * half, _mm256_mul_ps(f, sv));
    }
  }
}

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return pagoda::h2f(h);
}

// The scale d of one of pagoda's integer-group blocks (PQ4Z ...), and its size in bytes.
constexpr int own_scale_bytes(int type) { return type == kPQ4ZF || type == kPQ8ZF ? 4 : 2; }
template <int type>
inline float own_scale(const uint8_t* p) {
  if constexpr (own_scale_bytes(type) == 4) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  } else {
    return f16_at(p);
  }
}

// Weights per sub-block (one scale each) and whether the type has offsets.
constexpr int sub_block_of(int type) {
  return (type == kQ2_K || type == kQ3_K || type == kQ6_K || type == kNVFP4_32 || type == kNVFP4_128) ? 16 : 32;
}
constexpr bool has_offset(int type) {
  return type == kQ4_1 || type == kQ5_1 || type == kQ2_K || type == kQ4_K || type == kQ5_K || type == kPQ8Z ||
         type == kPQ8ZF;
}
constexpr int block_of(int type) {
  switch (type) {
    case kQ2_K: case kQ3_K: case kQ4_K: case kQ5_K: case kQ6_K: case kIQ4_XS: return 256;
    case kNVFP4_128: return 128;
    default: return 32;
  }
}

inline __m256 load_q8(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}

// y[j] = a * q[j] for n (a multiple of 8) values.
inline void emit_scaled(const int8_t* q, int n, float a, float* y) {
  const __m256 av = _mm256_set1_ps(a);
  for (int j = 0; j < n; j += 8) _mm256_storeu_ps(y + j, _mm256_mul_ps(av, load_q8(q + j)));
}

// y[j] = a * q[j] + b, rounded after the product and after the sum (no fused multiply-add).
inline void emit_affine(const int8_t* q, int n, float a, float b, float* y) {
  const __m256 av = _mm256_set1_ps(a), bv = _mm256_set1_ps(b);
  for (int j = 0; j < n; j += 8) _mm256_storeu_ps(y + j, _mm256_add_ps(_mm256_mul_ps(av, load_q8(q + j)), bv));
}

// 16 bytes of nibbles -> 32 values of a 16-entry table (IQ4_NL, IQ4_XS, MXFP4): low nibbles
// to q[0..15], high ones to q[16..31], one byte shuffle each.
inline void lookup_nibbles16(const uint8_t* p, const int8_t* table, int8_t* q) {
  const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(table));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_shuffle_epi8(lut, _mm_and_si128(b, mask)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16),
                   _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), mask)));
}

// 32 bytes -> 64 values: low nibbles to q[0..31], high nibbles to q[32..63].
inline void split_nibbles32(const uint8_t* p, uint8_t* q) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_and_si256(b, mask));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32), _mm256_and_si256(_mm256_srli_epi16(b, 4), mask));
}

// The K-quants' 6-bit scales and minimums of the 8 sub-blocks, from their 12 bytes, as 16
// bytes (scales 0-7, then minimums 0-7): sub-block j < 4: scale = s[j] & 63, min =
// s[j + 4] & 63; j >= 4: scale = low nibble of s[j + 4] | top 2 bits of s[j - 4] << 4, min
// = high nibble of s[j + 4] | top 2 bits of s[j] << 4. In one register: two byte shuffles
// put each output byte's sources in place (a = s[0..3], s[8..11], s[4..7], s[8..11]; b =
// s[0..3] and s[4..7] under the high halves), then masks and shifts (16-bit shifts: the
// bits they carry in from the neighbouring byte are masked off). Reads 16 bytes from s
// (the 12, then the next 4 of the block).
inline __m128i k4_scales_mins(const uint8_t* s) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i b = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i low = _mm_and_si128(a, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0));
  const __m128i high_nibble = _mm_and_si128(_mm_srli_epi16(a, 4), _mm_setr_epi32(0, 0, 0, 0x0f0f0f0f));
  const __m128i top2 = _mm_and_si128(_mm_srli_epi16(b, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  return _mm_or_si128(_mm_or_si128(low, high_nibble), top2);
}

// One block decoded: its weights are w[j] = a[s] * q[j] (+ b[s]) for j in sub-block
// s = j / sub. b is the file's offset (a minimum: + m; the K-quants' - dmin * m is
// stored negated, and x + (-m) rounds as x - m does).
// Where decode_block_t writes: q (block-size values), a and b (one per sub-block);
// pointers into a whole decoded row or into one block's arrays.
struct Decoded {
  int8_t* q;
  float* a;
  float* b;
  int sub;       // weights per sub-block: 16 or 32
  int nsub;      // sub-blocks in the block
  bool offset;   // whether b is used
};

// ---- blocks of 32 integers with one scale (and offset): decoded in registers ----------
// The legacy quants, IQ4_NL, MXFP4 and pagoda's own integer groups (GPTQ / AWQ /
// compressed-tensors): 32 int8 values v, a scale a and, for some, an offset b; the
// weights are a * v (+ b). decode_block_t stores them; the int8 products read them
// straight from the blocks (int8_dot32) with the same values.
constexpr bool is_block32(int type) {
  return type == kQ4_0 || type == kQ4_1 || type == kQ5_0 || type == kQ5_1 || type == kQ8_0 || type == kIQ4_NL ||
         type == kMXFP4 || type == kPQ4Z || type == kPQ4ZF || type == kPQ8Z || type == kPQ8ZF;
}

// 16 bytes of nibbles -> 32 values: byte j's low nibble to value j, its high one to j + 16.
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

// The same through a 16-entry table (Q4_0, IQ4_NL, MXFP4).
inline __m256i lookup32(const uint8_t* p, const int8_t* table) {
  const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(table));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), m)),
                          _mm_shuffle_epi8(lut, _mm_and_si128(b, m)));
}

// A block32 type's 32 values v (zeros for the other types, never called with them).
template <int T>
inline __m256i block32_values(const uint8_t* p) {
  if constexpr (T == kQ4_0) {
    return lookup32(p + 2, kQ4_0Values);
  } else if constexpr (T == kQ4_1) {
    return nibbles32(p + 4);
  } else if constexpr (T == kIQ4_NL) {
    return lookup32(p + 2, kIQ4Values);
  } else if constexpr (T == kQ5_0 || T == kQ5_1) {
    constexpr int off = T == kQ5_1 ? 4 : 2;
    uint32_t qh;
    std::memcpy(&qh, p + off, 4);
    // Bit j of qh (the fifth bit of weight j): byte j gets qh's byte j / 8, then its bit
    // j % 8 is tested.
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(qh)),
        _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    const __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
    const __m256i v = _mm256_or_si256(nibbles32(p + off + 4), fifth);
    return T == kQ5_0 ? _mm256_sub_epi8(v, _mm256_set1_epi8(16)) : v;
  } else if constexpr (T == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
  } else if constexpr (T == kMXFP4) {
    return lookup32(p + 1, kMXFP4Values);
  } else if constexpr (T == kPQ4Z || T == kPQ4ZF) {
    // nibble - z in int8 (z <= 127: exact), no offset.
    constexpr int sb = own_scale_bytes(T);
    return _mm256_sub_epi8(nibbles32(p + sb + 1), _mm256_set1_epi8(static_cast<char>(p[sb])));
  } else if constexpr (T == kPQ8Z || T == kPQ8ZF) {
    // q - z spans more than int8: q - 128 (the byte's top bit flipped) and the offset
    // d * (128 - z) (block32_offset); dequantize_row_t computes d * (q - z) itself.
    constexpr int sb = own_scale_bytes(T);
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + sb + 2)),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
  } else {
    return _mm256_setzero_si256();
  }
}

// Its scale a, and its offset b (has_offset types; a: its scale).
template <int T>
inline float block32_scale(const uint8_t* p) {
  if constexpr (T == kMXFP4) return e8m0_half(p[0]);
  else if constexpr (T == kPQ4Z || T == kPQ4ZF || T == kPQ8Z || T == kPQ8ZF) return own_scale<T>(p);
  else return f16_at(p);
}
template <int T>
inline float block32_offset(const uint8_t* p, float a) {
  if constexpr (T == kPQ8Z || T == kPQ8ZF) {
    int16_t z;
    std::memcpy(&z, p + own_scale_bytes(T), 2);
    return a * static_cast<float>(128 - z);
  } else {
    return f16_at(p + 2);  // Q4_1, Q5_1: the minimum m
  }
}

template <int type>
inline void decode_block_t(const uint8_t* p, Decoded& d) {
  int8_t* q = d.q;
  uint8_t* uq = reinterpret_cast<uint8_t*>(q);
  d.sub = 32;
  d.nsub = 1;
  d.offset = false;
  if constexpr (is_block32(type)) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), block32_values<type>(p));
    d.a[0] = block32_scale<type>(p);
    if constexpr (has_offset(type)) {
      d.b[0] = block32_offset<type>(p, d.a[0]);
      d.offset = true;
    }
    return;
  }
  switch (type) {
    case kNVFP4_32:
    case kNVFP4_128: {
      // g, then one e4m3 scale per 16 weights, then the nibbles (16 bytes per 32 weights).
      constexpr int groups = (type == kNVFP4_32 ? 32 : 128) / 16;
      float g;
      std::memcpy(&g, p, 4);
      for (int c = 0; c < groups / 2; ++c) lookup_nibbles16(p + 4 + groups + 16 * c, kMXFP4Values, q + 32 * c);
      d.sub = 16;
      d.nsub = groups;
      // The values are doubled (kMXFP4Values), the scales halved: exact for any scale
      // above float32's smallest normals.
      for (int j = 0; j < groups; ++j) d.a[j] = (e4m3_to_f32(p[4 + j]) / g) * 0.5f;
      break;
    }
    case kQ2_K: {
      const uint8_t* scales = p;
      const uint8_t* qs = p + 16;
      const float dd = f16_at(p + 80), dmin = f16_at(p + 82);
      // Weight half * 128 + s * 32 + l is bits 2s..2s+1 of qs[half * 32 + l] (16-bit
      // shifts: the bits carried in from the neighbouring byte are masked off).
      const __m256i m2 = _mm256_set1_epi8(3);
      for (int half = 0; half < 2; ++half) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * half));
        for (int s = 0; s < 4; ++s)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(uq + half * 128 + s * 32),
                              _mm256_and_si256(_mm256_srli_epi16(v, 2 * s), m2));
      }
      d.sub = 16;
      d.nsub = 16;
      d.offset = true;
      // a = dd * (low nibble), b = -(dmin * high nibble): each product rounded, then negated.
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales));
      const __m128i m4 = _mm_set1_epi8(0x0F);
      const __m128i lo = _mm_and_si128(sc, m4), hi = _mm_and_si128(_mm_srli_epi16(sc, 4), m4);
      const __m256 ddv = _mm256_set1_ps(dd), dminv = _mm256_set1_ps(dmin), sign = _mm256_set1_ps(-0.f);
      for (int h = 0; h < 2; ++h) {
        const __m128i l8 = h ? _mm_unpackhi_epi64(lo, lo) : lo, h8 = h ? _mm_unpackhi_epi64(hi, hi) : hi;
        _mm256_storeu_ps(d.a + 8 * h, _mm256_mul_ps(ddv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(l8))));
        _mm256_storeu_ps(d.b + 8 * h,
                         _mm256_xor_ps(_mm256_mul_ps(dminv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h8))), sign));
      }
      break;
    }
    case kQ3_K: {
      const uint8_t* hmask = p;
      const uint8_t* qs = p + 32;
      const uint8_t* s = p + 96;
      const float dd = f16_at(p + 108);
      // Weight w = half * 128 + s * 32 + l: 2 low bits from qs as in Q2_K, and minus 4
      // where bit w / 32 of hmask[l] is clear.
      const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hmask));
      const __m256i m2 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4), zero = _mm256_setzero_si256();
      for (int half = 0; half < 2; ++half) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * half));
        for (int sh = 0; sh < 4; ++sh) {
          const __m256i low = _mm256_and_si256(_mm256_srli_epi16(v, 2 * sh), m2);
          const __m256i clear = _mm256_cmpeq_epi8(_mm256_and_si256(hm, _mm256_set1_epi8(1 << (half * 4 + sh))), zero);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + half * 128 + sh * 32),
                              _mm256_sub_epi8(low, _mm256_and_si256(clear, four)));
        }
      }
      d.sub = 16;
      d.nsub = 16;
      for (int j = 0; j < 16; ++j) {
        // 6-bit scales: low 4 bits from bytes 0-7 (low nibbles, then high), high 2 from bytes 8-11.
        const int lo = (s[j % 8] >> (4 * (j / 8))) & 0x0F;
        const int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        d.a[j] = dd * static_cast<float>(static_cast<int8_t>(lo | (hi << 4)) - 32);
      }
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      const float dd = f16_at(p), dmin = f16_at(p + 2);
      const uint8_t* s = p + 4;
      const bool five = type == kQ5_K;
      const uint8_t* qs = p + (five ? 48 : 16);
      // Weight c * 64 + l: low nibble of qs[c * 32 + l]; c * 64 + 32 + l: its high nibble.
      for (int c = 0; c < 4; ++c) split_nibbles32(qs + 32 * c, uq + 64 * c);
      if (five) {
        // Bit j of qh[l] is the fifth bit of weight j * 32 + l.
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
        const __m256i bit = _mm256_set1_epi8(0x10);
        for (int j = 0; j < 8; ++j) {
          // Move bit j of every byte to bit 4: shift 16-bit lanes, then mask.
          const __m256i h = j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
          __m256i* dst = reinterpret_cast<__m256i*>(uq + 32 * j);
          _mm256_storeu_si256(dst, _mm256_or_si256(_mm256_loadu_si256(dst), _mm256_and_si256(h, bit)));
        }
      }
      d.nsub = 8;
      d.offset = true;
      // a = dd * scale; b = -(dmin * m): the product rounded, then negated (exact), as
      // (-dmin) * m rounds.
      const __m128i sm = k4_scales_mins(s);
      _mm256_storeu_ps(d.a, _mm256_mul_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm))));
      _mm256_storeu_ps(d.b, _mm256_mul_ps(_mm256_set1_ps(-dmin),
                                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(sm, sm)))));
      break;
    }
    case kQ6_K: {
      const uint8_t* ql = p;
      const uint8_t* qh = p + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
      const float dd = f16_at(p + 208);
      const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
      for (int half = 0; half < 2; ++half) {
        // Weights half * 128 + [0, 32): low nibbles of ql[0..31] | bits 0-1 of qh << 4;
        // [32, 64): low nibbles of ql[32..63] | bits 2-3; [64, 96): high nibbles of ql[0..31]
        // | bits 4-5; [96, 128): high nibbles of ql[32..63] | bits 6-7. Minus 32. The two
        // bits reach bits 4-5 by one 16-bit shift each (none for bits 4-5), then a mask
        // (which also drops what the shift carried in from the neighbouring byte).
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * half));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * half + 32));
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * half));
        const __m256i lows[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                                 _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                 _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
        const __m256i highs[4] = {_mm256_and_si256(_mm256_slli_epi16(h, 4), m30),
                                  _mm256_and_si256(_mm256_slli_epi16(h, 2), m30), _mm256_and_si256(h, m30),
                                  _mm256_and_si256(_mm256_srli_epi16(h, 2), m30)};
        for (int c = 0; c < 4; ++c)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 128 * half + 32 * c),
                              _mm256_sub_epi8(_mm256_or_si256(lows[c], highs[c]), bias));
      }
      d.sub = 16;
      d.nsub = 16;
      // a = dd * scale (int8 scales, exact in float), 8 at a time.
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales));
      const __m256 ddv = _mm256_set1_ps(dd);
      _mm256_storeu_ps(d.a, _mm256_mul_ps(ddv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
      _mm256_storeu_ps(d.a + 8, _mm256_mul_ps(ddv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc)))));
      break;
    }
    case kIQ4_XS: {
      const float dd = f16_at(p);
      uint16_t sh;
      std::memcpy(&sh, p + 2, 2);
      const uint8_t* sl = p + 4;
      const uint8_t* qs = p + 8;
      d.nsub = 8;
      for (int ib = 0; ib < 8; ++ib) {
        lookup_nibbles16(qs + 16 * ib, kIQ4Values, q + 32 * ib);
        const int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4);
        d.a[ib] = dd * static_cast<float>(ls - 32);
      }
      break;
    }
    default:
      TORCH_CHECK(false, "unsupported ggml type ", type);
  }
}

// Calls f(std::integral_constant<int, T>) for the block type T == type.
template <typename F>
void with_block_type(int type, F&& f) {
  switch (type) {
#define PAGODA_BLOCK_TYPE(T) case T: f(std::integral_constant<int, T>{}); return;
    PAGODA_BLOCK_TYPE(kQ4_0) PAGODA_BLOCK_TYPE(kQ4_1) PAGODA_BLOCK_TYPE(kQ5_0) PAGODA_BLOCK_TYPE(kQ5_1)
    PAGODA_BLOCK_TYPE(kQ8_0) PAGODA_BLOCK_TYPE(kIQ4_NL) PAGODA_BLOCK_TYPE(kQ2_K) PAGODA_BLOCK_TYPE(kQ3_K)
    PAGODA_BLOCK_TYPE(kQ4_K) PAGODA_BLOCK_TYPE(kQ5_K) PAGODA_BLOCK_TYPE(kQ6_K) PAGODA_BLOCK_TYPE(kIQ4_XS)
    PAGODA_BLOCK_TYPE(kMXFP4) PAGODA_BLOCK_TYPE(kPQ4Z) PAGODA_BLOCK_TYPE(kPQ8Z)
    PAGODA_BLOCK_TYPE(kPQ4ZF) PAGODA_BLOCK_TYPE(kPQ8ZF) PAGODA_BLOCK_TYPE(kNVFP4_32) PAGODA_BLOCK_TYPE(kNVFP4_128)
#undef PAGODA_BLOCK_TYPE
    default: TORCH_CHECK(false, "unsupported ggml type ", type);
  }
}

// A PQ8Z / PQ8ZF row: w = d * (q - z), the integer difference converted exactly, one rounding.
template <int T>
void dequantize_pq8z_row(const uint8_t* p, int64_t K, float* y) {
  constexpr int sb = own_scale_bytes(T);
  for (int64_t blk = 0; blk < K / 32; ++blk, p += sb + 34, y += 32) {
    int16_t z;
    std::memcpy(&z, p + sb, 2);
    const __m256 dv = _mm256_set1_ps(own_scale<T>(p));
    const __m256i zv = _mm256_set1_epi32(z);
    for (int j = 0; j < 32; j += 8) {
      const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + sb + 2 + j)));
      _mm256_storeu_ps(y + j, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, zv))));
    }
  }
}

// One row of K weights of block type T at p -> y (the type dispatched once per row).
template <int T>
void dequantize_row_t(const uint8_t* p, int64_t K, float* y) {
  if constexpr (T == kPQ8Z || T == kPQ8ZF) {
    dequantize_pq8z_row<T>(p, K, y);
    return;
  }
  constexpr int block = block_of(T), sub = sub_block_of(T);
  const int64_t bytes = format_of(T).bytes;
  alignas(32) int8_t q[256];
  float a[16], b[16];
  Decoded d{q, a, b, sub, block / sub, false};
  for (int64_t blk = 0; blk < K / block; ++blk) {
    decode_block_t<T>(p + blk * bytes, d);
    float* yb = y + blk * block;
    for (int s = 0; s < block / sub; ++s) {
      if constexpr (has_offset(T))
        emit_affine(q + s * sub, sub, a[s], b[s], yb + s * sub);
      else
        emit_scaled(q + s * sub, sub, a[s], yb + s * sub);
    }
  }
}

// One row of K weights of `type` at p -> y.
void dequantize_row(int type, const uint8_t* p, int64_t K, float* y) {
  switch (type) {
    case kF32:
      std::memcpy(y, p, K * 4);
      return;
    case kF16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        _mm256_storeu_ps(y + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + k))));
      for (; k < K; ++k) y[k] = pagoda::h2f(h[k]);
      return;
    }
    case kBF16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + k)));
        _mm256_storeu_ps(y + k, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      }
      for (; k < K; ++k) {
        const uint32_t bits = static_cast<uint32_t>(h[k]) << 16;
        std::memcpy(y + k, &bits, 4);
      }
      return;
    }
    case kFP8_32:
    case kFP8_128: {
      const int block = type == kFP8_32 ? 32 : 128;
      for (int64_t b = 0; b < K / block; ++b, p += 4 + block) {
        float s;
        std::memcpy(&s, p, 4);
        emit_fp8(p + 4, block, s, y + b * block);
      }
      return;
    }
    default:
      with_block_type(type, [&](auto t) { dequantize_row_t<decltype(t)::value>(p, K, y); });
  }
}

struct Part {
  const uint8_t* data;
  int type;
  int64_t rows;
  int64_t row_bytes;
  int64_t col;  // first output column of this part
};

std::vector<Part> check_parts(const std::vector<torch::Tensor>& parts, const std::vector<int64_t>& types, int64_t K) {
  TORCH_CHECK(!parts.empty() && parts.size() == types.size(), "one ggml type per weight part");
  std::vector<Part> out;
  int64_t col = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const torch::Tensor& t = parts[i];
    const BlockFormat f = format_of(types[i]);
    TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kUInt8 && t.is_contiguous(),
                "weight part ", i, " must be contiguous uint8 [rows, bytes per row]");
    TORCH_CHECK(K % f.block == 0, "in_features ", K, " is not a multiple of the block size ", f.block);
    TORCH_CHECK(t.size(1) == K / f.block * f.bytes, "weight part ", i, " has ", t.size(1),
                " bytes per row; in_features ", K, " of type ", types[i], " needs ", K / f.block * f.bytes);
    TORCH_CHECK(!is_lanes(static_cast<int>(types[i])) || t.size(0) % 16 == 0,
                "a repacked part holds channels in groups of 16");
    out.push_back({t.data_ptr<uint8_t>(), static_cast<int>(types[i]), t.size(0), t.size(1), col});
    col += t.size(0);
  }
  return out;
}

// Steps of up to this many rows run pagoda's micro-kernels (block types: products from
// decoded rows up to kDirectRows rows, then dequantized tiles); larger ones BLAS on
// dequantized panels.
constexpr int64_t kSmallSteps = 16;
// Up to this many rows, block types multiply from decoded rows (no dequantized weight
// stored); above, dequantized tiles for the float32 micro-kernel are cheaper (each
// weight's conversion shared by more rows). Measured on the bundled model, 16-row steps,
// one thread: 145 ms from decoded rows, 97 ms from tiles.
constexpr int64_t kDirectRows = 4;

// Runs f(i, scratch) for i in [0, n) over the thread pool, each thread taking the next
// few units as it finishes (an atomic counter) rather than a fixed half: a thread that
// is slowed (its core shared, its memory channel busier) no longer leaves the other
// waiting at the barrier. One Scratch per thread. Results do not depend on which thread
// ran a unit.
template <typename Scratch, typename F>
void for_each_unit(int64_t n, F&& f) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  const int64_t chunk = std::max<int64_t>(1, n / (8 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i0; (i0 = next.fetch_add(chunk, std::memory_order_relaxed)) < n;)
      for (int64_t i = i0; i < std::min(n, i0 + chunk); ++i) f(i, scratch);
  });
}

// A unit of work: rows [n0, n1) of one part.
struct Tile {
  int part;
  int64_t n0, n1;
};

// Tiles of rows_per_tile rows (k_rows_per_tile for the Q4_K / Q6_K parts, if given).
std::vector<Tile> tiles_of(const std::vector<Part>& parts, int64_t rows_per_tile, int64_t k_rows_per_tile = 0) {
  std::vector<Tile> tiles;
  for (size_t p = 0; p < parts.size(); ++p) {
    const bool k = k_rows_per_tile > 0 && (parts[p].type == kQ4_K || parts[p].type == kQ6_K);
    // A repacked part: two groups of 16 channels a tile.
    const int64_t step = is_lanes(parts[p].type) ? 32 : k ? k_rows_per_tile : rows_per_tile;
    for (int64_t n0 = 0; n0 < parts[p].rows; n0 += step)
      tiles.push_back({static_cast<int>(p), n0, std::min(parts[p].rows, n0 + step)});
  }
  return tiles;
}

// ---- small steps of block types: products from decoded rows -------------------------
// Per (row r, channel n) and sub-block s: d = sum_j x[r, j] q[j] over the sub-block in
// eight float32 lanes (fused multiply-adds in j order, lane l taking j = l, l + 8, ...),
// then acc += a[s] * d (lanes) and off += b[s] * (the sub-block's sum of x), the product
// and the sum rounded separately; y = hsum(acc) + off (+ bias). That is the float32
// product with the dequantized weights a q + b, its sums grouped by sub-block (within
// float32 rounding of it), and no dequantized weight is stored: per weight one
// conversion and one FMA per row. The operations and their order are the same for
// every (r, n) whatever the number of rows, so a row's result does not depend on its
// batch (up to kSmallSteps rows).
//
// kChannels rows of W are decoded a chunk at a time (256 weights: one K-quant block or
// eight 32-weight blocks; int8 q and float scales, ~1.3 KiB, in L1), and every row of x
// runs over the chunk before the next is decoded; the sums carry from chunk to chunk,
// so chunking changes no operation and no order. The decoding (byte-wide, 32 weights
// per instruction) costs less than unpacking nibbles next to each multiply, and the
// chunk's int8 values are widened and converted right before their FMAs. The offset
// terms run four channels to a register (b transposed per chunk: lane o is channel
// o's scalar chain off += b[s] * xsum[s], the same roundings in the same order).
// Each chunk also asks for the same bytes of the channels about kDirectAhead bytes
// further on, the prefetches spread over the work rather than one burst per tile (one
// row of M = 1, one thread, Q6_K down projection of a 1B model: 2.5 -> 1.2 ms with the
// rest of this; the distance matters little between 8 and 128 KiB).

constexpr int kChannels = 4;
constexpr int64_t kDirectAhead = 48 * 1024;

// Sums of x over each group of 16 inputs, per row: xs[r * (K / 16) + g].
std::vector<float> group_sums16(const float* x, int64_t M, int64_t K) {
  std::vector<float> xs(M * (K / 16));
  for (int64_t i = 0; i < M * (K / 16); ++i) {
    const float* p = x + i * 16;
    xs[i] = pagoda::hsum256(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)));
  }
  return xs;
}

// A chunk of type T: `per` blocks of `block` weights, each of nsb sub-blocks of `sub`.
template <int T>
struct ChunkShape {
  static constexpr int block = block_of(T), sub = sub_block_of(T), nsb = block / sub;
  static constexpr int per = 256 / block;
};

// kChannels channels' chunk: q [channel][weight], a and b [channel][sub-block], and b
// transposed ([sub-block][channel], for the offsets; up to 16 sub-blocks per chunk).
struct DecodedChunk {
  alignas(32) int8_t q[kChannels][256];
  alignas(32) float a[kChannels][16];
  alignas(32) float b[kChannels][16] = {};
  alignas(32) float bt[16][kChannels];
};

// bt[s0 + s][o] = b[o][s0 + s] for s < 8 (4 x 8 -> 8 x 4, in registers).
inline void transpose_offsets(DecodedChunk& ch, int s0) {
  const __m256 r0 = _mm256_load_ps(ch.b[0] + s0), r1 = _mm256_load_ps(ch.b[1] + s0);
  const __m256 r2 = _mm256_load_ps(ch.b[2] + s0), r3 = _mm256_load_ps(ch.b[3] + s0);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);  // s 0 1 | 4 5
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);  // s 2 3 | 6 7
  const __m256 u[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),  // s 0 | 4, 1 | 5
                       _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};  // s 2 | 6, 3 | 7
  for (int s = 0; s < 4; ++s) {
    _mm_store_ps(ch.bt[s0 + s], _mm256_castps256_ps128(u[s]));
    _mm_store_ps(ch.bt[s0 + s + 4], _mm256_extractf128_ps(u[s], 1));
  }
}

// Blocks [b0, b0 + nb) of the kChannels rows -> ch.
template <int T>
inline void decode_chunk(const uint8_t* const* rows, int64_t bytes, int64_t b0, int nb, DecodedChunk& ch) {
  using S = ChunkShape<T>;
  for (int o = 0; o < kChannels; ++o)
    for (int i = 0; i < nb; ++i) {
      Decoded d{ch.q[o] + i * S::block, ch.a[o] + i * S::nsb, ch.b[o] + i * S::nsb, S::sub, S::nsb, false};
      decode_block_t<T>(rows[o] + (b0 + i) * bytes, d);
    }
  if constexpr (has_offset(T)) {
    transpose_offsets(ch, 0);
    if (S::per * S::nsb > 8) transpose_offsets(ch, 8);
  }
}

// acc[r0 + r][c0 + o] += the chunk's ns sub-blocks for rows r0 .. r0 + MR of x (xc: the
// chunk's first input of row 0) and decoded channels c0 .. c0 + NC; the sums are held in
// registers over the chunk.
template <int T, int MR, int NC>
inline void chunk_dot(const float* xc, int64_t K, const DecodedChunk& ch, int64_t r0, int c0, int ns,
                      __m256 (&acc)[kDirectRows][kChannels]) {
  constexpr int sub = ChunkShape<T>::sub;
  __m256 sums[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int o = 0; o < NC; ++o) sums[r][o] = acc[r0 + r][c0 + o];
  for (int s = 0; s < ns; ++s) {
    __m256 d[MR][NC];
    for (int c = 0; c < sub; c += 8) {
      __m256 qv[NC];
      for (int o = 0; o < NC; ++o) qv[o] = load_q8(ch.q[c0 + o] + s * sub + c);
      for (int r = 0; r < MR; ++r) {
        const __m256 xv = _mm256_loadu_ps(xc + (r0 + r) * K + s * sub + c);
        for (int o = 0; o < NC; ++o) d[r][o] = _mm256_fmadd_ps(xv, qv[o], c == 0 ? _mm256_setzero_ps() : d[r][o]);
      }
    }
    for (int o = 0; o < NC; ++o) {
      const __m256 av = _mm256_set1_ps(ch.a[c0 + o][s]);
      for (int r = 0; r < MR; ++r) sums[r][o] = _mm256_fmadd_ps(av, d[r][o], sums[r][o]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int o = 0; o < NC; ++o) acc[r0 + r][c0 + o] = sums[r][o];
}

// off[r] (lane o: channel o) += b[s] * (the sub-block's sum of x) for the chunk's ns
// sub-blocks, the first being sub-block s0 of the row; xsum as float_dot_reference takes
// it (a sub-block of 32: the two sums of 16 added).
template <int T, int MR>
inline void chunk_offsets(const float* xs, int64_t K, int64_t s0, const DecodedChunk& ch, int ns, __m128 (&off)[kDirectRows]) {
  constexpr int sub = ChunkShape<T>::sub;
  const int64_t groups = K / 16;
  for (int s = 0; s < ns; ++s) {
    const __m128 bv = _mm_load_ps(ch.bt[s]);
    for (int r = 0; r < MR; ++r) {
      const float* g = xs + r * groups + (s0 + s) * (sub / 16);
      const float xsum = sub == 32 ? g[0] + g[1] : g[0];
      off[r] = _mm_add_ps(off[r], _mm_mul_ps(bv, _mm_set1_ps(xsum)));
    }
  }
}

// Bytes [from, from + len) of channels n .. n + kChannels of w (those it has) towards L1.
inline void prefetch_channels(const Part& w, int64_t n, int64_t from, int64_t len) {
  for (int o = 0; o < kChannels && n + o < w.rows; ++o) {
    const char* p = reinterpret_cast<const char*>(w.data + (n + o) * w.row_bytes + from);
    for (int64_t c = 0; c < len; c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
  }
}

// Channels [n, n + nc) of part w (nc <= kChannels), the MR rows of x, block type T. A
// channel past nc repeats the last one (its sums are not stored).
template <int T, int MR>
void direct_channels(const float* x, int64_t K, const Part& w, int64_t n, int nc, const float* xs, const float* bias,
                     float* y, int64_t N, int64_t ahead) {
  using S = ChunkShape<T>;
  const int64_t bytes = format_of(T).bytes;
  DecodedChunk ch;
  const uint8_t* rows[kChannels];
  for (int o = 0; o < kChannels; ++o) rows[o] = w.data + (n + std::min(o, nc - 1)) * w.row_bytes;
  __m256 acc[kDirectRows][kChannels];
  __m128 off[kDirectRows];
  for (int r = 0; r < kDirectRows; ++r) {
    off[r] = _mm_setzero_ps();
    for (int o = 0; o < kChannels; ++o) acc[r][o] = _mm256_setzero_ps();
  }
  const int64_t nblocks = K / S::block;
  for (int64_t b0 = 0; b0 < nblocks; b0 += S::per) {
    const int nb = static_cast<int>(std::min<int64_t>(S::per, nblocks - b0));
    prefetch_channels(w, n + ahead, b0 * bytes, nb * bytes);
    decode_chunk<T>(rows, bytes, b0, nb, ch);
    const int ns = nb * S::nsb;
    const float* xc = x + b0 * S::block;
    int64_t r = 0;
    for (; r + 2 <= MR; r += 2) {
      chunk_dot<T, 2, 2>(xc, K, ch, r, 0, ns, acc);
      chunk_dot<T, 2, 2>(xc, K, ch, r, 2, ns, acc);
    }
    if (r < MR) chunk_dot<T, 1, kChannels>(xc, K, ch, r, 0, ns, acc);
    if constexpr (has_offset(T)) chunk_offsets<T, MR>(xs, K, b0 * S::nsb, ch, ns, off);
  }
  for (int r = 0; r < MR; ++r) {
    alignas(16) float of[kChannels];
    _mm_store_ps(of, off[r]);
    for (int o = 0; o < nc; ++o) {
      float v = pagoda::hsum256(acc[r][o]) + of[o];
      if (bias) v += bias[w.col + n + o];
      y[r * N + w.col + n + o] = v;
    }
  }
}

// Channels [n0, n1) of part w, all M (<= kDirectRows) rows, in float32 (xs: the sums of
// x per 16 inputs, group_sums16).
void direct_tile(const float* x, int64_t M, int64_t K, const Part& w, int64_t n0, int64_t n1, const float* xs,
                 const float* bias, float* y, int64_t N) {
  const int64_t ahead = std::max<int64_t>(kChannels, (kDirectAhead / w.row_bytes + kChannels - 1) / kChannels * kChannels);
  with_block_type(w.type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    for (int64_t n = n0; n < n1; n += kChannels) {
      const int nc = static_cast<int>(std::min<int64_t>(kChannels, n1 - n));
      switch (M) {
        case 1: direct_channels<T, 1>(x, K, w, n, nc, xs, bias, y, N, ahead); break;
        case 2: direct_channels<T, 2>(x, K, w, n, nc, xs, bias, y, N, ahead); break;
        case 3: direct_channels<T, 3>(x, K, w, n, nc, xs, bias, y, N, ahead); break;
        default: direct_channels<T, 4>(x, K, w, n, nc, xs, bias, y, N, ahead); break;
      }
    }
  });
}

// ---- whole decoded rows: the int8 mode's other block types, and the reference -------
// kChannels whole rows of W decoded (int8_tile's products), and the products above as
// first written (float_dot_reference: per (row, channel) the sums in order, offsets
// scalar), which gguf_linear_direct_reference runs for the tests to hold the chunked
// kernels to its bits.

// Channels decoded for the products: q [kChannels][K], a and b [kChannels][K / sub].
struct DecodedRows {
  std::vector<int8_t> q;
  std::vector<float> a, b;
  int64_t K = 0, nsub = 0;
  const int8_t* qc(int o) const { return q.data() + o * K; }
  const float* ac(int o) const { return a.data() + o * nsub; }
  const float* bc(int o) const { return b.data() + o * nsub; }
};

template <int T>
void decode_rows(const Part& w, int64_t n, int nc, int64_t K, DecodedRows& out) {
  constexpr int block = block_of(T), sub = sub_block_of(T);
  const int64_t bytes = format_of(T).bytes;
  out.K = K;
  out.nsub = K / sub;
  out.q.resize(kChannels * K);
  out.a.resize(kChannels * out.nsub);
  out.b.resize(kChannels * out.nsub);
  for (int o = 0; o < nc; ++o) {
    const uint8_t* row = w.data + (n + o) * w.row_bytes;
    for (int64_t b = 0; b < K / block; ++b) {
      Decoded d{out.q.data() + o * K + b * block, out.a.data() + o * out.nsub + b * (block / sub),
                out.b.data() + o * out.nsub + b * (block / sub), sub, block / sub, false};
      decode_block_t<T>(row + b * bytes, d);
    }
  }
}

// Per (row, channel): eight lanes of float sums and a scalar of offset terms, zeroed;
// store() writes y[r0 + r, col0 + o] = their sum (+ bias).
template <int MR, int NC>
struct Sums {
  __m256 acc[MR][NC];
  float off[MR][NC];
  Sums() {
    for (int r = 0; r < MR; ++r)
      for (int o = 0; o < NC; ++o) {
        acc[r][o] = _mm256_setzero_ps();
        off[r][o] = 0.f;
      }
  }
  void store(float* y, int64_t N, int64_t r0, int64_t col0, const float* bias) const {
    for (int r = 0; r < MR; ++r)
      for (int o = 0; o < NC; ++o) {
        float v = pagoda::hsum256(acc[r][o]) + off[r][o];
        if (bias) v += bias[col0 + o];
        y[(r0 + r) * N + col0 + o] = v;
      }
  }
};

// y for rows [r0, r0 + MR) and decoded channels [c0, c0 + NC) (channel n0 + c of part w).
template <int T, int MR, int NC>
void float_dot_reference(const float* x, int64_t K, int64_t r0, const DecodedRows& dr, int c0, const float* xs,
               const Part& w, int64_t n0, const float* bias, float* y, int64_t N) {
  constexpr int sub = sub_block_of(T);
  const int64_t groups = K / 16;
  Sums<MR, NC> sums;
  auto& acc = sums.acc;
  auto& off = sums.off;
  for (int64_t s = 0; s < K / sub; ++s) {
    __m256 d[MR][NC];
    for (int r = 0; r < MR; ++r)
      for (int o = 0; o < NC; ++o) d[r][o] = _mm256_setzero_ps();
    for (int c = 0; c < sub; c += 8) {
      __m256 qv[NC];
      for (int o = 0; o < NC; ++o) qv[o] = load_q8(dr.qc(c0 + o) + s * sub + c);
      for (int r = 0; r < MR; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + (r0 + r) * K + s * sub + c);
        for (int o = 0; o < NC; ++o) d[r][o] = _mm256_fmadd_ps(xv, qv[o], d[r][o]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int o = 0; o < NC; ++o) {
        acc[r][o] = _mm256_fmadd_ps(_mm256_set1_ps(dr.ac(c0 + o)[s]), d[r][o], acc[r][o]);
        if constexpr (has_offset(T)) {
          const float* g = xs + (r0 + r) * groups + s * sub / 16;
          const float xsum = sub == 32 ? g[0] + g[1] : g[0];
          off[r][o] += dr.bc(c0 + o)[s] * xsum;
        }
      }
  }
  sums.store(y, N, r0, w.col + n0 + c0, bias);
}

// Runs dot<MR, NC>(r0, c0) over rows [m0, m1) and decoded channels [0, nc): a single row
// against all channels at once, otherwise pairs of rows against pairs of channels (the
// registers hold MR x NC sums and as many partial sums).
template <typename Dot1x4, typename Dot1x1, typename Dot2x2, typename Dot2x1>
void for_row_channel_blocks(int64_t m0, int64_t m1, int nc, Dot1x4 d14, Dot1x1 d11, Dot2x2 d22, Dot2x1 d21) {
  int64_t r = m0;
  for (; r + 2 <= m1; r += 2) {
    int c = 0;
    for (; c + 2 <= nc; c += 2) d22(r, c);
    if (c < nc) d21(r, c);
  }
  if (r < m1) {
    if (nc == kChannels) {
      d14(r, 0);
    } else {
      for (int c = 0; c < nc; ++c) d11(r, c);
    }
  }
}

// direct_tile's reference: channels [n0, n1) of part w, all M rows.
void direct_tile_reference(const float* x, int64_t M, int64_t K, const Part& w, int64_t n0, int64_t n1,
                           const float* xs, const float* bias, float* y, int64_t N, DecodedRows& dr) {
  with_block_type(w.type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    for (int64_t n = n0; n < n1; n += kChannels) {
      const int nc = static_cast<int>(std::min<int64_t>(kChannels, n1 - n));
      decode_rows<T>(w, n, nc, K, dr);
      auto dot = [&](auto mr, auto ncc) {
        return [&, mr, ncc](int64_t r, int c) {
          float_dot_reference<T, decltype(mr)::value, decltype(ncc)::value>(x, K, r, dr, c, xs, w, n, bias, y, N);
        };
      };
      using I1 = std::integral_constant<int, 1>;
      using I2 = std::integral_constant<int, 2>;
      using I4 = std::integral_constant<int, 4>;
      for_row_channel_blocks(0, M, nc, dot(I1{}, I4{}), dot(I1{}, I1{}), dot(I2{}, I2{}), dot(I2{}, I1{}));
    }
  });
}

bool is_float_type(int type) { return type == kF32 || type == kF16 || type == kBF16; }
bool is_fp8_type(int type) { return type == kFP8_32 || type == kFP8_128; }
// Types whose products always run on dequantized float32 tiles (no int8 values to decode).
bool tiles_only(int type) { return is_float_type(type) || is_fp8_type(type); }
// Types the int8-activation products read.
bool int8_type(int type) { return !tiles_only(type); }

// ---- fast mode: the blocks times int8 activations (llama.cpp's arithmetic) ----------
// Each row of x is quantized per group of 32 inputs: dx = max|x| / 127, xq = x / dx
// rounded to nearest (ties to even), and the sums of xq per 16. Per group of 32 of a
// block: the integer dot product of the block's q with xq (maddubs on |q| and xq with
// q's sign: exact in int32), times a * dx in float32; an offset b adds b * dx * sum(xq).
// That is exactly W x' for the quantized x'. Every row is quantized and multiplied on
// its own, in the same order whatever the batch: a request's numbers do not depend on
// its batch, chunking or prefix-cache hits.

// Rows of x per pass over the weights: 128 rows measured 1.05-1.1x 64 rows for the AVX2
// K-quant panels (each panel decoded half as often) and even for the rest (2 threads).
constexpr int64_t kRowChunk = 128;

// std::vector whose resize leaves new elements of a trivial type unset (no zero fill):
// for buffers every element of which is written before it is read.
template <typename T>
struct NoFill : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = NoFill<U>;
  };
  NoFill() = default;
  template <typename U>
  NoFill(const NoFill<U>&) {}
  template <typename U, typename... A>
  void construct(U* p, A&&... a) {
    if constexpr (sizeof...(A) == 0)
      ::new (static_cast<void*>(p)) U;
    else
      ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
template <typename T>
using Buffer = std::vector<T, NoFill<T>>;

struct QuantizedX {
  Buffer<int8_t> q;     // [M, K]
  Buffer<float> d;      // [M, K / group]
  Buffer<int32_t> s16;  // [M, K / 16]
  Buffer<int16_t> h16;  // the same sums as int16 (|sum| <= 16 x 127)
  Buffer<int16_t> h32;  // sums per 32 as int16 (|sum| <= 32 x 127)
  // For the VNNI K-quant kernels (pack_rows16): groups of 16 rows, a row in each int32
  // lane; rows past M are zeros.
  std::vector<int32_t> p4;   // [G][K / 4][16]: four consecutive int8 of the row
  std::vector<float> pd;     // [G][K / 256][16]: the scales (groups of 256)
  std::vector<int32_t> p32;  // [G][K / 64][16]: h32 in pairs (two int16)
  std::vector<int32_t> p16;  // [G][K / 32][16]: h16 in pairs
  // For the AVX2 Q6_K panels (unsigned_rows): q + 128 as unsigned bytes, [M, K].
  std::vector<uint8_t> u;
  // Whether the AVX-512 versions run for this x (use_avx512() once per call: it reads the
  // environment, too slow for every tile).
  bool avx512 = false;
  // Whether the AMX kernels run for this x (use_amx(), read once per call the same way).
  bool amx = false;
  // For the AMX kernel of the repacked 32-weight types (amx_rows32): in groups of 16 rows,
  // [group][block][row] dx and (Q4_1) dx x sum(x) per 32.
  std::vector<float> t32d, t32o;
};

// x quantized in groups of `group` inputs (32, or 256 for the K-quant kernels) with one
// scale each; sums of xq per 16 either way.
QuantizedX quantize_x(const float* x, int64_t M, int64_t K, int64_t group = 32) {
  QuantizedX out;
  out.avx512 = use_avx512();
  out.amx = out.avx512 && use_amx();
  out.q.resize(M * K);
  out.d.resize(M * K / group);
  out.s16.resize(M * K / 16);
  out.h16.resize(M * K / 16);
  out.h32.resize(M * K / 32);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const int64_t chunks = group / 32;
  at::parallel_for(0, M * K / group, 256 / chunks, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      __m256 m = _mm256_setzero_ps();
      for (int64_t i = 0; i < group; i += 8)
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + g * group + i)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float d = _mm_cvtss_f32(h) / 127.f;
      const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
      out.d[g] = d;
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t c32 = g * chunks + ch;  // this chunk of 32 among the row-major chunks
        const float* xg = x + c32 * 32;
        __m256i i32[4];
        for (int c = 0; c < 4; ++c)
          i32[c] = _mm256_cvtps_epi32(
              _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xg + 8 * c), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        // Pack 32 int32 to 32 int8 in order (packs work within 128-bit lanes, then permute).
        const __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]), p16b = _mm256_packs_epi32(i32[2], i32[3]);
        __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + c32 * 32), p8);
        const __m256i s01 = _mm256_add_epi32(i32[0], i32[1]), s23 = _mm256_add_epi32(i32[2], i32[3]);
        const __m256i hs = _mm256_hadd_epi32(s01, s23);  // [a01 a23 b01 b23 | a45 a67 b45 b67] per 128-bit lane
        const __m256i hs2 = _mm256_hadd_epi32(hs, hs);
        out.s16[2 * c32] = _mm256_extract_epi32(hs2, 0) + _mm256_extract_epi32(hs2, 4);
        out.s16[2 * c32 + 1] = _mm256_extract_epi32(hs2, 1) + _mm256_extract_epi32(hs2, 5);
        out.h16[2 * c32] = static_cast<int16_t>(out.s16[2 * c32]);
        out.h16[2 * c32 + 1] = static_cast<int16_t>(out.s16[2 * c32 + 1]);
        out.h32[c32] = static_cast<int16_t>(out.s16[2 * c32] + out.s16[2 * c32 + 1]);
      }
    }
  });
  return out;
}

// Rows rows[i].first of xq (quantized in groups of `group`, K inputs a row) as a QuantizedX
// of their own, in that order: every row is quantized on its own, so these are the very
// values quantize_x gives those rows alone.
template <typename Rows>
QuantizedX gather_quantized(const QuantizedX& xq, const Rows& rows, int64_t K, int64_t group) {
  QuantizedX out;
  out.avx512 = xq.avx512;
  out.amx = xq.amx;
  const int64_t n = static_cast<int64_t>(rows.size());
  out.q.resize(n * K);
  out.d.resize(n * K / group);
  out.s16.resize(n * K / 16);
  out.h16.resize(n * K / 16);
  out.h32.resize(n * K / 32);
  auto copy = [&](const auto& src, auto& dst, int64_t width) {
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(dst.data() + r * width, src.data() + rows[r].first * width, width * sizeof(src[0]));
  };
  copy(xq.q, out.q, K);
  copy(xq.d, out.d, K / group);
  copy(xq.s16, out.s16, K / 16);
  copy(xq.h16, out.h16, K / 16);
  copy(xq.h32, out.h32, K / 32);
  return out;
}

// xq.u = xq.q + 128 (1 .. 255 as unsigned bytes: the sign bit flipped), for the AVX2 Q6_K
// panels.
void unsigned_rows(QuantizedX& xq) {
  xq.u.resize(xq.q.size());
  const int64_t n = static_cast<int64_t>(xq.q.size());
  at::parallel_for(0, n / 32, 1024, [&](int64_t i0, int64_t i1) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int64_t i = i0; i < i1; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + 32 * i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq.u.data() + 32 * i), _mm256_xor_si256(v, flip));
    }
  });
  for (int64_t i = n / 32 * 32; i < n; ++i) xq.u[i] = static_cast<uint8_t>(xq.q[i] ^ 0x80);
}

// xq (quantized in groups of 256) laid out for the VNNI K-quant kernels: 16 rows side by
// side in every 64-byte vector.
void pack_rows16(QuantizedX& xq, int64_t M, int64_t K) {
  const int64_t G = (M + 15) / 16;
  xq.p4.assign(G * (K / 4) * 16, 0);
  xq.pd.assign(G * (K / 256) * 16, 0.f);
  xq.p32.assign(G * (K / 64) * 16, 0);
  xq.p16.assign(G * (K / 32) * 16, 0);
  auto spread = [](const void* src, int64_t n, int32_t* dst) {  // n int32 of one row, 16 apart
    const char* c = static_cast<const char*>(src);
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * 16, c + 4 * i, 4);
  };
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int64_t g = m / 16, l = m % 16;
      spread(xq.q.data() + m * K, K / 4, xq.p4.data() + g * (K / 4) * 16 + l);
      spread(xq.h32.data() + m * (K / 32), K / 64, xq.p32.data() + g * (K / 64) * 16 + l);
      spread(xq.h16.data() + m * (K / 16), K / 32, xq.p16.data() + g * (K / 32) * 16 + l);
      for (int64_t b = 0; b < K / 256; ++b) xq.pd[(g * (K / 256) + b) * 16 + l] = xq.d[m * (K / 256) + b];
    }
  });
}

// ---- Q4_K and Q6_K against x in groups of 256 (llama.cpp's Q8_K) -------------------
// The 4- or 6-bit values are unsigned (Q6_K's stored q + 32), so the integer products
// take them directly. Per (row, channel) and block b of 256 inputs, the kernels compute
// one exact integer I_b = sum_j sc_j * (sum over sub-block j of q xq), with Q6_K's -32
// folded in (- 32 sum_j sc_j * sum(xq over sub-block j)), and for Q4_K the minimums'
// M_b = sum_j mn_j * sum(xq over sub-block j); then, in float32 and in block order,
//   acc = fma(d dx, I_b, acc);  acc = fma(-(dmin dx), M_b, acc)     (Q4_K)
//   acc = fma(d dx, I_b, acc)                                     (Q6_K)
// and y = acc (+ bias). The integers are exact however they are summed, so the AVX2
// kernels below (one channel against 1-4 rows, maddubs/madd) and the AVX-512 VNNI ones
// (16 rows in the lanes, vpdpbusd) give the same bits for every row: a row's result
// does not depend on which kernel its batch size picked.

// kScaleLanes[j]: a pshufb mask that puts int16 lane j (of each 128-bit half) in all 8
// lanes of that half.
struct ScaleLanes {
  alignas(32) uint8_t m[8][32];
  ScaleLanes() {
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 32; i += 2) {
        m[j][i] = static_cast<uint8_t>(2 * j);
        m[j][i + 1] = static_cast<uint8_t>(2 * j + 1);
      }
  }
  __m256i operator[](int j) const { return _mm256_load_si256(reinterpret_cast<const __m256i*>(m[j])); }
};
const ScaleLanes kScaleLanes;

inline __m256i nibbles_lo(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i nibbles_hi(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }

// Lane r (< MR) of the result: the sum of the eight int32 lanes of v[r].
template <int MR>
inline __m128i hsum_rows(const __m256i* v) {
  __m256i h;
  if constexpr (MR == 1) {
    h = _mm256_hadd_epi32(v[0], v[0]);
    h = _mm256_hadd_epi32(h, h);
  } else if constexpr (MR == 2) {
    h = _mm256_hadd_epi32(v[0], v[1]);
    h = _mm256_hadd_epi32(h, h);  // [r0 r1 r0 r1 | r0 r1 r0 r1] partial sums per half
  } else {
    static_assert(MR == 4, "1, 2 or 4 rows");
    h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  }
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// The same for 128-bit v[r] (four lanes).
template <int MR>
inline __m128i hsum_rows128(const __m128i* v) {
  if constexpr (MR == 1) {
    const __m128i h = _mm_hadd_epi32(v[0], v[0]);
    return _mm_hadd_epi32(h, h);
  } else if constexpr (MR == 2) {
    const __m128i h = _mm_hadd_epi32(v[0], v[1]);
    return _mm_hadd_epi32(h, h);
  } else {
    static_assert(MR == 4, "1, 2 or 4 rows");
    return _mm_hadd_epi32(_mm_hadd_epi32(v[0], v[1]), _mm_hadd_epi32(v[2], v[3]));
  }
}

// x's scales of block b for rows r0 .. r0 + MR - 1 (lanes past MR: 0).
template <int MR>
inline __m128 row_scales(const QuantizedX& xq, int64_t K, int64_t r0, int64_t b) {
  alignas(16) float dx[4] = {0.f, 0.f, 0.f, 0.f};
  for (int r = 0; r < MR; ++r) dx[r] = xq.d[(r0 + r) * (K / 256) + b];
  return _mm_load_ps(dx);
}

template <int MR>
inline void store_rows(__m128 acc, const float* bias, float* y, int64_t r0, int64_t N, int64_t col) {
  alignas(16) float v[4];
  _mm_store_ps(v, acc);
  for (int r = 0; r < MR; ++r) y[(r0 + r) * N + col] = bias ? v[r] + bias[col] : v[r];
}

// Q6_K's stored values (q + 32, 0-63) of weights half * 128 + 32c .. + 31 (sub-blocks
// 8 half + 2c and + 1), as in decode_block_t, from the half's two 32-byte rows of low
// bits l0, l1 and its 32 bytes of high bits h.
inline __m256i q6k_values(__m256i l0, __m256i l1, __m256i h, int c) {
  const __m256i l = (c & 1) ? l1 : l0;
  const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(h, 2 * c), _mm256_set1_epi8(3));
  return _mm256_or_si256(c < 2 ? nibbles_lo(l) : nibbles_hi(l), _mm256_slli_epi16(hb, 4));
}

// acc + madd(a, b) (int16 pairs summed into int32 lanes): with V one AVX-512 VNNI vpdpwssd
// in place of vpmaddwd and vpaddd (the same integers). Written as assembly so the AVX2
// kernels that inline it need no AVX-512 target; V is true only where use_avx512() holds.
template <bool V>
__attribute__((always_inline)) inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) {
  if constexpr (V) {
    __asm__("vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
    return acc;
  } else {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
  }
}

// One Q4_K block p against rows r0 .. r0 + MR - 1 of x (block b): isum[r] (8 int32 lanes
// summing to I_b) and msum[r] (4 lanes summing to M_b). Inlined into each kernel (a call
// would keep the sums in memory). V: the products summed by vpdpwssd (madd_add).
template <int MR, bool V = false>
__attribute__((always_inline)) inline void q4k_block(const QuantizedX& xq, int64_t K, int64_t r0, int64_t b,
                                                     const uint8_t* p, __m256i* isum, __m128i* msum) {
  const __m256i sm = _mm256_cvtepu8_epi16(k4_scales_mins(p + 4));  // scales: int16 lanes 0-7, minimums 8-15
  const __m128i sc = _mm256_castsi256_si128(sm), mins = _mm256_extracti128_si256(sm, 1);
  const __m256i scales = _mm256_set_m128i(sc, sc);
  for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {  // weights 64c .. 64c + 63: sub-blocks 2c (low nibbles), 2c + 1 (high)
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + 32 * c));
    const __m256i lo = nibbles_lo(v), hi = nibbles_hi(v);
    const __m256i slo = _mm256_shuffle_epi8(scales, kScaleLanes[2 * c]);
    const __m256i shi = _mm256_shuffle_epi8(scales, kScaleLanes[2 * c + 1]);
    for (int r = 0; r < MR; ++r) {
      const int8_t* xr = xq.q.data() + (r0 + r) * K + b * 256 + 64 * c;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32));
      isum[r] = madd_add<V>(madd_add<V>(isum[r], _mm256_maddubs_epi16(lo, x0), slo), _mm256_maddubs_epi16(hi, x1), shi);
    }
  }
  for (int r = 0; r < MR; ++r)  // sum_j mn_j * sum(xq over sub-block j), as four lanes of pairs
    msum[r] = _mm_madd_epi16(mins, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq.h32.data() + (r0 + r) * (K / 32) + b * 8)));
}

// One Q6_K block p against rows r0 .. r0 + MR - 1 of x: isum[r] sums to I_b (q + 32 in
// maddubs, then - 32 sum_j scale_j sum(xq over sub-block j) in int32: exact, |sums| < 2^29).
template <int MR, bool V = false>
__attribute__((always_inline)) inline void q6k_block(const QuantizedX& xq, int64_t K, int64_t r0, int64_t b,
                                                     const uint8_t* p, __m256i* isum) {
  const __m256i sc_all = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
  const __m128i lo8 = _mm256_castsi256_si128(sc_all), hi8 = _mm256_extracti128_si256(sc_all, 1);
  for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
  for (int half = 0; half < 2; ++half) {
    const __m256i scales = half ? _mm256_set_m128i(hi8, hi8) : _mm256_set_m128i(lo8, lo8);
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * half));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * half + 32));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * half));
    for (int c = 0; c < 4; ++c) {
      const __m256i q = q6k_values(l0, l1, h, c);
      // int16 lanes 0-7 <- scale 2c, lanes 8-15 <- scale 2c + 1 (of this half)
      const __m256i s = _mm256_shuffle_epi8(scales, _mm256_blend_epi32(kScaleLanes[2 * c], kScaleLanes[2 * c + 1], 0xF0));
      for (int r = 0; r < MR; ++r) {
        const __m256i xv = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(xq.q.data() + (r0 + r) * K + b * 256 + 128 * half + 32 * c));
        isum[r] = madd_add<V>(isum[r], _mm256_maddubs_epi16(q, xv), s);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    const __m256i b16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.h16.data() + (r0 + r) * (K / 16) + b * 16));
    isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(_mm256_madd_epi16(sc_all, b16), 5));
  }
}

// y[(r0 + r) * N + col] for r < MR: channel `row` of a Q4_K part.
template <int MR>
void q4k_rows(const QuantizedX& xq, int64_t K, int64_t r0, const uint8_t* row, const float* bias, float* y,
              int64_t N, int64_t col) {
  __m128 acc = _mm_setzero_ps();  // lane r: row r0 + r
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* p = row + b * 144;
    __m256i isum[MR];
    __m128i msum[MR];
    q4k_block<MR>(xq, K, r0, b, p, isum, msum);
    int32_t dd_bits;
    std::memcpy(&dd_bits, p, 4);
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(dd_bits));  // d, dmin
    if constexpr (MR == 1) {  // I and M in one horizontal sum: lanes [I, M, I, M]
      const __m128i i4 = _mm_add_epi32(_mm256_castsi256_si128(isum[0]), _mm256_extracti128_si256(isum[0], 1));
      const __m128i t = _mm_hadd_epi32(i4, msum[0]);
      const __m128 im = _mm_cvtepi32_ps(_mm_hadd_epi32(t, t));
      const __m128 s = _mm_mul_ps(dd, _mm_set1_ps(xq.d[r0 * (K / 256) + b]));  // d dx, dmin dx
      acc = _mm_fmadd_ss(s, im, acc);
      acc = _mm_fnmadd_ss(_mm_movehdup_ps(s), _mm_movehdup_ps(im), acc);
    } else {
      const __m128 dx = row_scales<MR>(xq, K, r0, b);
      acc = _mm_fmadd_ps(_mm_mul_ps(_mm_shuffle_ps(dd, dd, 0x00), dx), _mm_cvtepi32_ps(hsum_rows<MR>(isum)), acc);
      acc = _mm_fnmadd_ps(_mm_mul_ps(_mm_shuffle_ps(dd, dd, 0x55), dx), _mm_cvtepi32_ps(hsum_rows128<MR>(msum)), acc);
    }
  }
  store_rows<MR>(acc, bias, y, r0, N, col);
}

// The same for a Q6_K channel.
template <int MR>
void q6k_rows(const QuantizedX& xq, int64_t K, int64_t r0, const uint8_t* row, const float* bias, float* y,
              int64_t N, int64_t col) {
  __m128 acc = _mm_setzero_ps();
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* p = row + b * 210;
    __m256i isum[MR];
    q6k_block<MR>(xq, K, r0, b, p, isum);
    const __m128 dx = row_scales<MR>(xq, K, r0, b);
    acc = _mm_fmadd_ps(_mm_mul_ps(_mm_set1_ps(f16_at(p + 208)), dx), _mm_cvtepi32_ps(hsum_rows<MR>(isum)), acc);
  }
  store_rows<MR>(acc, bias, y, r0, N, col);
}

// ---- one row against 8 channels: the integer sums of 8 channels reduced together ------
// A single row (a one-stream decode step) spends most of q4k_rows<1> / q6k_rows<1>'s time
// after each block's products: a horizontal sum, a conversion and the float chain, per
// channel and block, each waiting on the last. Here 8 channels run one after another
// (each row of blocks read in order, one stream for the prefetchers), every block's 8
// int32 partial sums (and Q4_K's minimums' pairs, the scale bytes) kept in L1; then per
// block the 8 channels' sums are reduced together, lanes = channels, and the float32
// operations run in the lanes: per lane the very operations of q4k_rows<1> / q6k_rows<1>
// in the same order (the same integers I_b and M_b, d dx then dmin dx rounded as there),
// so the same bits (tests compare every step size with one row alone). Blocks go
// kRow8Blocks at a time (the sums of longer rows would leave L1), the sums carried.
// Zen 3, AVX2, the 1B file's weights in cache, two threads: Q4_K 8192 x 2048 35 -> 54
// GMAC/s, Q6_K 2048 x 8192 23 -> 50; from memory (its 64 layer products of a step) 3-5 %
// faster; its one-stream decode step (in-process A/B) 48.5 -> 45.5 ms, median.
constexpr int64_t kRow8Blocks = 32;
// Steps of fewer rows than this take k_row8 (more take the panels or the VNNI kernels).
constexpr int64_t kRow8MaxRows = 8;

// MR rows (a decode step of a few sequences, an expert's few tokens) run the same way: each
// block of each channel decoded once against the MR rows (q4k_block<MR>), every row's sums
// kept, then reduced per row with the lanes' operations of one row: each row's bits are
// those of one row alone. Measured (Zen 4, two threads, 200 expert-sized weights from
// memory, against the per-channel q4k_rows<MR> / q6k_rows<MR>): Q4_K 1024 x 2048 2 rows 96 ->
// 73 us a weight, 3 rows 140 -> 104 (4 rows slower: 102 -> 128, so not taken there); Q6_K
// 2048 x 512 2 rows 60 -> 53, 3 rows 82 -> 58, 4 rows 79 -> 66; one row 55 / 45 us.
// V (AVX-512 VNNI machines): vpdpwssd for each madd + add (A/B in one process, 100 MB of
// weights: Q4_K 8192 x 2048 2 rows 728 -> 670 us, 3 rows 1042 -> 969; Q6_K 2048 x 512 3
// rows 98 -> 85).
template <int MR>
struct Row8Sums {
  static constexpr int64_t kBlocks = kRow8Blocks / MR;
  alignas(32) int32_t is[kBlocks][MR][8][8];  // [block][row][channel][lane]
  alignas(32) int32_t ms[kBlocks][MR][8][4];  // Q4_K: [block][row][channel] the minimums' pairs
  alignas(32) uint32_t dd[kBlocks][8];        // [block][channel]: d (and Q4_K's dmin) as stored
};

// Lane c: the sum of the 8 int32 lanes of v[c] (8 channels' partial sums -> one vector).
inline __m256i reduce8x8(const int32_t (*v)[8]) {
  auto L = [&](int c) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(v[c])); };
  const __m256i t0 = _mm256_hadd_epi32(L(0), L(1)), t1 = _mm256_hadd_epi32(L(2), L(3));
  const __m256i t2 = _mm256_hadd_epi32(L(4), L(5)), t3 = _mm256_hadd_epi32(L(6), L(7));
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// The same for 8 channels' 4 lanes.
inline __m256i reduce8x4(const int32_t (*v)[4]) {
  auto L = [&](int c) { return _mm_load_si128(reinterpret_cast<const __m128i*>(v[c])); };
  const __m128i m0 = _mm_hadd_epi32(_mm_hadd_epi32(L(0), L(1)), _mm_hadd_epi32(L(2), L(3)));
  const __m128i m1 = _mm_hadd_epi32(_mm_hadd_epi32(L(4), L(5)), _mm_hadd_epi32(L(6), L(7)));
  return _mm256_set_m128i(m1, m0);
}

// y[(r0 + r) * N + col + c] for channels c < 8 (rows row0 + c * rb) of a Q4_K (Q4) or Q6_K
// part, rows r0 .. r0 + MR - 1 of x.
template <bool Q4, int MR, bool V>
void k_row8(const QuantizedX& xq, int64_t K, int64_t r0, const uint8_t* row0, int64_t rb, const float* bias,
            float* y, int64_t N, int64_t col) {
  constexpr int64_t bytes = Q4 ? 144 : 210, chunk = Row8Sums<MR>::kBlocks;
  const int64_t nb = K / 256;
  Row8Sums<MR> s;
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += chunk) {
    const int64_t b1 = std::min(nb, b0 + chunk);
    for (int ch = 0; ch < 8; ++ch) {
      const uint8_t* row = row0 + ch * rb;
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* p = row + b * bytes;
        if constexpr (MR >= 2) {
          // The block 4 channels on (past channel 3, the thread's next tile): with two or
          // more rows the products take about as long as the block's bytes from memory,
          // and the hardware prefetchers did not run far enough ahead to overlap the two.
          // Measured (Zen 4, 100 MB of weights, A/B in one process): Q4_K 8192 x 2048 3 rows
          // 898 -> 727 us, 2 rows 709 -> 627; one row slower with it (not taken there).
          const char* ahead = reinterpret_cast<const char*>(p + 4 * rb);
          _mm_prefetch(ahead, _MM_HINT_T0);
          _mm_prefetch(ahead + 64, _MM_HINT_T0);
          _mm_prefetch(ahead + bytes - 1, _MM_HINT_T0);
        }
        __m256i isum[MR];
        if constexpr (Q4) {
          __m128i msum[MR];
          q4k_block<MR, V>(xq, K, r0, b, p, isum, msum);
          for (int r = 0; r < MR; ++r) _mm_store_si128(reinterpret_cast<__m128i*>(s.ms[b - b0][r][ch]), msum[r]);
          std::memcpy(&s.dd[b - b0][ch], p, 4);
        } else {
          q6k_block<MR, V>(xq, K, r0, b, p, isum);
          uint16_t d16;
          std::memcpy(&d16, p + 208, 2);
          s.dd[b - b0][ch] = d16;
        }
        for (int r = 0; r < MR; ++r) _mm256_store_si256(reinterpret_cast<__m256i*>(s.is[b - b0][r][ch]), isum[r]);
      }
    }
    // The 8 channels' fp16 d (and dmin: the upper halves) as 8 lanes each.
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    for (int64_t b = b0; b < b1; ++b) {
      const __m256i g = _mm256_shuffle_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(s.dd[b - b0])), pick);
      const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(g, 0x08)));
      const __m256 dmin = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(g, 0x0D)));
      for (int r = 0; r < MR; ++r) {
        const __m256 dx = _mm256_set1_ps(xq.d[(r0 + r) * nb + b]);
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(reduce8x8(s.is[b - b0][r])), acc[r]);
        if constexpr (Q4)
          acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(reduce8x4(s.ms[b - b0][r])), acc[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    alignas(32) float v[8];
    _mm256_store_ps(v, acc[r]);
    for (int c = 0; c < 8; ++c) y[(r0 + r) * N + col + c] = bias ? v[c] + bias[col + c] : v[c];
  }
}

bool has_k_kernel(int type) { return type == kQ4_K || type == kQ6_K; }

// Which kernels a call's parts need: K-quant ones (x quantized in groups of 256; `rows`:
// some part in the file's layout, whose kernels may want x's rows laid out for them), the
// others (x in groups of 32; `x32`: the repacked 32-weight types, `min`: some of them Q4_1,
// `other`: the rest).
struct PartKinds {
  bool k = false, rows = false, other = false, x32 = false, min = false;
  bool groups32() const { return other || x32; }
};
PartKinds part_kinds(const std::vector<Part>& parts);

// Asks for rows [n0, n1) of w (clipped to its rows) to be on their way into the cache:
// the next tile's weights arrive while this one computes.
inline void prefetch_rows(const Part& w, int64_t n0, int64_t n1) {
  n1 = std::min(n1, w.rows);
  if (n0 >= n1) return;
  const char* p = reinterpret_cast<const char*>(w.data + n0 * w.row_bytes);
  const int64_t bytes = (n1 - n0) * w.row_bytes;
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

// Channels [n0, n1) of a Q4_K or Q6_K part for rows [m0, m1): one row against 8 channels
// at a time (k_row8), otherwise each channel against four rows at a time, then the rest;
// channels left over one at a time.
void k_tile(const QuantizedX& xq, int64_t m0, int64_t m1, int64_t K, const Part& w, int64_t n0, int64_t n1,
            const float* bias, float* y, int64_t N) {
  int64_t n = n0;
  // A few rows: 8 channels at a time, up to 4 rows a pass (the same bits); Q4_K at 4 and 5
  // rows each channel against four rows (measured faster there: 107 against 117 us a weight
  // at 4, 137 against 157 at 5; at 6 and 7 rows the 8-channel passes win, 171 / 178 against
  // 191 / 212).
  const int64_t M = m1 - m0;
  const bool vnni = xq.avx512;
  if (M < kRow8MaxRows && (w.type == kQ6_K || M <= 3 || M >= 6))
    for (; n + 8 <= n1; n += 8) {
      const uint8_t* row0 = w.data + n * w.row_bytes;
      auto run = [&](auto mr, int64_t r) {
        auto call = [&](auto q4, auto v) {
          k_row8<decltype(q4)::value, decltype(mr)::value, decltype(v)::value>(xq, K, r, row0, w.row_bytes, bias, y,
                                                                                N, w.col + n);
        };
        auto with_v = [&](auto q4) { vnni ? call(q4, std::true_type{}) : call(q4, std::false_type{}); };
        w.type == kQ4_K ? with_v(std::true_type{}) : with_v(std::false_type{});
      };
      int64_t r = m0;
      for (; r + 4 <= m1; r += 4) run(std::integral_constant<int, 4>{}, r);
      if (m1 - r == 3) run(std::integral_constant<int, 3>{}, r);
      if (m1 - r == 2) run(std::integral_constant<int, 2>{}, r);
      if (m1 - r == 1) run(std::integral_constant<int, 1>{}, r);
    }
  for (; n < n1; ++n) {
    const uint8_t* row = w.data + n * w.row_bytes;
    const int64_t col = w.col + n;
    auto run = [&](auto mr, int64_t r) {
      constexpr int MR = decltype(mr)::value;
      if (w.type == kQ4_K)
        q4k_rows<MR>(xq, K, r, row, bias, y, N, col);
      else
        q6k_rows<MR>(xq, K, r, row, bias, y, N, col);
    };
    int64_t r = m0;
    for (; r + 4 <= m1; r += 4) run(std::integral_constant<int, 4>{}, r);
    for (; r + 2 <= m1; r += 2) run(std::integral_constant<int, 2>{}, r);
    if (r < m1) run(std::integral_constant<int, 1>{}, r);
  }
}

// ---- the K-quant products on AVX2 for steps of many rows: panels of 8 channels ------
// For steps of 8-16 rows or more on CPUs without AVX-512 VNNI (prompts, decode batches).
// k_tile runs one channel at a time, so every row's x is read once per channel and every
// block ends in horizontal sums. Here a panel of kPanel channels is decoded once into
// L1/L2 with the channels in the lanes: per group of 4 inputs ("quad"), one 32-byte
// vector holds the 4 values of each of the 8 channels, so one broadcast of a row's 4 int8
// inputs and one maddubs make 32 products, 8 channels at a time, and a block's sums stay
// in the lanes (no horizontal sum). A sub-block's maddubs results add up in int16, then
// madd with the sub-block's scale (both int16 lanes of a channel hold it) widens them to
// int32. Q4_K: the values 0-15 against x, 8 quads a sub-block (|sum| <= 8 x 2 x 15 x 127
// < 2^15), the minimums' term from x's sums per 32 as in q4k_rows. Q6_K: the signed
// values q - 32 against x + 128 (unsigned bytes, unsigned_rows), two quads at a time in
// int16 (|sum| <= 2 x 2 x 255 x 32 < 2^15); the block's sum then exceeds I_b by
// 128 sum_j sc_j (the channel's sum of values in sub-block j), a per-channel integer
// that decode_panel works out and the sums start from, negated. The same integers I_b
// and M_b and the same float32 operations in the same order: the same bits as the
// one-channel and the VNNI kernels (tests compare them). 2.0x k_tile's products per
// second on Q4_K at 64 rows, 1.5x on Q6_K (one Zen 3 core). Q6_K with x's signs moved
// onto |q - 32| (one more instruction per product) was 1.18-1.26x slower at 16-128 rows.

// From these many rows a step takes the panels (Q4_K, Q6_K): below, decoding a panel
// costs more than it saves (measured, one thread, 1B shapes: Q4_K even at 8 rows and
// 1.2-1.6x at 16, 2.0-2.1x at 64; Q6_K, since it multiplies x + 128, even at 4-7 rows,
// 1.15x at 8, 1.5x at 15, two threads, weights from memory).
constexpr int64_t kPanelRows = 8;
inline bool panel_rows(int64_t rows) { return rows >= kPanelRows; }
constexpr int kPanel = 8;

// One thread's decoded panel of kPanel channels over all blocks of K.
struct K2Panel {
  std::vector<__m256i> q;       // [nb][64]: quad g of the block, channel c's values in bytes 4c .. 4c + 3
  std::vector<__m256i> sc;      // [nb][nsub]: int16 lanes 2c and 2c + 1 = channel c's scale of sub-block j
  std::vector<__m256i> pair;    // Q4_K, [nb][4]: int32 lane c = channel c's minimums (m_2p, m_2p+1) as int16
  std::vector<__m256i> corr;    // Q6_K, [nb]: int32 lane c = -128 sum_j sc_j (sum of channel c's values in sub-block j)
  std::vector<__m256> d, dmin;  // [nb]: lane c = channel c's d (and Q4_K's dmin)
};

// The 8 x 8 int32 transpose of v (v[i] lane j -> v[j] lane i).
inline void transpose8x8_epi32(__m256i* v) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4)
    for (int k = 0; k < 2; ++k) {
      u[i + k] = _mm256_unpacklo_epi64(t[i + k], t[i + k + 2]);
      u[i + k + 2] = _mm256_unpackhi_epi64(t[i + k], t[i + k + 2]);
    }
  // u[0]: lanes (0,0)(1,0)(2,0)(3,0) | (0,4)(1,4)(2,4)(3,4), u[4] the same for rows 4-7; u[2]: column 1
  // and 5, u[1]: column 2 and 6, u[3]: column 3 and 7.
  const int col[4] = {0, 2, 1, 3};
  for (int k = 0; k < 4; ++k) {
    v[col[k]] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x20);
    v[col[k] + 4] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x31);
  }
}

// r[c] (16 bytes of channel c, c < 8) transposed: v[i]'s low 8 bytes are byte 2i of every
// channel, its high 8 bytes byte 2i + 1.
inline void transpose8x16_epi8(const __m128i* r, __m128i* v) {
  __m128i t[8], u[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm_unpacklo_epi8(r[2 * k], r[2 * k + 1]);      // bytes 0-7 of channels 2k, 2k + 1
    t[2 * k + 1] = _mm_unpackhi_epi8(r[2 * k], r[2 * k + 1]);  // bytes 8-15
  }
  for (int h = 0; h < 2; ++h) {
    u[4 * h] = _mm_unpacklo_epi16(t[h], t[h + 2]);          // bytes 8h + 0-3 of channels 0-3
    u[4 * h + 1] = _mm_unpackhi_epi16(t[h], t[h + 2]);      // bytes 8h + 4-7 of channels 0-3
    u[4 * h + 2] = _mm_unpacklo_epi16(t[h + 4], t[h + 6]);  // the same of channels 4-7
    u[4 * h + 3] = _mm_unpackhi_epi16(t[h + 4], t[h + 6]);
    v[4 * h] = _mm_unpacklo_epi32(u[4 * h], u[4 * h + 2]);
    v[4 * h + 1] = _mm_unpackhi_epi32(u[4 * h], u[4 * h + 2]);
    v[4 * h + 2] = _mm_unpacklo_epi32(u[4 * h + 1], u[4 * h + 3]);
    v[4 * h + 3] = _mm_unpackhi_epi32(u[4 * h + 1], u[4 * h + 3]);
  }
}

// 8 bytes (one per channel; signed or not) as int32 lanes holding the value in both int16
// halves, or two such byte groups lo, hi as (lo, hi) int16 pairs.
template <bool Signed>
inline __m256i widen8(__m128i b) {
  return Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
}
template <bool Signed>
inline __m256i both_halves(__m128i b) {
  const __m256i e = widen8<Signed>(b);
  return _mm256_or_si256(_mm256_and_si256(e, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(e, 16));
}

// Channels n .. n + 7 of a Q4_K or Q6_K part into the panel, straight from the blocks: per
// 32 weights of a sub-block, the 8 channels' values (Q6_K: q - 32) transposed to quads;
// the 16 scale bytes of the 8 channels transposed once a block.
// The next panel's blocks (channels n + 8 .. n + 15) are asked for block by block as this
// one is decoded, towards L2: short rows are short streams, which the hardware prefetchers
// barely pick up, and all of a panel's lines asked for at once stalled on the misses the
// core can track (decoding 16-row steps of the 1B file's layers from memory 1.09x faster,
// 128-row 1.02x, than that burst before each panel).
template <bool Q4>
void decode_panel(const Part& w, int64_t n, int64_t K, K2Panel& pn) {
  constexpr int64_t bytes = Q4 ? 144 : 210;
  constexpr int nsub = Q4 ? 8 : 16;
  const int64_t nb = K / 256;
  pn.q.resize(nb * 64);
  pn.sc.resize(nb * nsub);
  pn.pair.resize(Q4 ? nb * 4 : 0);
  pn.corr.resize(Q4 ? 0 : nb);
  pn.d.resize(nb);
  pn.dmin.resize(nb);
  alignas(32) float d[kPanel], dmin[kPanel] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p[kPanel];
    for (int c = 0; c < kPanel; ++c) p[c] = w.data + (n + c) * w.row_bytes + b * bytes;
    for (int c = 0; c < kPanel && n + kPanel + c < w.rows; ++c) {
      const char* next = reinterpret_cast<const char*>(p[c] + kPanel * w.row_bytes);
      for (int o = 0; o < bytes; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
    }
    __m256i* q = pn.q.data() + b * 64;
    __m128i r[kPanel], v[8];
    if constexpr (Q4) {
      for (int h = 0; h < 4; ++h) {  // weights 64h .. + 31 (low nibbles), 64h + 32 .. + 63 (high)
        // The packed bytes transposed once, then split: t[k] lane c holds bytes 4k .. 4k + 3
        // of channel c, whose low nibbles are weights 64h + 4k .. + 3, high ones + 32.
        __m256i t[kPanel];
        for (int c = 0; c < kPanel; ++c) t[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[c] + 16 + 32 * h));
        transpose8x8_epi32(t);
        for (int k = 0; k < 8; ++k) {
          q[16 * h + k] = nibbles_lo(t[k]);
          q[16 * h + 8 + k] = nibbles_hi(t[k]);
        }
      }
      for (int c = 0; c < kPanel; ++c) {
        r[c] = k4_scales_mins(p[c] + 4);  // scales in bytes 0-7, minimums 8-15
        d[c] = f16_at(p[c]);
        dmin[c] = f16_at(p[c] + 2);
      }
      transpose8x16_epi8(r, v);
      for (int j = 0; j < 8; ++j)
        pn.sc[b * 8 + j] = both_halves<false>(j & 1 ? _mm_srli_si128(v[j / 2], 8) : v[j / 2]);
      for (int pr = 0; pr < 4; ++pr)  // the minimums 2pr, 2pr + 1 as int16 pairs
        pn.pair[b * 4 + pr] = _mm256_or_si256(widen8<false>(v[4 + pr]),
                                              _mm256_slli_epi32(widen8<false>(_mm_srli_si128(v[4 + pr], 8)), 16));
    } else {
      for (int half = 0; half < 2; ++half)
        for (int s = 0; s < 4; ++s) {  // weights 128 half + 32s .. + 31
          __m256i x[kPanel];
          for (int c = 0; c < kPanel; ++c) {
            const uint8_t* ph = p[c] + 64 * half;
            const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ph));
            const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ph + 32));
            const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[c] + 128 + 32 * half));
            x[c] = _mm256_sub_epi8(q6k_values(l0, l1, hb, s), _mm256_set1_epi8(32));
          }
          transpose8x8_epi32(x);
          for (int k = 0; k < 8; ++k) q[32 * half + 8 * s + k] = x[k];
        }
      for (int c = 0; c < kPanel; ++c) {
        r[c] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[c] + 192));
        d[c] = f16_at(p[c] + 208);
      }
      transpose8x16_epi8(r, v);
      // The rows multiply x + 128 (unsigned) by the values: per channel the block's sum is
      // sum_j sc_j sum_i (x_i + 128) q_i, which is I_b + 128 sum_j sc_j (sum_i q_i); corr
      // takes the second term off again (exact in int32).
      const __m256i ones = _mm256_set1_epi8(1);
      __m256i t = _mm256_setzero_si256();
      for (int j = 0; j < 16; ++j) {
        pn.sc[b * 16 + j] = both_halves<true>(j & 1 ? _mm_srli_si128(v[j / 2], 8) : v[j / 2]);
        const __m256i* g = q + 4 * j;  // |a quad's pair sums| <= 64, four of them <= 256
        const __m256i s = _mm256_add_epi16(
            _mm256_add_epi16(_mm256_maddubs_epi16(ones, g[0]), _mm256_maddubs_epi16(ones, g[1])),
            _mm256_add_epi16(_mm256_maddubs_epi16(ones, g[2]), _mm256_maddubs_epi16(ones, g[3])));
        t = _mm256_add_epi32(t, _mm256_madd_epi16(s, pn.sc[b * 16 + j]));
      }
      pn.corr[b] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(t, 7));
    }
    pn.d[b] = _mm256_load_ps(d);
    pn.dmin[b] = _mm256_load_ps(dmin);
  }
}

inline __m256i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// out[r * 8 + c] for rows r0 .. r0 + MR - 1 and the panel's 8 channels.
template <bool Q4, int MR>
__attribute__((noinline)) void k_panel_rows(const QuantizedX& xq, int64_t K, int64_t r0, const K2Panel& pn,
                                            float* out) {
  constexpr int nsub = Q4 ? 8 : 16;
  constexpr int run = 64 / nsub;  // a sub-block's quads, whose maddubs results add up in int16
  const int64_t nb = K / 256;
  const int8_t* x[MR];
  const int16_t* h[MR];  // Q4_K: x's sums per 32
  for (int r = 0; r < MR; ++r) {
    x[r] = Q4 ? xq.q.data() + (r0 + r) * K : reinterpret_cast<const int8_t*>(xq.u.data()) + (r0 + r) * K;
    h[r] = xq.h32.data() + (r0 + r) * (K / 32);
  }
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i* qb = pn.q.data() + b * 64;
    __m256i isum[MR];
    for (int r = 0; r < MR; ++r) isum[r] = Q4 ? _mm256_setzero_si256() : pn.corr[b];
    if constexpr (Q4) {
      for (int j = 0; j < nsub; ++j) {
        __m256i s[MR];
        for (int r = 0; r < MR; ++r) s[r] = _mm256_setzero_si256();
        for (int k = 0; k < run; ++k) {
          const int g = j * run + k;
          const __m256i wv = _mm256_load_si256(qb + g);
          for (int r = 0; r < MR; ++r) {
            s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(wv, bcast4(x[r] + b * 256 + 4 * g)));
            // Keeps the sum in its register, added as it goes: left alone, the compiler
            // makes a tree of all the quads' products and spills them (1.4x slower).
            __asm__("" : "+x"(s[r]));
          }
        }
        const __m256i sc = pn.sc[b * nsub + j];
        for (int r = 0; r < MR; ++r) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(s[r], sc));
      }
    } else {
      // x + 128 (unsigned) times the signed values, two quads' pair sums added in int16
      // (|sum| <= 2 x 2 x 255 x 32 < 2^15), then widened with the scale.
      for (int j = 0; j < nsub; ++j) {
        const __m256i sc = pn.sc[b * nsub + j];
        for (int k = 0; k < run; k += 2) {
          const int g = j * run + k;
          const __m256i w0 = _mm256_load_si256(qb + g), w1 = _mm256_load_si256(qb + g + 1);
          for (int r = 0; r < MR; ++r) {
            const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(bcast4(x[r] + b * 256 + 4 * g), w0),
                                               _mm256_maddubs_epi16(bcast4(x[r] + b * 256 + 4 * g + 4), w1));
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(s, sc));
          }
        }
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m256 dx = _mm256_set1_ps(xq.d[(r0 + r) * nb + b]);
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(pn.d[b], dx), _mm256_cvtepi32_ps(isum[r]), acc[r]);
      if constexpr (Q4) {  // - dmin dx sum_j mn_j * (x's sum over sub-block j)
        __m256i t = _mm256_setzero_si256();
        for (int pr = 0; pr < 4; ++pr)
          t = _mm256_add_epi32(t, _mm256_madd_epi16(bcast4(h[r] + b * 8 + 2 * pr), pn.pair[b * 4 + pr]));
        acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(pn.dmin[b], dx), _mm256_cvtepi32_ps(t), acc[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// Channels [n0, n1) of a Q4_K or Q6_K part for rows [m0, m1): panels of kPanel channels,
// rows kPanelMR at a time (4 rows x 1 panel a call measured the same as 3 x 2, 2 x 3
// 0.8x), the channels left over one at a time (k_tile).
constexpr int kPanelMR = 4;

template <bool Q4>
void k_tile_panel_t(const QuantizedX& xq, int64_t m0, int64_t m1, int64_t K, const Part& w, int64_t n0, int64_t n1,
                    const float* bias, float* y, int64_t N, K2Panel& pn) {
  alignas(32) float out[kPanelMR * kPanel];
  int64_t n = n0;
  for (; n + kPanel <= n1; n += kPanel) {
    decode_panel<Q4>(w, n, K, pn);
    const int64_t col = w.col + n;
    auto rows = [&](auto mr, int64_t r) {
      constexpr int MR = decltype(mr)::value;
      k_panel_rows<Q4, MR>(xq, K, r, pn, out);
      for (int i = 0; i < MR; ++i)
        for (int c = 0; c < kPanel; ++c) {
          const float v = out[8 * i + c];
          y[(r + i) * N + col + c] = bias ? v + bias[col + c] : v;
        }
    };
    int64_t r = m0;
    for (; r + kPanelMR <= m1; r += kPanelMR) rows(std::integral_constant<int, kPanelMR>{}, r);
    for (; r + 2 <= m1; r += 2) rows(std::integral_constant<int, 2>{}, r);
    if (r < m1) rows(std::integral_constant<int, 1>{}, r);
  }
  if (n < n1) k_tile(xq, m0, m1, K, w, n, n1, bias, y, N);
}

void k_tile_panel(const QuantizedX& xq, int64_t m0, int64_t m1, int64_t K, const Part& w, int64_t n0, int64_t n1,
                  const float* bias, float* y, int64_t N, K2Panel& pn) {
  if (w.type == kQ4_K)
    k_tile_panel_t<true>(xq, m0, m1, K, w, n0, n1, bias, y, N, pn);
  else
    k_tile_panel_t<false>(xq, m0, m1, K, w, n0, n1, bias, y, N, pn);
}

// ---- the K-quant products on AVX-512 VNNI: 16 rows of x in the lanes ----------------
// For steps of kVnniRows rows or more on CPUs with AVX-512 VNNI (prompts, large decode
// batches). A panel of kVnniChannels output channels is decoded once into L1 (the
// 4/6-bit values as bytes, the sub-block scales as int32) and every group of 16 rows
// runs over it: per channel, vpdpbusd adds the four products of a broadcast 4-byte group
// of the (unsigned) weights with 16 rows' 4-byte groups of x; the sub-block's sums take
// its scale (vpmulld), the minimums' and Q6_K's -32 terms come from x's sums per
// sub-block (vpdpwssd). x is packed once per call (pack_rows16), not the weights.
// Same integers, same float32 operations as q4k_rows / q6k_rows: the same bits.

constexpr int64_t kVnniRows = 8;
constexpr int kVnniChannels = 8;

struct alignas(64) Q4KDecoded {
  uint8_t q[256];
  int32_t sc[8];
  int32_t pair[4];  // the minimums as int16 pairs (mn[2p], mn[2p + 1])
  float d, dmin;
};

struct alignas(64) Q6KDecoded {
  uint8_t q[256];  // stored value: q + 32, 0 .. 63
  int32_t sc[16];
  int32_t pair[8];  // the scales as int16 pairs (sc[2p], sc[2p + 1])
  float d;
};

PAGODA_AVX512 inline void decode_vnni(const uint8_t* p, Q4KDecoded& o) {
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + 32 * c));
    _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + 64 * c), nibbles_lo(v));
    _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + 64 * c + 32), nibbles_hi(v));
  }
  const __m128i sm = k4_scales_mins(p + 4);
  _mm256_store_si256(reinterpret_cast<__m256i*>(o.sc), _mm256_cvtepu8_epi32(sm));
  _mm_store_si128(reinterpret_cast<__m128i*>(o.pair), _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8)));
  o.d = f16_at(p);
  o.dmin = f16_at(p + 2);
}

PAGODA_AVX512 inline void decode_vnni(const uint8_t* p, Q6KDecoded& o) {
  for (int half = 0; half < 2; ++half) {
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * half));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * half + 32));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * half));
    for (int c = 0; c < 4; ++c)
      _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + 128 * half + 32 * c), q6k_values(l0, l1, h, c));
  }
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
  _mm512_store_si512(o.sc, _mm512_cvtepi8_epi32(sc));
  _mm256_store_si256(reinterpret_cast<__m256i*>(o.pair), _mm256_cvtepi8_epi16(sc));
  o.d = f16_at(p + 208);
}

PAGODA_AVX512 inline __m512i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// out[c][l] for NC channels (dec: [K / 256][NC]) and the 16 rows of group g. Q4_K: 8
// sub-blocks of 32 (8 groups of 4 inputs), minimums against x's sums per 32 (h32); Q6_K:
// 16 sub-blocks of 16, its -32 against x's sums per 16 (h16).
template <typename Dec, int NC>
PAGODA_AVX512 __attribute__((noinline)) void k_vnni(const QuantizedX& xq, int64_t K, int64_t g, const Dec* dec,
                                                      float* out) {
  constexpr bool q4 = std::is_same_v<Dec, Q4KDecoded>;
  constexpr int nsub = q4 ? 8 : 16, quads = 64 / nsub, pairs = nsub / 2;
  const int64_t nb = K / 256;
  const int32_t* xg = xq.p4.data() + g * (K / 4) * 16;
  const int32_t* hg = (q4 ? xq.p32.data() : xq.p16.data()) + g * nb * pairs * 16;
  const float* dg = xq.pd.data() + g * nb * 16;
  __m512 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Dec* db = dec + b * NC;
    __m512i isum[NC];
    for (int c = 0; c < NC; ++c) isum[c] = _mm512_setzero_si512();
    for (int j = 0; j < nsub; ++j) {
      __m512i s[NC];
      for (int c = 0; c < NC; ++c) s[c] = _mm512_setzero_si512();
      for (int k = 0; k < quads; ++k) {
        const __m512i xv = _mm512_loadu_si512(xg + (b * 64 + j * quads + k) * 16);
        for (int c = 0; c < NC; ++c) s[c] = _mm512_dpbusd_epi32(s[c], bcast32(db[c].q + 4 * (j * quads + k)), xv);
      }
      for (int c = 0; c < NC; ++c) isum[c] = _mm512_add_epi32(isum[c], _mm512_mullo_epi32(s[c], _mm512_set1_epi32(db[c].sc[j])));
    }
    // Q4_K: sum_j mn_j * (x's sum over sub-block j); Q6_K: sum_j sc_j * (the same).
    __m512i t[NC];
    for (int c = 0; c < NC; ++c) t[c] = _mm512_setzero_si512();
    for (int pr = 0; pr < pairs; ++pr) {
      const __m512i hv = _mm512_loadu_si512(hg + (b * pairs + pr) * 16);
      for (int c = 0; c < NC; ++c) t[c] = _mm512_dpwssd_epi32(t[c], hv, _mm512_set1_epi32(db[c].pair[pr]));
    }
    const __m512 dx = _mm512_loadu_ps(dg + b * 16);
    for (int c = 0; c < NC; ++c) {
      if constexpr (q4) {
        acc[c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(db[c].d), dx), _mm512_cvtepi32_ps(isum[c]), acc[c]);
        acc[c] = _mm512_fnmadd_ps(_mm512_mul_ps(_mm512_set1_ps(db[c].dmin), dx), _mm512_cvtepi32_ps(t[c]), acc[c]);
      } else {
        isum[c] = _mm512_sub_epi32(isum[c], _mm512_slli_epi32(t[c], 5));
        acc[c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(db[c].d), dx), _mm512_cvtepi32_ps(isum[c]), acc[c]);
      }
    }
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + 16 * c, acc[c]);
}

// Scratch of one thread for the VNNI kernels' decoded panels.
struct VnniPanel {
  std::vector<Q4KDecoded> q4k;
  std::vector<Q6KDecoded> q6k;
};

// Channels [n0, n1) of a Q4_K or Q6_K part for rows [m0, m1) (m0 a multiple of 16; x
// packed by pack_rows16): panels of kVnniChannels channels, then one at a time.
template <typename Dec>
PAGODA_AVX512 void k_tile_vnni_t(const QuantizedX& xq, int64_t m0, int64_t m1, int64_t K, const Part& w,
                                   int64_t n0, int64_t n1, const float* bias, float* y, int64_t N,
                                   std::vector<Dec>& panel) {
  constexpr int64_t bytes = std::is_same_v<Dec, Q4KDecoded> ? 144 : 210;
  const int64_t nb = K / 256;
  alignas(64) float out[kVnniChannels * 16];
  auto run = [&](auto ncc, int64_t n) {
    constexpr int NC = decltype(ncc)::value;
    panel.resize(nb * NC);
    for (int c = 0; c < NC; ++c) {
      const uint8_t* row = w.data + (n + c) * w.row_bytes;
      for (int64_t b = 0; b < nb; ++b) decode_vnni(row + b * bytes, panel[b * NC + c]);
    }
    // The next panel's rows on their way to L2 while this one computes: the hardware
    // prefetchers stop at the panel, and a step of a few groups of 16 rows spends about as
    // long decoding a panel from memory as multiplying it (A/B, Zen 4, 100 MB of weights:
    // Q4_K 8192 x 2048 16 rows 1457 -> 1300 us, Q6_K 2048 x 512 136 -> 112).
    prefetch_rows(w, n + NC, n + 2 * NC);
    for (int64_t g = m0 / 16; g * 16 < m1; ++g) {
      k_vnni<Dec, NC>(xq, K, g, panel.data(), out);
      const int64_t r1 = std::min(m1, (g + 1) * 16);
      if constexpr (NC == 8) {
        // A row's 8 channels in one store: y's rows are far apart (often past L2), and
        // 128 scalar stores to 16 missing lines held up the kernel (9 % of a prompt step).
        const __m256i lanes = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
        const int64_t col = w.col + n;
        const __m256 bv = bias ? _mm256_loadu_ps(bias + col) : _mm256_setzero_ps();
        for (int64_t r = g * 16; r < r1; ++r) {
          __m256 v = _mm256_i32gather_ps(out + (r - g * 16), lanes, 4);
          if (bias) v = _mm256_add_ps(v, bv);
          _mm256_storeu_ps(y + r * N + col, v);
        }
      } else {
        for (int c = 0; c < NC; ++c) {
          const int64_t col = w.col + n + c;
          for (int64_t r = g * 16; r < r1; ++r) {
            const float v = out[16 * c + (r - g * 16)];
            y[r * N + col] = bias ? v + bias[col] : v;
          }
        }
      }
    }
  };
  int64_t n = n0;
  for (; n + kVnniChannels <= n1; n += kVnniChannels) run(std::integral_constant<int, kVnniChannels>{}, n);
  for (; n < n1; ++n) run(std::integral_constant<int, 1>{}, n);
}

void k_tile_vnni(const QuantizedX& xq, int64_t m0, int64_t m1, int64_t K, const Part& w, int64_t n0, int64_t n1,
                 const float* bias, float* y, int64_t N, VnniPanel& panel) {
  TORCH_CHECK(m0 % 16 == 0, "VNNI rows start at a multiple of 16");
  if (w.type == kQ4_K)
    k_tile_vnni_t(xq, m0, m1, K, w, n0, n1, bias, y, N, panel.q4k);
  else
    k_tile_vnni_t(xq, m0, m1, K, w, n0, n1, bias, y, N, panel.q6k);
}

// Whether a step of M rows takes the VNNI kernels for its K-quant parts.
bool vnni_k_rows(int64_t M) { return M >= kVnniRows && use_avx512(); }

// ---- Q4_K repacked: 16 channels in the lanes (kQ4KX16) ------------------------------
// A step of a few rows (an expert's 1-3 tokens, a few streams' decode) reads each weight
// once per step: the kernels above then spend as long decoding each block (scales and
// minimums unpacked, nibbles split, or a channel's sums reduced across lanes) as
// multiplying it. The gguf mode on AVX-512 VNNI CPUs repacks each Q4_K part whose
// channel count is a multiple of 16 once at load (gguf_repack_q4k_x16) so that 16
// channels lie side by side in the vector lanes; a block of 256 inputs of 16 channels
// (the 16 Q4_K blocks' bytes rearranged: 2,368 bytes against 2,304) holds
//   [0, 32)      d of each channel (float16, as stored)
//   [32, 64)     dmin of each channel
//   [64, 192)    sub-block scales, [sub-block j][channel] (6 bits in a byte)
//   [192, 320)   sub-block minimums in pairs, [pair i][channel][2] (mn_2i, mn_2i+1)
//   [320, 2368)  the nibbles, [sub-block j][quad q][channel][4 bytes]: byte i of a
//                channel's 4 holds weight 32j + 8q + i in its low nibble and weight
//                32j + 8q + 4 + i in its high one.
// Part.rows / row_bytes count channels as for any type (148 bytes a channel per block);
// group g's blocks start at data + 16 g row_bytes. The kernel (x16_rows) takes one
// vector of nibbles for 128 weights of 16 channels and, per row, two vpdpbusd against
// broadcast int32 of x (4 inputs each): no decoding besides the nibble masks, nothing
// reduced across lanes. The integers (I_b, M_b) and the float32 operations per channel
// are those of q4k_rows: the same bits as the Q4_K kernels for every row.

constexpr int64_t kX16Bytes = 2368;
constexpr int kX16Scales = 64, kX16Mins = 192, kX16Nibbles = 320;

// Channel c's scale and minimum of sub-block j of a Q4_K block's 12 packed bytes s
// (ggml's get_scale_min_k4).
inline void k4_scale_min(const uint8_t* s, int j, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
    *mn = static_cast<uint8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// Weight w (0-255) of a Q4_K block's nibbles qs: 64-weight chunks, low nibbles first.
inline uint8_t k4_nibble(const uint8_t* qs, int w) {
  const uint8_t byte = qs[32 * (w / 64) + w % 32];
  return (w % 64) < 32 ? byte & 0x0F : byte >> 4;
}

// 16 channels' Q4_K blocks (src[c]: 144 bytes each) -> one repacked block.
void x16_pack_block(const uint8_t* const* src, uint8_t* dst) {
  for (int c = 0; c < 16; ++c) {
    const uint8_t* p = src[c];
    std::memcpy(dst + 2 * c, p, 2);
    std::memcpy(dst + 32 + 2 * c, p + 2, 2);
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, mn;
      k4_scale_min(p + 4, j, &sc, &mn);
      dst[kX16Scales + 16 * j + c] = sc;
      dst[kX16Mins + 32 * (j / 2) + 2 * c + j % 2] = mn;
      for (int q = 0; q < 4; ++q)
        for (int i = 0; i < 4; ++i) {
          const int w = 32 * j + 8 * q + i;
          dst[kX16Nibbles + 256 * j + 64 * q + 4 * c + i] =
              static_cast<uint8_t>(k4_nibble(p + 16, w) | (k4_nibble(p + 16, w + 4) << 4));
        }
    }
  }
}

// Channel c of a repacked block -> its Q4_K block (144 bytes), byte for byte the original.
void x16_unpack_block(const uint8_t* src, int c, uint8_t* p) {
  std::memcpy(p, src + 2 * c, 2);
  std::memcpy(p + 2, src + 32 + 2 * c, 2);
  uint8_t sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = src[kX16Scales + 16 * j + c];
    mn[j] = src[kX16Mins + 32 * (j / 2) + 2 * c + j % 2];
  }
  uint8_t* s = p + 4;
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4));
  }
  uint8_t* qs = p + 16;
  std::memset(qs, 0, 128);
  for (int j = 0; j < 8; ++j)
    for (int q = 0; q < 4; ++q)
      for (int i = 0; i < 4; ++i) {
        const uint8_t b = src[kX16Nibbles + 256 * j + 64 * q + 4 * c + i];
        for (int half = 0; half < 2; ++half) {
          const int w = 32 * j + 8 * q + 4 * half + i;
          const uint8_t v = half ? b >> 4 : b & 0x0F;
          qs[32 * (w / 64) + w % 32] |= static_cast<uint8_t>((w % 64) < 32 ? v : v << 4);
        }
      }
}

// ---- Q5_K repacked the same way (kQ5KX16) --------------------------------------------
// A block of 256 inputs of 16 channels (2,880 bytes): Q4_K_X16's 2,368 bytes of the Q5_K
// blocks' d, dmin, scales, minimums and low nibbles (a Q5_K block's fields are Q4_K's plus
// its fifth bits), then [2368, 2880) the fifth bits: for sub-block j 64 bytes at 2368 + 64 j,
// byte 4c + i's bit 2q + h the fifth bit of weight 32j + 8q + 4h + i of channel c (the weight
// in nibble h of byte 4c + i of the nibbles' quad q). The kernels are Q4_K_X16's with the
// values' fifth bit ORed in (0 .. 31 for 0 .. 15): the same operations besides.
constexpr int64_t kX16Q5Bytes = 2880;
constexpr int kX16Q5High = 2368;

// The fifth bit of weight w (0-255) of a Q5_K block p (bit w / 32 of qh[w % 32]).
inline int q5k_high(const uint8_t* p, int w) { return (p[16 + w % 32] >> (w / 32)) & 1; }

// 16 channels' Q5_K blocks (src[c]: 176 bytes each) -> one repacked block.
void x16_pack_q5k_block(const uint8_t* const* src, uint8_t* dst) {
  uint8_t q4[16][144];
  const uint8_t* q4p[16];
  for (int c = 0; c < 16; ++c) {  // the Q4_K fields: d, dmin, scales; the low nibbles
    std::memcpy(q4[c], src[c], 16);
    std::memcpy(q4[c] + 16, src[c] + 48, 128);
    q4p[c] = q4[c];
  }
  x16_pack_block(q4p, dst);
  uint8_t* hb = dst + kX16Q5High;
  std::memset(hb, 0, 512);
  for (int c = 0; c < 16; ++c)
    for (int j = 0; j < 8; ++j)
      for (int q = 0; q < 4; ++q)
        for (int h = 0; h < 2; ++h)
          for (int i = 0; i < 4; ++i)
            hb[64 * j + 4 * c + i] |= static_cast<uint8_t>(q5k_high(src[c], 32 * j + 8 * q + 4 * h + i) << (2 * q + h));
}

// Channel c of a repacked block -> its Q5_K block (176 bytes), byte for byte the original.
void x16_unpack_q5k_block(const uint8_t* src, int c, uint8_t* p) {
  uint8_t q4[144];
  x16_unpack_block(src, c, q4);
  std::memcpy(p, q4, 16);
  std::memcpy(p + 48, q4 + 16, 128);
  uint8_t* qh = p + 16;
  std::memset(qh, 0, 32);
  for (int j = 0; j < 8; ++j)
    for (int q = 0; q < 4; ++q)
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 4; ++i) {
          const int w = 32 * j + 8 * q + 4 * h + i;
          if ((src[kX16Q5High + 64 * j + 4 * c + i] >> (2 * q + h)) & 1) qh[w % 32] |= static_cast<uint8_t>(1 << (w / 32));
        }
}

// Bit b (0-7) of every byte of v moved to bit `to`, the rest cleared (a 16-bit shift, then
// the mask drops what it carried in from the neighbouring byte).
PAGODA_AVX512 inline __m512i bit_to(__m512i v, int b, int to) {
  const __m512i moved = b <= to ? _mm512_slli_epi16(v, to - b) : _mm512_srli_epi16(v, b - to);
  return _mm512_and_si512(moved, _mm512_set1_epi8(static_cast<char>(1 << to)));
}
PAGODA_AVX512 inline __m512i bit_to_16(__m512i v, int b) { return bit_to(v, b, 4); }


// How far ahead of its reads x16_rows / x16_q6k_rows ask for the weights (bytes, spread
// over a block's sub-blocks): into L1 ~0.45 block ahead, into L2 4 KiB ahead. Streaming a
// ~300 MB repacked part (beyond the caches, as the experts of a 16-stream MoE step are), two
// threads, this machine class (AMX Xeon; benchmarks/x16_stream.py): Q4_K 17.5 / 16.1 / 14.1
// GB/s at 1 / 2 / 4 rows without, 19.5 / 18.7 / 16.7 with the L1 ones alone (384 bytes or
// 4-19 KiB ahead gained less), the two levels +17-21 % over that in the same run; Q6_K (K =
// 512) 14.6 / 13.4 / 12.0 -> 17.3 / 15.9 / 15.0, the two levels +8-9 % more (a torch sum of
// the same bytes: 19-23 GB/s). The hardware prefetchers alone keep too few lines in flight.
// Prefetches never fault, so the last block's may run past the part's end.
constexpr int64_t kX16Ahead = 1024, kX16Q6Ahead = 1536, kX16FarAhead = 4096;

// y[(r0 + r) * N + col + c] for rows r < R of x (quantized in groups of 256) and the 16
// channels of the repacked group at grp. Per block and row: I_b per channel from
// vpdpbusd (4 inputs a lane) summed per sub-block, times its scale (vpmulld); M_b from
// the minimums' pairs against x's sums per 32 (vpdpwssd); then q4k_rows' float32
// operations in the lanes.
template <int R, bool Q5 = false>
PAGODA_AVX512 __attribute__((noinline)) void x16_rows(const QuantizedX& xq, int64_t K, int64_t r0,
                                                        const uint8_t* grp, const float* bias, float* y, int64_t N,
                                                        int64_t col) {
  const int64_t nb = K / 256;
  // A block's bytes, and the prefetches' stride and lines per sub-block (8 x stride >= bytes).
  constexpr int64_t kBytes = Q5 ? kX16Q5Bytes : kX16Bytes;
  constexpr int kStride = Q5 ? 360 : 320, kLines = Q5 ? 6 : 5;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const int8_t* xr[R];
  const int16_t* hr[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = xq.q.data() + (r0 + r) * K;
    hr[r] = xq.h32.data() + (r0 + r) * (K / 32);
  }
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = grp + b * kBytes;
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const char* near = reinterpret_cast<const char*>(p) + kX16Ahead + kStride * j;
      const char* far = reinterpret_cast<const char*>(p) + kX16FarAhead + kStride * j;
      for (int i = 0; i < kLines; ++i) _mm_prefetch(far + 64 * i, _MM_HINT_T1);
      for (int i = 0; i < kLines; ++i) _mm_prefetch(near + 64 * i, _MM_HINT_T0);
      __m512i s[R], t[R];
      for (int r = 0; r < R; ++r) s[r] = t[r] = _mm512_setzero_si512();
      const uint8_t* pj = p + kX16Nibbles + 256 * j;
      const __m512i high = Q5 ? _mm512_loadu_si512(p + kX16Q5High + 64 * j) : m4;
      for (int q = 0; q < 4; ++q) {
        const __m512i v = _mm512_loadu_si512(pj + 64 * q);
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if constexpr (Q5) {
          lo = _mm512_or_si512(lo, bit_to_16(high, 2 * q));
          hi = _mm512_or_si512(hi, bit_to_16(high, 2 * q + 1));
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xj = xr[r] + b * 256 + 32 * j + 8 * q;
          s[r] = _mm512_dpbusd_epi32(s[r], lo, bcast32(xj));
          t[r] = _mm512_dpbusd_epi32(t[r], hi, bcast32(xj + 4));
        }
      }
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kX16Scales + 16 * j)));
      for (int r = 0; r < R; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(_mm512_add_epi32(s[r], t[r]), sc));
    }
    __m512i msum[R];
    for (int r = 0; r < R; ++r) msum[r] = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
      const __m512i mn = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kX16Mins + 32 * i)));
      for (int r = 0; r < R; ++r) msum[r] = _mm512_dpwssd_epi32(msum[r], mn, bcast32(hr[r] + b * 8 + 2 * i));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(xq.d[(r0 + r) * nb + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum[r]), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(msum[r]), acc[r]);
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (r0 + r) * N + col, bias ? _mm512_add_ps(acc[r], bv) : acc[r]);
}

// ---- Q6_K repacked the same way (kQ6KX16) --------------------------------------------
// A block of 256 inputs of 16 channels (3,360 bytes: the 16 Q6_K blocks' bytes rearranged)
// holds
//   [0, 256)      the 16 sub-block scales (int8) in pairs, [pair j][channel][2] (sc_2j, sc_2j+1)
//   then for each 32 inputs j (384 bytes each):
//     256 bytes   the values' low 4 bits, as Q4_K_X16's nibbles: [quad q][channel][4 bytes],
//                 byte i weight 32j + 8q + i low, 32j + 8q + 4 + i high
//     128 bytes   their top 2 bits, [16 inputs h][channel][4 bytes]: byte i holds those of
//                 weights 32j + 16h + i, + 4 + i, + 8 + i, + 12 + i in its bits 0-1, 2-3,
//                 4-5, 6-7
//   [3328, 3360)  d of each channel (float16, as stored).
// The stored values (q + 32, 0-63) go into vpdpbusd as Q6_K's other kernels take them;
// the -32 is folded in per block as there (- 32 sum_j sc_j x's sum over sub-block j).

constexpr int64_t kX16Q6Bytes = 3360;
// Where the parts of a block lie (read in address order: a layout whose reads jumped
// between regions ran at half the bandwidth, the hardware prefetchers lost).
constexpr int q6x16_pair(int j) { return 32 * j; }
constexpr int q6x16_low(int j, int q) { return 256 + 384 * j + 64 * q; }
constexpr int q6x16_high(int j, int h) { return 256 + 384 * j + 256 + 64 * h; }
constexpr int kX16Q6D = 3328;

// Weight w (0-255) of a Q6_K block p: its stored value (0-63; ggml's dequantize_row_q6_K).
inline uint8_t q6k_value(const uint8_t* p, int w) {
  const int half = w / 128, part = (w % 128) / 32, l = w % 32;
  const uint8_t lo = p[64 * half + l + 32 * (part & 1)];
  const uint8_t hi = p[128 + 32 * half + l];
  return static_cast<uint8_t>(((part >= 2 ? lo >> 4 : lo & 0x0F)) | (((hi >> (2 * part)) & 3) << 4));
}

void x16_pack_q6k_block(const uint8_t* const* src, uint8_t* dst) {
  for (int c = 0; c < 16; ++c) {
    const uint8_t* p = src[c];
    std::memcpy(dst + kX16Q6D + 2 * c, p + 208, 2);
    for (int s = 0; s < 16; ++s) dst[q6x16_pair(s / 2) + 2 * c + s % 2] = p[192 + s];
    for (int j = 0; j < 8; ++j) {
      for (int q = 0; q < 4; ++q)
        for (int i = 0; i < 4; ++i) {
          const int w = 32 * j + 8 * q + i;
          dst[q6x16_low(j, q) + 4 * c + i] =
              static_cast<uint8_t>((q6k_value(p, w) & 0x0F) | ((q6k_value(p, w + 4) & 0x0F) << 4));
        }
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 4; ++i) {
          uint8_t bits = 0;
          for (int f = 0; f < 4; ++f) bits |= static_cast<uint8_t>((q6k_value(p, 32 * j + 16 * h + 4 * f + i) >> 4) << (2 * f));
          dst[q6x16_high(j, h) + 4 * c + i] = bits;
        }
    }
  }
}

void x16_unpack_q6k_block(const uint8_t* src, int c, uint8_t* p) {
  std::memset(p, 0, 192);
  std::memcpy(p + 208, src + kX16Q6D + 2 * c, 2);
  for (int s = 0; s < 16; ++s) p[192 + s] = src[q6x16_pair(s / 2) + 2 * c + s % 2];
  for (int w = 0; w < 256; ++w) {
    const int j = w / 32, q = (w % 32) / 8, i = w % 4, upper = (w % 8) / 4;
    const uint8_t lb = src[q6x16_low(j, q) + 4 * c + i];
    const int h = (w % 32) / 16, f = (w % 16) / 4;
    const uint8_t hb = src[q6x16_high(j, h) + 4 * c + i];
    const uint8_t v = static_cast<uint8_t>((upper ? lb >> 4 : lb & 0x0F) | (((hb >> (2 * f)) & 3) << 4));
    const int half = w / 128, part = (w % 128) / 32, l = w % 32;
    p[64 * half + l + 32 * (part & 1)] |= static_cast<uint8_t>(part >= 2 ? (v & 0x0F) << 4 : v & 0x0F);
    p[128 + 32 * half + l] |= static_cast<uint8_t>((v >> 4) << (2 * part));
  }
}

// ---- Q3_K repacked in Q6_K_X16's shape (kQ3KX16) -----------------------------------------
// A Q3_K block has Q6_K's structure: 16 sub-blocks of 16 under signed scales (6 bits, stored
// + 32), one float16 d, values stored plus an offset (3 bits, + 4). A block of 256 inputs of
// 16 channels (1,824 bytes against 1,760) holds
//   [0, 256)      the scales (sc - 32, int8) in pairs, as Q6_K_X16's
//   then for each 32 inputs j (192 bytes each):
//     128 bytes   the stored values' low 2 bits, as Q6_K_X16's top 2 bits: [16 inputs h]
//                 [channel][4 bytes], byte i holds those of weights 32j + 16h + i, + 4 + i,
//                 + 8 + i, + 12 + i in its bits 0-1, 2-3, 4-5, 6-7
//     64 bytes    their third bits, as Q5_K_X16's fifth: bit 2q + e of byte 4c + i that of
//                 weight 32j + 8q + 4e + i of channel c
//   [1792, 1824)  d of each channel (float16, as stored).
// The stored values (0-7) go into vpdpbusd as Q6_K_X16's (0-63) do, the -4 folded in per
// block as Q6_K's -32 (x16_q6k_rows<R, kQ3KX16>; on AMX x16_amx_weights_q6k<kQ3KX16>):
// llama.cpp's Q3_K against Q8_K.
constexpr int64_t kX16Q3Bytes = 1824;
constexpr int q3x16_low(int j, int h) { return 256 + 192 * j + 64 * h; }
constexpr int q3x16_high(int j) { return 256 + 192 * j + 128; }
constexpr int kX16Q3D = 1792;

// Weight w (0-255) of a Q3_K block p: its stored value (0-7; ggml's dequantize_row_q3_K:
// 2 bits from qs, the third from hmask).
inline int q3k_value(const uint8_t* p, int w) {
  const int half = w / 128, sh = (w % 128) / 32, l = w % 32;
  return ((p[32 + 32 * half + l] >> (2 * sh)) & 3) | (((p[l] >> (4 * half + sh)) & 1) << 2);
}

// Scale j (0-15) of a Q3_K block p, less 32 (its 12 bytes: low 4 bits in bytes 0-7, the
// high 2 in bytes 8-11).
inline int q3k_scale(const uint8_t* p, int j) {
  const uint8_t* s = p + 96;
  return (((s[j % 8] >> (4 * (j / 8))) & 0x0F) | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
}

void x16_pack_q3k_block(const uint8_t* const* src, uint8_t* dst) {
  std::memset(dst, 0, kX16Q3Bytes);
  for (int c = 0; c < 16; ++c) {
    const uint8_t* p = src[c];
    std::memcpy(dst + kX16Q3D + 2 * c, p + 108, 2);
    for (int s = 0; s < 16; ++s) dst[q6x16_pair(s / 2) + 2 * c + s % 2] = static_cast<uint8_t>(q3k_scale(p, s));
    for (int w = 0; w < 256; ++w) {
      const int j = w / 32, r = w % 32, u = q3k_value(p, w);
      dst[q3x16_low(j, r / 16) + 4 * c + r % 4] |= static_cast<uint8_t>((u & 3) << (2 * ((r % 16) / 4)));
      dst[q3x16_high(j) + 4 * c + r % 4] |= static_cast<uint8_t>((u >> 2) << (2 * (r / 8) + (r % 8) / 4));
    }
  }
}

void x16_unpack_q3k_block(const uint8_t* src, int c, uint8_t* p) {
  std::memset(p, 0, 110);
  std::memcpy(p + 108, src + kX16Q3D + 2 * c, 2);
  uint8_t* s = p + 96;
  for (int j = 0; j < 16; ++j) {
    const int v = static_cast<int8_t>(src[q6x16_pair(j / 2) + 2 * c + j % 2]) + 32;
    s[j % 8] |= static_cast<uint8_t>((v & 0x0F) << (4 * (j / 8)));
    s[8 + j % 4] |= static_cast<uint8_t>((v >> 4) << (2 * (j / 4)));
  }
  for (int w = 0; w < 256; ++w) {
    const int j = w / 32, r = w % 32, half = w / 128, sh = (w % 128) / 32, l = w % 32;
    const int low = (src[q3x16_low(j, r / 16) + 4 * c + r % 4] >> (2 * ((r % 16) / 4))) & 3;
    const int high = (src[q3x16_high(j) + 4 * c + r % 4] >> (2 * (r / 8) + (r % 8) / 4)) & 1;
    p[32 + 32 * half + l] |= static_cast<uint8_t>(low << (2 * sh));
    p[l] |= static_cast<uint8_t>(high << (4 * half + sh));
  }
}

// ---- Q2_K repacked the same way (kQ2KX16) --------------------------------------------
// A Q2_K block: 16 sub-blocks of 16 under 4-bit scales and 4-bit minimums (a byte each pair:
// scale low, minimum high), float16 d and dmin, values of 2 bits; w = d sc q - dmin m. A
// block of 256 inputs of 16 channels (1,344 bytes: the 16 blocks' bytes rearranged) holds
//   [0, 256)      the scale-and-minimum bytes as stored, in pairs, as Q6_K_X16's scales
//   then for each 32 inputs j (128 bytes each): the values, as Q3_K_X16's low 2 bits
//   [1280, 1312)  d of each channel, [1312, 1344) dmin (float16, as stored).
// Per block and row the kernels sum I_b = sum_s sc_s I_s (vpdpbusd, vpmulld, as Q3_K's) and
// M_b = sum_s m_s X_s against x's sums per 16 (vpdpwssd), then acc += (d dx) I_b, then
// acc -= (dmin dx) M_b: llama.cpp's Q2_K against Q8_K.
constexpr int64_t kX16Q2Bytes = 1344;
constexpr int q2x16_low(int j, int h) { return 256 + 128 * j + 64 * h; }
constexpr int kX16Q2D = 1280;

// Weight w (0-255) of a Q2_K block p: its value (0-3; 2 bits of qs, as Q3_K's low ones).
inline int q2k_value(const uint8_t* p, int w) {
  return (p[16 + 32 * (w / 128) + w % 32] >> (2 * ((w % 128) / 32))) & 3;
}

void x16_pack_q2k_block(const uint8_t* const* src, uint8_t* dst) {
  std::memset(dst, 0, kX16Q2Bytes);
  for (int c = 0; c < 16; ++c) {
    const uint8_t* p = src[c];
    std::memcpy(dst + kX16Q2D + 2 * c, p + 80, 2);
    std::memcpy(dst + kX16Q2D + 32 + 2 * c, p + 82, 2);
    for (int s = 0; s < 16; ++s) dst[q6x16_pair(s / 2) + 2 * c + s % 2] = p[s];
    for (int w = 0; w < 256; ++w) {
      const int j = w / 32, r = w % 32;
      dst[q2x16_low(j, r / 16) + 4 * c + r % 4] |= static_cast<uint8_t>(q2k_value(p, w) << (2 * ((r % 16) / 4)));
    }
  }
}

void x16_unpack_q2k_block(const uint8_t* src, int c, uint8_t* p) {
  std::memset(p, 0, 84);
  std::memcpy(p + 80, src + kX16Q2D + 2 * c, 2);
  std::memcpy(p + 82, src + kX16Q2D + 32 + 2 * c, 2);
  for (int s = 0; s < 16; ++s) p[s] = src[q6x16_pair(s / 2) + 2 * c + s % 2];
  for (int w = 0; w < 256; ++w) {
    const int j = w / 32, r = w % 32;
    const int v = (src[q2x16_low(j, r / 16) + 4 * c + r % 4] >> (2 * ((r % 16) / 4))) & 3;
    p[16 + 32 * (w / 128) + w % 32] |= static_cast<uint8_t>(v << (2 * ((w % 128) / 32)));
  }
}

// The repacked K-quant layouts, one traits struct a type (as Lanes32 for the 32-weight
// ones): the plain type, its block's bytes in the file and repacked (16 channels), and the
// block's packing (16 channels' plain blocks -> one repacked block) and unpacking (channel
// c -> its plain block, byte for byte).
template <int KT>
struct Lanes16;
template <>
struct Lanes16<kQ4KX16> {
  static constexpr int kPlain = kQ4_K, kPlainBytes = 144;
  static constexpr int64_t kBytes = kX16Bytes;
  static void pack(const uint8_t* const* src, uint8_t* dst) { x16_pack_block(src, dst); }
  static void unpack(const uint8_t* src, int c, uint8_t* p) { x16_unpack_block(src, c, p); }
};
template <>
struct Lanes16<kQ5KX16> {
  static constexpr int kPlain = kQ5_K, kPlainBytes = 176;
  static constexpr int64_t kBytes = kX16Q5Bytes;
  static void pack(const uint8_t* const* src, uint8_t* dst) { x16_pack_q5k_block(src, dst); }
  static void unpack(const uint8_t* src, int c, uint8_t* p) { x16_unpack_q5k_block(src, c, p); }
};
template <>
struct Lanes16<kQ6KX16> {
  static constexpr int kPlain = kQ6_K, kPlainBytes = 210;
  static constexpr int64_t kBytes = kX16Q6Bytes;
  static void pack(const uint8_t* const* src, uint8_t* dst) { x16_pack_q6k_block(src, dst); }
  static void unpack(const uint8_t* src, int c, uint8_t* p) { x16_unpack_q6k_block(src, c, p); }
};
template <>
struct Lanes16<kQ3KX16> {
  static constexpr int kPlain = kQ3_K, kPlainBytes = 110;
  static constexpr int64_t kBytes = kX16Q3Bytes;
  static void pack(const uint8_t* const* src, uint8_t* dst) { x16_pack_q3k_block(src, dst); }
  static void unpack(const uint8_t* src, int c, uint8_t* p) { x16_unpack_q3k_block(src, c, p); }
};
template <>
struct Lanes16<kQ2KX16> {
  static constexpr int kPlain = kQ2_K, kPlainBytes = 84;
  static constexpr int64_t kBytes = kX16Q2Bytes;
  static void pack(const uint8_t* const* src, uint8_t* dst) { x16_pack_q2k_block(src, dst); }
  static void unpack(const uint8_t* src, int c, uint8_t* p) { x16_unpack_q2k_block(src, c, p); }
};

// f(integral_constant<int, KT>) for a repacked K-quant type KT.
template <typename F>
void with_x16_type(int type, F&& f) {
  switch (type) {
    case kQ4KX16: f(std::integral_constant<int, kQ4KX16>{}); return;
    case kQ5KX16: f(std::integral_constant<int, kQ5KX16>{}); return;
    case kQ6KX16: f(std::integral_constant<int, kQ6KX16>{}); return;
    case kQ3KX16: f(std::integral_constant<int, kQ3KX16>{}); return;
    case kQ2KX16: f(std::integral_constant<int, kQ2KX16>{}); return;
    default: TORCH_CHECK(false, "not a repacked K-quant type: ", type);
  }
}

// Row n of a repacked K-quant part as its plain row into out.
void x16_unpack_row(const Part& w, int64_t n, int64_t K, uint8_t* out) {
  const uint8_t* g = w.data + (n / 16) * 16 * w.row_bytes;
  const int c = static_cast<int>(n % 16);
  with_x16_type(w.type, [&](auto kt) {
    using L = Lanes16<decltype(kt)::value>;
    for (int64_t b = 0; b < K / 256; ++b) L::unpack(g + b * L::kBytes, c, out + b * L::kPlainBytes);
  });
}

// The Q6_K version of x16_rows; KT = kQ3KX16 that of Q3_K_X16 (values of 3 bits, offset 4),
// kQ2KX16 that of Q2_K_X16 (values of 2 bits, unsigned scales, minimums).
template <int R, int KT = kQ6KX16>
PAGODA_AVX512 __attribute__((noinline)) void x16_q6k_rows(const QuantizedX& xq, int64_t K, int64_t r0,
                                                            const uint8_t* grp, const float* bias, float* y,
                                                            int64_t N, int64_t col) {
  const int64_t nb = K / 256;
  // A block's bytes, the prefetches' stride and lines per 32 inputs (8 x stride = bytes),
  // the stored values' offset as a shift (32 = 1 << 5; 4 = 1 << 2), where d lies.
  constexpr bool Q3 = KT == kQ3KX16, Q2 = KT == kQ2KX16;
  constexpr int64_t kBytes = Lanes16<KT>::kBytes;
  constexpr int kStride = Q2 ? 168 : Q3 ? 228 : 420, kLines = Q2 ? 3 : Q3 ? 4 : 7, kOffsetShift = Q3 ? 2 : 5;
  constexpr int kD = Q2 ? kX16Q2D : Q3 ? kX16Q3D : kX16Q6D;
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30), m3 = _mm512_set1_epi8(3);
  const int8_t* xr[R];
  const int16_t* hr[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = xq.q.data() + (r0 + r) * K;
    hr[r] = xq.h16.data() + (r0 + r) * (K / 16);
  }
  // Two chains of sums a row for up to four rows (the vpdpbusd latency in view), one
  // beyond (the registers go to the rows: a pass of 8 rows shares each vector's 6-bit
  // unpacking between twice the products).
  constexpr int T = R > 4 ? 1 : 2;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = grp + b * kBytes;
    __m512i isum[R], msum[R];
    for (int r = 0; r < R; ++r) isum[r] = msum[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const char* near = reinterpret_cast<const char*>(p) + kX16Q6Ahead + kStride * j;
      const char* far = reinterpret_cast<const char*>(p) + kX16FarAhead + kStride * j;
      for (int i = 0; i < kLines; ++i) _mm_prefetch(far + 64 * i, _MM_HINT_T1);
      for (int i = 0; i < kLines; ++i) _mm_prefetch(near + 64 * i, _MM_HINT_T0);
      // Scales 2j and 2j + 1 per channel, as int16 pairs and as int32 each; the pairs
      // times -32 (|32 sc| < 2^15; Q3: -4) against x's sums per 16: the offset of every
      // stored value.
      // Q2: the bytes' low nibbles the scales, their high ones the minimums, against x's
      // sums per 16 into M_b.
      const __m256i pair_bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + q6x16_pair(j)));
      const __m512i sp = Q2 ? _mm512_and_si512(_mm512_cvtepu8_epi16(pair_bytes), _mm512_set1_epi16(0x0F))
                            : _mm512_cvtepi8_epi16(pair_bytes);
      const __m512i sc[2] = {_mm512_srai_epi32(_mm512_slli_epi32(sp, 16), 16), _mm512_srai_epi32(sp, 16)};
      if constexpr (Q2) {
        const __m512i mn = _mm512_srli_epi16(_mm512_cvtepu8_epi16(pair_bytes), 4);
        for (int r = 0; r < R; ++r) msum[r] = _mm512_dpwssd_epi32(msum[r], mn, bcast32(hr[r] + b * 16 + 2 * j));
      } else {
        const __m512i neg = _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16(sp, kOffsetShift));
        for (int r = 0; r < R; ++r) isum[r] = _mm512_dpwssd_epi32(isum[r], neg, bcast32(hr[r] + b * 16 + 2 * j));
      }
      const __m512i third = Q3 ? _mm512_loadu_si512(p + q3x16_high(j)) : m4;
      for (int h = 0; h < 2; ++h) {  // sub-block 2j + h: quads 2h, 2h + 1
        const __m512i hb = _mm512_loadu_si512(p + (Q2 ? q2x16_low(j, h) : Q3 ? q3x16_low(j, h) : q6x16_high(j, h)));
        __m512i s[2][R];
        for (int r = 0; r < R; ++r) s[0][r] = s[T - 1][r] = _mm512_setzero_si512();
        for (int u = 0; u < 2; ++u) {
          const int q = 2 * h + u;
          __m512i lo, hi;
          if constexpr (Q3) {  // fields 2u and 2u + 1 of hb, the third bits 2q and 2q + 1
            lo = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(hb, 4 * u), m3), bit_to(third, 2 * q, 2));
            hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(hb, 4 * u + 2), m3), bit_to(third, 2 * q + 1, 2));
          } else if constexpr (Q2) {  // fields 2u and 2u + 1 of hb
            lo = _mm512_and_si512(_mm512_srli_epi16(hb, 4 * u), m3);
            hi = _mm512_and_si512(_mm512_srli_epi16(hb, 4 * u + 2), m3);
          } else {
            const __m512i v = _mm512_loadu_si512(p + q6x16_low(j, q));
            // Top bits of the low-nibble weights: fields 2u; of the high-nibble ones: 2u + 1.
            const __m512i tl = u ? hb : _mm512_slli_epi16(hb, 4);
            const __m512i th = u ? _mm512_srli_epi16(hb, 2) : _mm512_slli_epi16(hb, 2);
            lo = _mm512_or_si512(_mm512_and_si512(v, m4), _mm512_and_si512(tl, m30));
            hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), _mm512_and_si512(th, m30));
          }
          for (int r = 0; r < R; ++r) {
            const int8_t* xj = xr[r] + b * 256 + 32 * j + 8 * q;
            s[0][r] = _mm512_dpbusd_epi32(s[0][r], lo, bcast32(xj));
            s[T - 1][r] = _mm512_dpbusd_epi32(s[T - 1][r], hi, bcast32(xj + 4));
          }
        }
        for (int r = 0; r < R; ++r) {
          const __m512i sj = T == 2 ? _mm512_add_epi32(s[0][r], s[T - 1][r]) : s[0][r];
          isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sj, sc[h]));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kD)));
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(xq.d[(r0 + r) * nb + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum[r]), acc[r]);
      if constexpr (Q2) {
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kD + 32)));
        acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(msum[r]), acc[r]);
      }
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (r0 + r) * N + col, bias ? _mm512_add_ps(acc[r], bv) : acc[r]);
}


// ---- Q4_K / Q6_K repacked, on AMX int8 tiles -----------------------------------------
// A step of many rows (a prompt, an expert's share of one, a dense layer at 16 streams)
// multiplies each repacked group of 16 channels with tdpbsud: 16 rows of x's int8
// (signed, A) against unsigned weights (B). A Q4_K scale is per channel and per 32 inputs;
// folded into the weights (w = scale x nibble, 0 .. 945), a block's integer sum
// I_b = sum_j scale_j I_j = sum_k w_k x_k needs no per sub-block step: w is split into
// its low byte and its high bits (0 .. 3), B_lo and B_hi, and a block is four tile
// products of 64 inputs into each of two sums, I_b = 256 C_hi + C_lo, the very integer
// x16_rows sums. M_b and the float32 operations per block are x16_rows' own: the same
// integers, the same float32 operations, the same bits for every row.
// Per group of 16 channels and block, B_lo and B_hi are made once (4 KiB each: row kk of
// tile t holds inputs 64 t + 4 kk .. + 3 of the 16 channels, four bytes each) and every
// 16 rows of the step run over them (the last few rows copied into 16 rows of zeros).

constexpr int kAmxRows = 16;
// Steps (and experts' shares) of at least this many rows take the AMX kernels.
constexpr int64_t kAmxMinRows = 16;
// Rows a unit of gguf_linear_int8 takes when the AMX kernel runs (kRowChunk otherwise).
constexpr int64_t kAmxRowChunk = 512;

// ldtilecfg's 64 bytes (palette 1): all eight tiles 16 rows of 64 bytes (x16_amx_block).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

PAGODA_AMX inline void amx_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kAmxRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Thread scratch of the AMX kernels: a block's B_hi and B_lo and the terms its every row
// takes (x16_amx_terms), the last rows of x padded to 16, two groups' two sums each, the
// rows' float32 sums.
struct AmxScratch {
  alignas(64) uint8_t hi[4096];
  alignas(64) uint8_t lo[4096];
  alignas(64) float d[2][16];     // Q4_K: d, dmin; Q6_K: d
  alignas(64) int16_t v[8][32];   // Q4_K: the minimums (4); Q6_K: -32 x the scales' pairs (8)
  alignas(64) int32_t c[4][kAmxRows * 16];
  Buffer<int8_t> x;
  Buffer<float> acc;
  Buffer<uint8_t> b32;  // a repacked 32-weight group's B tiles (x32_amx_tile)
};

// Rows [r0, r1) of xq (fewer than 16) into sc.x, padded with rows of zeros to 16: the
// last A tile of a step whose rows are not a multiple of 16.
inline void amx_pad_rows(const QuantizedX& xq, int64_t r0, int64_t r1, int64_t K, AmxScratch& sc) {
  if (r0 >= r1) return;
  sc.x.resize(kAmxRows * K);
  std::memcpy(sc.x.data(), xq.q.data() + r0 * K, (r1 - r0) * K);
  std::memset(sc.x.data() + (r1 - r0) * K, 0, (kAmxRows - (r1 - r0)) * K);
}

// Row `row` of B_lo / B_hi from 64 unsigned values n (channel c's four at 4c) and their
// scales, those of the even bytes alone (s_even) and of the odd ones (s_odd): vpmaddubsw
// then gives one product a 16-bit lane, w = value x scale; lo takes its low byte, hi its
// high byte (vpternlogd 0xCA: a ? b : c per bit, a the even bytes' mask).
PAGODA_AMX inline void amx_scaled_row(__m512i n, __m512i s_even, __m512i s_odd, int row, AmxScratch& sc) {
  const __m512i even = _mm512_set1_epi16(0x00FF);
  const __m512i we = _mm512_maddubs_epi16(n, s_even), wo = _mm512_maddubs_epi16(n, s_odd);
  _mm512_store_si512(sc.lo + 64 * row, _mm512_ternarylogic_epi32(even, we, _mm512_slli_epi16(wo, 8), 0xCA));
  _mm512_store_si512(sc.hi + 64 * row, _mm512_ternarylogic_epi32(even, _mm512_srli_epi16(we, 8), wo, 0xCA));
}

// Block p of a repacked group (16 channels, 256 inputs) -> B_hi and B_lo: w = scale x
// nibble in 16-bit lanes (a byte's value in each), its low byte to lo, its high byte to hi
// (Q5: the value's fifth bit ORed in first: w <= 31 x 63).
template <bool Q5 = false>
PAGODA_AMX inline void x16_amx_weights(const uint8_t* p, AmxScratch& sc) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), even = _mm512_set1_epi16(0x00FF);
  // Channel c's 4 bytes of a row lie at 4c: the scale of channel c in each of them (the 16
  // scales in every 128-bit lane, lane L picking channels 4L .. 4L + 3).
  const __m512i spread = _mm512_set_epi8(15, 15, 15, 15, 14, 14, 14, 14, 13, 13, 13, 13, 12, 12, 12, 12, 11, 11, 11,
                                         11, 10, 10, 10, 10, 9, 9, 9, 9, 8, 8, 8, 8, 7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5,
                                         5, 4, 4, 4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int j = 0; j < 8; ++j) {
    const __m512i s = _mm512_shuffle_epi8(
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kX16Scales + 16 * j))), spread);
    const __m512i s_even = _mm512_and_si512(s, even), s_odd = _mm512_andnot_si512(even, s);
    const __m512i high = Q5 ? _mm512_loadu_si512(p + kX16Q5High + 64 * j) : m4;
    for (int q = 0; q < 4; ++q) {
      const __m512i v = _mm512_loadu_si512(p + kX16Nibbles + 256 * j + 64 * q);
      // Inputs 32j + 8q + (0..3) (low nibbles), then + 4 .. + 7 (high): rows 8j + 2q, 8j + 2q + 1.
      __m512i n[2] = {_mm512_and_si512(v, m4), _mm512_and_si512(_mm512_srli_epi16(v, 4), m4)};
      if constexpr (Q5)
        for (int h = 0; h < 2; ++h) n[h] = _mm512_or_si512(n[h], bit_to_16(high, 2 * q + h));
      for (int h = 0; h < 2; ++h) amx_scaled_row(n[h], s_even, s_odd, 8 * j + 2 * q + h, sc);
    }
  }
}

// The same for a repacked Q6_K block: w = scale x stored value (signed scales, values
// 0 .. 63: -8128 .. 8001), lo its low byte (unsigned), hi its high byte (signed, -32 .. 31),
// w = 256 hi + lo. The stored values' -32 is x16_q6k_rows' term per block. KT = kQ3KX16: a
// repacked Q3_K block (values 0 .. 7, scales -32 .. 31: hi -1 .. 0), its -4 the term;
// kQ2KX16: a repacked Q2_K block (values 0 .. 3, scales 0 .. 15: hi 0), its minimums the term.
template <int KT = kQ6KX16>
PAGODA_AMX inline void x16_amx_weights_q6k(const uint8_t* p, AmxScratch& sc) {
  constexpr bool Q3 = KT == kQ3KX16, Q2 = KT == kQ2KX16;
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30), even = _mm512_set1_epi16(0x00FF);
  const __m512i m3 = _mm512_set1_epi8(3);
  // A pair block's 32 bytes (channel c's scales 2j, 2j + 1 at 2c, 2c + 1) with bytes 0-15 in
  // lanes 0 and 1, 16-31 in lanes 2 and 3; lane L picks channels 4L .. 4L + 3.
  const __m512i lanes = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0);
  const __m512i pick = _mm512_set_epi8(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0, 6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2,
                                       2, 0, 0, 0, 0, 6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0, 6, 6, 6, 6, 4, 4,
                                       4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
  const __m512i pick_lanes = _mm512_add_epi8(pick, _mm512_set_epi64(0x0808080808080808, 0x0808080808080808, 0, 0,
                                                                    0x0808080808080808, 0x0808080808080808, 0, 0));
  for (int j = 0; j < 8; ++j) {
    __m512i pairs = _mm512_permutexvar_epi64(
        lanes, _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + q6x16_pair(j)))));
    if constexpr (Q2) pairs = _mm512_and_si512(pairs, m4);  // the scales (low nibbles)
    const __m512i third = Q3 ? _mm512_loadu_si512(p + q3x16_high(j)) : m4;
    for (int h = 0; h < 2; ++h) {  // sub-block 2j + h: quads 2h, 2h + 1
      const __m512i s = _mm512_shuffle_epi8(pairs, _mm512_add_epi8(pick_lanes, _mm512_set1_epi8(static_cast<char>(h))));
      const __m512i s_even = _mm512_and_si512(s, even), s_odd = _mm512_andnot_si512(even, s);
      const __m512i hb = _mm512_loadu_si512(p + (Q2 ? q2x16_low(j, h) : Q3 ? q3x16_low(j, h) : q6x16_high(j, h)));
      for (int u = 0; u < 2; ++u) {
        const int q = 2 * h + u;
        __m512i n[2];
        if constexpr (Q3) {  // as x16_q6k_rows<R, kQ3KX16>
          n[0] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(hb, 4 * u), m3), bit_to(third, 2 * q, 2));
          n[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(hb, 4 * u + 2), m3), bit_to(third, 2 * q + 1, 2));
        } else if constexpr (Q2) {
          n[0] = _mm512_and_si512(_mm512_srli_epi16(hb, 4 * u), m3);
          n[1] = _mm512_and_si512(_mm512_srli_epi16(hb, 4 * u + 2), m3);
        } else {
          const __m512i v = _mm512_loadu_si512(p + q6x16_low(j, q));
          const __m512i tl = u ? hb : _mm512_slli_epi16(hb, 4);
          const __m512i th = u ? _mm512_srli_epi16(hb, 2) : _mm512_slli_epi16(hb, 2);
          n[0] = _mm512_or_si512(_mm512_and_si512(v, m4), _mm512_and_si512(tl, m30));
          n[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), _mm512_and_si512(th, m30));
        }
        for (int e = 0; e < 2; ++e) amx_scaled_row(n[e], s_even, s_odd, 8 * j + 2 * q + e, sc);
      }
    }
  }
}

// The terms of block p that every row of it takes (x16_amx_take), once a block into sc:
// Q4_K's d, dmin and minimums; Q6_K's d and its scales' pairs times -32 (Q3_K's times -4);
// Q2_K's d, dmin and minimums' pairs, as x16_rows / x16_q6k_rows take them.
template <int KT>
PAGODA_AMX inline void x16_amx_terms(const uint8_t* p, AmxScratch& sc) {
  if constexpr (KT == kQ2KX16) {
    _mm512_store_ps(sc.d[0], _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kX16Q2D))));
    _mm512_store_ps(sc.d[1], _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kX16Q2D + 32))));
    for (int j = 0; j < 8; ++j)
      _mm512_store_si512(sc.v[j], _mm512_srli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256(
                                                        reinterpret_cast<const __m256i*>(p + q6x16_pair(j)))), 4));
  } else if constexpr (KT == kQ6KX16 || KT == kQ3KX16) {
    constexpr bool Q3 = KT == kQ3KX16;
    _mm512_store_ps(sc.d[0], _mm512_cvtph_ps(_mm256_loadu_si256(
                                 reinterpret_cast<const __m256i*>(p + (Q3 ? kX16Q3D : kX16Q6D)))));
    for (int j = 0; j < 8; ++j)
      _mm512_store_si512(sc.v[j], _mm512_sub_epi16(_mm512_setzero_si512(),
                                                   _mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                                                         reinterpret_cast<const __m256i*>(
                                                                             p + q6x16_pair(j)))), Q3 ? 2 : 5)));
  } else {
    _mm512_store_ps(sc.d[0], _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
    _mm512_store_ps(sc.d[1], _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))));
    for (int i = 0; i < 4; ++i)
      _mm512_store_si512(sc.v[i], _mm512_cvtepu8_epi16(
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kX16Mins + 32 * i))));
  }
}

// The terms of block b (its x16_amx_terms in sc) for R rows from r0 of xq, from the two
// sums of their tile products (chi, clo: 16 x 16 int32): acc[r] (16 floats a row) += them,
// x16_rows' / x16_q6k_rows' integers and float32 operations (Q2_K: no high bytes, chi unused).
template <int KT>
PAGODA_AMX inline void x16_amx_take(const QuantizedX& xq, int64_t K, int64_t b, int64_t r0, int R,
                                    const AmxScratch& sc, const int32_t* chi, const int32_t* clo, float* acc) {
  const int64_t nb = K / 256;
  const __m512 d = _mm512_load_ps(sc.d[0]);
  if constexpr (KT == kQ6KX16 || KT == kQ3KX16) {
    for (int r = 0; r < R; ++r) {
      __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(chi + 16 * r), 8), _mm512_load_si512(clo + 16 * r));
      const int16_t* hr = xq.h16.data() + (r0 + r) * (K / 16) + b * 16;
      for (int j = 0; j < 8; ++j) isum = _mm512_dpwssd_epi32(isum, _mm512_load_si512(sc.v[j]), bcast32(hr + 2 * j));
      const __m512 dx = _mm512_set1_ps(xq.d[(r0 + r) * nb + b]);
      _mm512_storeu_ps(acc + 16 * r, _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum),
                                                     _mm512_loadu_ps(acc + 16 * r)));
    }
  } else {
    const __m512 dmin = _mm512_load_ps(sc.d[1]);
    for (int r = 0; r < R; ++r) {
      __m512i isum, msum = _mm512_setzero_si512();
      if constexpr (KT == kQ2KX16) {  // the minimums per 16 inputs
        isum = _mm512_load_si512(clo + 16 * r);
        const int16_t* hr = xq.h16.data() + (r0 + r) * (K / 16) + b * 16;
        for (int j = 0; j < 8; ++j) msum = _mm512_dpwssd_epi32(msum, _mm512_load_si512(sc.v[j]), bcast32(hr + 2 * j));
      } else {
        isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(chi + 16 * r), 8), _mm512_load_si512(clo + 16 * r));
        const int16_t* hr = xq.h32.data() + (r0 + r) * (K / 32) + b * 8;
        for (int i = 0; i < 4; ++i) msum = _mm512_dpwssd_epi32(msum, _mm512_load_si512(sc.v[i]), bcast32(hr + 2 * i));
      }
      const __m512 dx = _mm512_set1_ps(xq.d[(r0 + r) * nb + b]);
      __m512 a = _mm512_loadu_ps(acc + 16 * r);
      a = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum), a);
      a = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(msum), a);
      _mm512_storeu_ps(acc + 16 * r, a);
    }
  }
}

// One block (block b of the group, its B and terms in sc) for one group of 16 rows (x0:
// 16 rows of K int8, those past R0 ignored; their d / h32 rows from r0 of xq) or, Two, a
// second group (x1, R1 rows from r0 + 16) sharing each B tile: acc[r] += the block's terms.
// Tiles: 0-1 the first group's sums (hi, lo), 2-3 the second's, 4-5 their A, 6-7 B. Q2_K's
// weights (0 .. 45) have no high bytes: its tiles 0 and 2 stay unused.
template <int KT, bool Two>
PAGODA_AMX __attribute__((noinline)) void x16_amx_block(const QuantizedX& xq, const int8_t* x0, const int8_t* x1,
                                                      int64_t K, int64_t b, int64_t r0, int R0, int R1,
                                                      float* acc, AmxScratch& sc) {
  constexpr bool kHi = KT != kQ2KX16, kSigned = KT == kQ6KX16 || KT == kQ3KX16;  // signed high bytes
  if constexpr (kHi) _tile_zero(0);
  _tile_zero(1);
  if constexpr (Two) {
    if constexpr (kHi) _tile_zero(2);
    _tile_zero(3);
  }
  for (int t = 0; t < 4; ++t) {
    if constexpr (kHi) _tile_loadd(6, sc.hi + 1024 * t, 64);
    _tile_loadd(7, sc.lo + 1024 * t, 64);
    _tile_loadd(4, x0 + b * 256 + 64 * t, K);
    if constexpr (kSigned) {
      _tile_dpbssd(0, 4, 6);
    } else if constexpr (kHi) {
      _tile_dpbsud(0, 4, 6);
    }
    _tile_dpbsud(1, 4, 7);
    if constexpr (Two) {
      _tile_loadd(5, x1 + b * 256 + 64 * t, K);
      if constexpr (kSigned) {
        _tile_dpbssd(2, 5, 6);
      } else if constexpr (kHi) {
        _tile_dpbsud(2, 5, 6);
      }
      _tile_dpbsud(3, 5, 7);
    }
  }
  if constexpr (kHi) _tile_stored(0, sc.c[0], 64);
  _tile_stored(1, sc.c[1], 64);
  if constexpr (Two) {
    if constexpr (kHi) _tile_stored(2, sc.c[2], 64);
    _tile_stored(3, sc.c[3], 64);
  }
  x16_amx_take<KT>(xq, K, b, r0, R0, sc, sc.c[0], sc.c[1], acc);
  if constexpr (Two) x16_amx_take<KT>(xq, K, b, r0 + kAmxRows, R1, sc, sc.c[2], sc.c[3], acc + kAmxRows * 16);
}

// Channels [n0, n1) (multiples of 16) of a repacked Q2_K, Q3_K, Q4_K, Q5_K or Q6_K part (KT)
// for rows [m0, m1) on the tiles (Q16: scales per 16 inputs, Q6_K_X16's shape).
template <int KT>
PAGODA_AMX void x16_amx_tile(const QuantizedX& xq, int64_t m0, int64_t m1, int64_t K, const Part& w, int64_t n0,
                             int64_t n1, const float* bias, float* y, int64_t N, AmxScratch& sc) {
  constexpr bool Q16 = KT == kQ6KX16 || KT == kQ3KX16 || KT == kQ2KX16;
  const int64_t nb = K / 256, M = m1 - m0, full_end = m0 + M / kAmxRows * kAmxRows;
  amx_config();
  amx_pad_rows(xq, full_end, m1, K, sc);
  sc.acc.resize(M * 16);
  for (int64_t n = n0; n < n1; n += 16) {
    const uint8_t* grp = w.data + n * w.row_bytes;
    std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
    for (int64_t b = 0; b < nb; ++b) {
      constexpr int64_t bytes = Lanes16<KT>::kBytes;
      const uint8_t* p = grp + b * bytes;
      // The next block's weights on their way while this one's rows run (they come from
      // memory once a step; the prefetchers stopped at the block: a step's rows over it
      // take longer than they look ahead).
      if (b + 1 < nb || n + 16 < n1)
        for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + bytes + o), _MM_HINT_T0);
      if constexpr (Q16)
        x16_amx_weights_q6k<KT>(p, sc);
      else
        x16_amx_weights<KT == kQ5KX16>(p, sc);
      x16_amx_terms<KT>(p, sc);
      // Two groups of 16 rows a call, the last one alone; the last rows from sc.x.
      auto rows_x = [&](int64_t r) { return r < full_end ? xq.q.data() + r * K : sc.x.data(); };
      for (int64_t r = m0; r < m1; r += 2 * kAmxRows) {
        const int R0 = static_cast<int>(std::min<int64_t>(kAmxRows, m1 - r));
        float* acc = sc.acc.data() + (r - m0) * 16;
        if (r + kAmxRows < m1)
          x16_amx_block<KT, true>(xq, rows_x(r), rows_x(r + kAmxRows), K, b, r, R0,
                                  static_cast<int>(std::min<int64_t>(kAmxRows, m1 - r - kAmxRows)), acc, sc);
        else
          x16_amx_block<KT, false>(xq, rows_x(r), nullptr, K, b, r, R0, 0, acc, sc);
      }
    }
    const int64_t col = w.col + n;
    const __m512 bv = bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
    for (int64_t r = 0; r < M; ++r) {
      const __m512 a = _mm512_loadu_ps(sc.acc.data() + 16 * r);
      _mm512_storeu_ps(y + (m0 + r) * N + col, bias ? _mm512_add_ps(a, bv) : a);
    }
  }
  _tile_release();
}

// ---- Q4_0, Q4_1, Q8_0, IQ4_NL and MXFP4 repacked: 16 channels in the lanes (kQ40X16 ...) --
// The 32-weight block types' few-row kernels (int8_dot32) reduce each channel's sums
// across lanes and decode a block per channel: compute-bound at ~11-14 GB/s from memory,
// half what the repacked Q4_K kernel streams (benchmarks/gguf_modes.py). Repacked at load
// like Q4_K (gguf_repack_x16), a block of 32 inputs of 16 channels holds
//   Q4_0_X16 (288 bytes): [0, 32) d of each channel (float16, as stored); [32, 288) the
//     nibbles, [quad pair q][channel][4 bytes]: byte i of channel c's 4 holds input
//     8q + i in its low nibble and input 8q + 4 + i in its high one;
//   Q4_1_X16 (320 bytes): d, then [32, 64) m of each channel, then the nibbles as Q4_0's;
//   Q8_0_X16 (544 bytes): d, then [32, 544) the values as stored (int8), [quad k][channel]
//     [4 bytes]: inputs 4k .. 4k + 3 of channel c at 4c;
//   IQ4_NL_X16 (288 bytes): as Q4_0_X16, the nibbles indices into IQ4_NL's table;
//   MXFP4_X16 (272 bytes): [0, 16) the E8M0 scale byte of each channel, then the nibbles as
//     Q4_0's, indices into MXFP4's table (its values doubled, the scale halved);
//   Q5_0_X16 (352 bytes) / Q5_1_X16 (384 bytes): as Q4_0_X16 / Q4_1_X16, then 64 bytes of
//     fifth bits: 8 bytes a row kk of the values below, bit 4c + i that of the row's byte
//     4c + i (a mask of the 64 values that take 16);
//   IQ4_XS_X16 (2,208 bytes for 256 inputs, 8 blocks of 32): [0, 32) d of each channel
//     (float16), [32, 160) the blocks' scales less 32 (int8), [block][channel], then the 8
//     blocks' nibbles as IQ4_NL_X16's; a block's scale d (ls - 32), exact in float32.
// Either way row kk of the block's 8 x 64 bytes of values (nibbles split, looked up) holds inputs
// 4kk .. 4kk + 3 of the 16 channels: one vpdpbusd against 4 broadcast inputs of x, and
// one row of an AMX B tile. Per block and row the integer sum I = sum_k w_k x_k of the
// block's values w (Q4_0: nibble - 8; Q8_0: the int8; Q4_1: the nibble; IQ4_NL, MXFP4: the
// table's value) is exact in int32,
// then acc += (d dx) I in float32 (Q4_1: then acc += m (dx sum x)), per channel in its lane:
// the same integers and float32 operations on the VNNI kernel (x32_rows) and the AMX one
// (x32_amx_tile), so every row's result is the same whatever the step's size.

template <int T>
struct Lanes32 {
  static constexpr bool kNibbles = T != kQ80X16;
  static constexpr bool kMin = T == kQ41X16 || T == kQ51X16;
  static constexpr bool kHigh = T == kQ50X16 || T == kQ51X16;       // fifth bits
  static constexpr bool kE8M0 = T == kMXFP4X16;                   // one scale byte a channel
  static constexpr bool kSuper = T == kIQ4XSX16;                  // 8 blocks under one d
  static constexpr bool kTable = T == kIQ4NLX16 || T == kMXFP4X16 || kSuper;  // nibbles index a table
  static constexpr int kPlain = T == kQ40X16 ? kQ4_0 : T == kQ41X16 ? kQ4_1 : T == kQ80X16 ? kQ8_0
                                : T == kIQ4NLX16 ? kIQ4_NL : T == kQ50X16 ? kQ5_0 : T == kQ51X16 ? kQ5_1
                                : kSuper ? kIQ4_XS : kMXFP4;
  static constexpr int kScaleBytes = kE8M0 ? 1 : 2;
  // A plain block's bytes before its qh (Q5) and nibbles / values, and in all.
  static constexpr int kHead = kScaleBytes + (kMin ? 2 : 0);
  static constexpr int kPlainBytes = kHead + (kHigh ? 4 : 0) + (kNibbles ? 16 : 32);
  static constexpr int kCodes = kSuper ? 160 : 16 * kHead;  // the values' first byte in a block
  static constexpr int64_t kBytes = kSuper ? 2208 / 8 : 16 * kPlainBytes;  // a block's share
  // vpdpbusd takes unsigned weights: the VNNI kernel's are the values plus this (the
  // nibbles as stored, Q5's with their fifth bit; Q8_0's sign bit flipped; the tables'
  // values plus 128), taken off again as kOffset x sum(x).
  static constexpr int kOffset = T == kQ40X16 ? 8 : T == kQ50X16 ? 16 : kMin ? 0 : 128;
  static const int8_t* table() { return T == kMXFP4X16 ? kMXFP4Values : kIQ4Values; }
  // Block b's first byte of values and its 64-byte rows of fifth bits, in a group at grp.
  static const uint8_t* codes(const uint8_t* grp, int64_t b) {
    if constexpr (kSuper) return grp + (b / 8) * 2208 + kCodes + 256 * (b % 8);
    return grp + b * kBytes + kCodes;
  }
  static const uint8_t* high(const uint8_t* grp, int64_t b) { return grp + b * kBytes + kCodes + 256; }
  // Where block b's scales (or its super-block's d) and minimums begin.
  static const uint8_t* head(const uint8_t* grp, int64_t b) {
    if constexpr (kSuper) return grp + (b / 8) * 2208;
    return grp + b * kBytes;
  }
};

// The 16 channels' scales of block b of a repacked 32-weight group grp (float16 d, MXFP4's
// E8M0 halved: e8m0_half's values; IQ4_XS's d (ls - 32)).
template <int T>
PAGODA_AVX512 inline __m512 lanes_scale(const uint8_t* grp, int64_t b) {
  const uint8_t* p = Lanes32<T>::head(grp, b);
  if constexpr (Lanes32<T>::kSuper) {
    const __m512i ls = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * (b % 8))));
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), _mm512_cvtepi32_ps(ls));
  } else if constexpr (Lanes32<T>::kE8M0) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __mmask16 sub = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(normal, sub, _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e)));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// A table's 16 values (plus `plus`) in every 128-bit lane, for vpshufb.
PAGODA_AVX512 inline __m512i lanes_table(const int8_t* table, int plus) {
  return _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table))),
                         _mm512_set1_epi8(static_cast<char>(plus)));
}

// Channel c's 32 nibbles qs (byte k's low nibble value k, its high one k + 16) into the
// repacked nibbles at codes, and back.
inline void x32_pack_nibbles(const uint8_t* qs, int c, uint8_t* codes) {
  auto nibble = [&](int k) { return k < 16 ? qs[k] & 0x0F : qs[k - 16] >> 4; };
  for (int q = 0; q < 4; ++q)
    for (int i = 0; i < 4; ++i)
      codes[64 * q + 4 * c + i] = static_cast<uint8_t>(nibble(8 * q + i) | (nibble(8 * q + 4 + i) << 4));
}
inline void x32_unpack_nibbles(const uint8_t* codes, int c, uint8_t* qs) {
  std::memset(qs, 0, 16);
  auto put = [&](int k, uint8_t v) { qs[k % 16] |= static_cast<uint8_t>(k < 16 ? v : v << 4); };
  for (int q = 0; q < 4; ++q)
    for (int i = 0; i < 4; ++i) {
      const uint8_t b = codes[64 * q + 4 * c + i];
      put(8 * q + i, b & 0x0F);
      put(8 * q + 4 + i, b >> 4);
    }
}

// Scale ib (0-7) of an IQ4_XS block p (6 bits: low 4 in scales_l, high 2 in scales_h).
inline int iq4xs_scale(const uint8_t* p, int ib) {
  return ((p[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((p[2] | (p[3] << 8)) >> (2 * ib) & 3) << 4);
}

// 16 channels' blocks of the plain type (src[c]) -> one repacked block (IQ4_XS: one block
// of 256 inputs -> its 8 repacked blocks).
template <int T>
void x32_pack_block(const uint8_t* const* src, uint8_t* dst) {
  using L = Lanes32<T>;
  if constexpr (L::kSuper) {
    for (int c = 0; c < 16; ++c) {
      std::memcpy(dst + 2 * c, src[c], 2);
      for (int ib = 0; ib < 8; ++ib) {
        dst[32 + 16 * ib + c] = static_cast<uint8_t>(iq4xs_scale(src[c], ib) - 32);
        x32_pack_nibbles(src[c] + 8 + 16 * ib, c, dst + L::kCodes + 256 * ib);
      }
    }
    return;
  }
  if constexpr (L::kHigh) std::memset(dst + L::kCodes + 256, 0, 64);
  for (int c = 0; c < 16; ++c) {
    const uint8_t* p = src[c];
    std::memcpy(dst + L::kScaleBytes * c, p, L::kScaleBytes);
    if constexpr (L::kMin) std::memcpy(dst + 32 + 2 * c, p + 2, 2);
    const uint8_t* qs = p + L::kHead + (L::kHigh ? 4 : 0);
    if constexpr (L::kNibbles) {
      x32_pack_nibbles(qs, c, dst + L::kCodes);
    } else {
      for (int k = 0; k < 8; ++k) std::memcpy(dst + L::kCodes + 64 * k + 4 * c, qs + 4 * k, 4);
    }
    if constexpr (L::kHigh) {  // value k's fifth bit: bit k of qh; in row kk = 2q + half, byte 4c + i
      uint32_t qh;
      std::memcpy(&qh, p + L::kHead, 4);
      for (int kk = 0; kk < 8; ++kk)
        for (int i = 0; i < 4; ++i) {
          const int k = 8 * (kk / 2) + 4 * (kk % 2) + i;
          if ((qh >> k) & 1) dst[L::kCodes + 256 + 8 * kk + (4 * c + i) / 8] |= static_cast<uint8_t>(1 << ((4 * c + i) % 8));
        }
    }
  }
}

// Channel c of a repacked block -> its plain block, byte for byte the original.
template <int T>
void x32_unpack_block(const uint8_t* src, int c, uint8_t* p) {
  using L = Lanes32<T>;
  if constexpr (L::kSuper) {
    std::memcpy(p, src + 2 * c, 2);
    uint16_t sh = 0;
    std::memset(p + 4, 0, 4);
    for (int ib = 0; ib < 8; ++ib) {
      const int ls = static_cast<int8_t>(src[32 + 16 * ib + c]) + 32;
      p[4 + ib / 2] |= static_cast<uint8_t>((ls & 0x0F) << (4 * (ib % 2)));
      sh = static_cast<uint16_t>(sh | ((ls >> 4) << (2 * ib)));
      x32_unpack_nibbles(src + L::kCodes + 256 * ib, c, p + 8 + 16 * ib);
    }
    std::memcpy(p + 2, &sh, 2);
    return;
  }
  std::memcpy(p, src + L::kScaleBytes * c, L::kScaleBytes);
  if constexpr (L::kMin) std::memcpy(p + 2, src + 32 + 2 * c, 2);
  uint8_t* qs = p + L::kHead + (L::kHigh ? 4 : 0);
  if constexpr (L::kNibbles) {
    x32_unpack_nibbles(src + L::kCodes, c, qs);
  } else {
    for (int k = 0; k < 8; ++k) std::memcpy(qs + 4 * k, src + L::kCodes + 64 * k + 4 * c, 4);
  }
  if constexpr (L::kHigh) {
    uint32_t qh = 0;
    for (int kk = 0; kk < 8; ++kk)
      for (int i = 0; i < 4; ++i) {
        const int k = 8 * (kk / 2) + 4 * (kk % 2) + i;
        qh |= static_cast<uint32_t>((src[L::kCodes + 256 + 8 * kk + (4 * c + i) / 8] >> ((4 * c + i) % 8)) & 1) << k;
      }
    std::memcpy(p + L::kHead, &qh, 4);
  }
}

// Row kk of a repacked Q5_0 / Q5_1 block's values v (its nibbles) with the fifth bits
// (high: the block's 64 bytes of them) added: 16 more in the bytes whose bit is set.
PAGODA_AVX512 inline __m512i lanes_fifth(__m512i v, const uint8_t* high, int kk) {
  uint64_t m;
  std::memcpy(&m, high + 8 * kk, 8);
  return _mm512_mask_add_epi8(v, _cvtu64_mask64(m), v, _mm512_set1_epi8(16));
}

// y[(r0 + r) * N + col + c] for rows r < R of x (quantized in groups of 32) and the 16
// channels of the repacked group at grp: per block, 8 rows of unsigned values, per row
// of x 8 vpdpbusd (two chains) against its inputs four at a time.
template <int T, int R>
PAGODA_AVX512 __attribute__((noinline)) void x32_rows(const QuantizedX& xq, int64_t K, int64_t r0,
                                                        const uint8_t* grp, const float* bias, float* y, int64_t N,
                                                        int64_t col) {
  using L = Lanes32<T>;
  const int64_t nb = K / 32;
  const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i table = L::kTable ? lanes_table(L::table(), L::kOffset) : m4;
  const int8_t* xr[R];
  const float* dr[R];
  const int16_t* hr[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = xq.q.data() + (r0 + r) * K;
    dr[r] = xq.d.data() + (r0 + r) * nb;
    hr[r] = xq.h32.data() + (r0 + r) * nb;
  }
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* codes = L::codes(grp, b);
    // A block's bytes from its first (its scales; IQ4_XS: its values, the super-block's
    // head prefetched with its first block's far ahead of it).
    const char* pc = reinterpret_cast<const char*>(L::kSuper ? codes : grp + b * L::kBytes);
    for (int64_t i = 0; i < (L::kSuper ? 256 : L::kBytes); i += 64) {
      _mm_prefetch(pc + kX16FarAhead + i, _MM_HINT_T1);
      _mm_prefetch(pc + kX16Ahead + i, _MM_HINT_T0);
    }
    if constexpr (L::kSuper)
      if (b % 8 == 0)
        for (int i = 0; i < 160; i += 64) _mm_prefetch(reinterpret_cast<const char*>(L::head(grp, b + 8)) + i, _MM_HINT_T0);
    __m512i v[8];
    if constexpr (L::kNibbles) {
      for (int q = 0; q < 4; ++q) {
        const __m512i raw = _mm512_loadu_si512(codes + 64 * q);
        v[2 * q] = _mm512_and_si512(raw, m4);
        v[2 * q + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        if constexpr (L::kTable) {
          v[2 * q] = _mm512_shuffle_epi8(table, v[2 * q]);
          v[2 * q + 1] = _mm512_shuffle_epi8(table, v[2 * q + 1]);
        }
      }
      if constexpr (L::kHigh)  // the fifth bits: 16 more where set
        for (int kk = 0; kk < 8; ++kk) v[kk] = lanes_fifth(v[kk], L::high(grp, b), kk);
    } else {
      for (int k = 0; k < 8; ++k) v[k] = _mm512_xor_si512(_mm512_loadu_si512(codes + 64 * k), flip);
    }
    __m512i s[R], t[R];
    for (int r = 0; r < R; ++r) {
      s[r] = t[r] = _mm512_setzero_si512();
      const int8_t* xb = xr[r] + 32 * b;
      for (int kk = 0; kk < 8; kk += 2) {
        s[r] = _mm512_dpbusd_epi32(s[r], v[kk], bcast32(xb + 4 * kk));
        t[r] = _mm512_dpbusd_epi32(t[r], v[kk + 1], bcast32(xb + 4 * kk + 4));
      }
    }
    const __m512 d = lanes_scale<T>(grp, b);
    for (int r = 0; r < R; ++r) {
      __m512i isum = _mm512_add_epi32(s[r], t[r]);
      if constexpr (L::kOffset != 0) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(L::kOffset * hr[r][b]));
      const float dx = dr[r][b];
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(isum), acc[r]);
      if constexpr (L::kMin) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(L::head(grp, b) + 32)));
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dx * static_cast<float>(hr[r][b])), acc[r]);
      }
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (r0 + r) * N + col, bias ? _mm512_add_ps(acc[r], bv) : acc[r]);
}

// x's per-block terms for the AMX kernel (x quantized in groups of 32, M rows): in groups
// of 16 rows, [group][block][row] dx (xq.t32d) and, for Q4_1, dx x sum(x) (xq.t32o); rows
// past M zeros.
void amx_rows32(QuantizedX& xq, int64_t M, int64_t K, bool offsets) {
  const int64_t G = (M + 15) / 16, nb = K / 32;
  xq.t32d.assign(G * nb * 16, 0.f);
  if (offsets) xq.t32o.assign(G * nb * 16, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    float* td = xq.t32d.data() + (m / 16) * nb * 16 + m % 16;
    const float* dx = xq.d.data() + m * nb;
    for (int64_t b = 0; b < nb; ++b) td[16 * b] = dx[b];
    if (offsets) {
      float* to = xq.t32o.data() + (m / 16) * nb * 16 + m % 16;
      const int16_t* h = xq.h32.data() + m * nb;
      for (int64_t b = 0; b < nb; ++b) to[16 * b] = dx[b] * static_cast<float>(h[b]);
    }
  }
}

// ldtilecfg for x32_amx_rows: tiles 0-1 the sums (16 x 16 int32), 2-3 A (16 rows of 32
// inputs), 4-5 B (8 rows of 16 channels' four values).
PAGODA_AMX inline void amx_config32() {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) {
    cfg.rows[t] = t >= 4 ? 8 : kAmxRows;
    cfg.colsb[t] = t == 2 || t == 3 ? 32 : 64;
  }
  _tile_loadconfig(&cfg);
}

// Block b's sums c (16 rows x 16 channels, int32) of one group of 16 rows into acc: per
// row r, acc[r] += (d dx) c[r] (Q4_1, Q5_1: then += m (dx sum x)); td / to: the rows' terms
// of this block (xq.t32d / t32o).
template <int T>
PAGODA_AMX inline void x32_amx_take(const uint8_t* grp, int64_t b, const float* td, const float* to,
                                    const int32_t* c, __m512 (&acc)[kAmxRows]) {
  const __m512 d = lanes_scale<T>(grp, b);
  for (int r = 0; r < kAmxRows; ++r)
    acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(td[r])), _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r)),
                             acc[r]);
  if constexpr (Lanes32<T>::kMin) {
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(Lanes32<T>::head(grp, b) + 32)));
    for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(to[r]), acc[r]);
  }
}

// One group of 16 channels (grp; its blocks' B tiles at bm, 512 bytes a block, or, for
// Q8_0, in the group's own bytes) against 16 rows of x (x: stride K; td / to: their terms,
// xq.t32d / t32o's group): out[16 r + c] = row r's sum of channel c. Two blocks a pass,
// the second's tile product running while the first's sums are taken.
template <int T>
PAGODA_AMX __attribute__((noinline)) void x32_amx_rows(const int8_t* x, int64_t K, const uint8_t* grp,
                                                       const uint8_t* bm, const float* td, const float* to,
                                                       float* out, AmxScratch& sc) {
  using L = Lanes32<T>;
  const int64_t nb = K / 32;
  __m512 acc[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* bq = L::kNibbles ? bm : grp + L::kCodes;  // block b's B tile: bq + b * bstep
  const int64_t bstep = L::kNibbles ? 512 : L::kBytes;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, x + 32 * b, K);
    _tile_loadd(4, bq + b * bstep, 64);
    _tile_loadd(3, x + 32 * b + 32, K);
    _tile_loadd(5, bq + (b + 1) * bstep, 64);
    if constexpr (L::kMin) {
      _tile_dpbsud(0, 2, 4);
      _tile_dpbsud(1, 3, 5);
    } else {
      _tile_dpbssd(0, 2, 4);
      _tile_dpbssd(1, 3, 5);
    }
    _tile_stored(0, sc.c[0], 64);
    x32_amx_take<T>(grp, b, td + 16 * b, to ? to + 16 * b : nullptr, sc.c[0], acc);
    _tile_stored(1, sc.c[1], 64);
    x32_amx_take<T>(grp, b + 1, td + 16 * b + 16, to ? to + 16 * b + 16 : nullptr, sc.c[1], acc);
  }
  if (b < nb) {
    _tile_zero(0);
    _tile_loadd(2, x + 32 * b, K);
    _tile_loadd(4, bq + b * bstep, 64);
    if constexpr (L::kMin) {
      _tile_dpbsud(0, 2, 4);
    } else {
      _tile_dpbssd(0, 2, 4);
    }
    _tile_stored(0, sc.c[0], 64);
    x32_amx_take<T>(grp, b, td + 16 * b, to ? to + 16 * b : nullptr, sc.c[0], acc);
  }
  for (int r = 0; r < kAmxRows; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

// Channels [n0, n1) (multiples of 16) of a repacked 32-weight part for rows [m0, m1) (m0 a
// multiple of 16; xq's terms laid out by amx_rows32) on the tiles: per group of 16
// channels the B tiles of its every block made once (nibbles split; Q4_0's less 8),
// then every 16 rows over them.
template <int T>
PAGODA_AMX void x32_amx_tile(const QuantizedX& xq, int64_t m0, int64_t m1, int64_t K, const Part& w, int64_t n0,
                             int64_t n1, const float* bias, float* y, int64_t N, AmxScratch& sc) {
  using L = Lanes32<T>;
  const int64_t nb = K / 32, M = m1 - m0, full_end = m0 + M / kAmxRows * kAmxRows;
  amx_config32();
  amx_pad_rows(xq, full_end, m1, K, sc);
  if constexpr (L::kNibbles) sc.b32.resize(nb * 512);
  const __m512i m4 = _mm512_set1_epi8(0x0F), offset = _mm512_set1_epi8(static_cast<char>(L::kOffset));
  const __m512i table = L::kTable ? lanes_table(L::table(), 0) : m4;
  alignas(64) float out[kAmxRows * 16];
  for (int64_t n = n0; n < n1; n += 16) {
    const uint8_t* grp = w.data + n * w.row_bytes;
    if constexpr (L::kNibbles)
      for (int64_t b = 0; b < nb; ++b)
        for (int q = 0; q < 4; ++q) {
          const __m512i raw = _mm512_loadu_si512(L::codes(grp, b) + 64 * q);
          __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
          if constexpr (L::kHigh) {  // Q5_0 / Q5_1: the fifth bits
            lo = lanes_fifth(lo, L::high(grp, b), 2 * q);
            hi = lanes_fifth(hi, L::high(grp, b), 2 * q + 1);
          }
          if constexpr (L::kTable) {  // the table's signed values
            lo = _mm512_shuffle_epi8(table, lo);
            hi = _mm512_shuffle_epi8(table, hi);
          } else if constexpr (L::kOffset != 0) {  // Q4_0's nibbles less 8, Q5_0's values less 16
            lo = _mm512_sub_epi8(lo, offset);
            hi = _mm512_sub_epi8(hi, offset);
          }
          _mm512_storeu_si512(sc.b32.data() + 512 * b + 128 * q, lo);
          _mm512_storeu_si512(sc.b32.data() + 512 * b + 128 * q + 64, hi);
        }
    const int64_t col = w.col + n;
    const __m512 bv = bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
    for (int64_t r = m0; r < m1; r += kAmxRows) {
      const int64_t g = r / kAmxRows;
      const float* to = L::kMin ? xq.t32o.data() + g * nb * 16 : nullptr;
      x32_amx_rows<T>(r < full_end ? xq.q.data() + r * K : sc.x.data(), K, grp, sc.b32.data(),
                      xq.t32d.data() + g * nb * 16, to, out, sc);
      for (int64_t i = 0; i < std::min<int64_t>(kAmxRows, m1 - r); ++i) {
        const __m512 a = _mm512_load_ps(out + 16 * i);
        _mm512_storeu_ps(y + (r + i) * N + col, bias ? _mm512_add_ps(a, bv) : a);
      }
    }
  }
  _tile_release();
}

// Channels [n0, n1) of a repacked 32-weight part for rows [m0, m1): four rows at a time
// on the VNNI kernel, then the rest.
template <int T>
PAGODA_AVX512 void x32_tile_t(const QuantizedX& xq, int64_t m0, int64_t m1, int64_t K, const Part& w, int64_t n0,
                              int64_t n1, const float* bias, float* y, int64_t N) {
  for (int64_t n = n0; n < n1; n += 16) {
    const uint8_t* grp = w.data + n * w.row_bytes;
    const int64_t col = w.col + n;
    int64_t r = m0;
    for (; r + 4 <= m1; r += 4) x32_rows<T, 4>(xq, K, r, grp, bias, y, N, col);
    switch (m1 - r) {
      case 3: x32_rows<T, 3>(xq, K, r, grp, bias, y, N, col); break;
      case 2: x32_rows<T, 2>(xq, K, r, grp, bias, y, N, col); break;
      case 1: x32_rows<T, 1>(xq, K, r, grp, bias, y, N, col); break;
      default: break;
    }
  }
}

// f(integral_constant<int, T>) for a repacked 32-weight type T.
template <typename F>
void with_x32_type(int type, F&& f) {
  switch (type) {
    case kQ40X16: f(std::integral_constant<int, kQ40X16>{}); return;
    case kQ41X16: f(std::integral_constant<int, kQ41X16>{}); return;
    case kQ80X16: f(std::integral_constant<int, kQ80X16>{}); return;
    case kIQ4NLX16: f(std::integral_constant<int, kIQ4NLX16>{}); return;
    case kMXFP4X16: f(std::integral_constant<int, kMXFP4X16>{}); return;
    case kQ50X16: f(std::integral_constant<int, kQ50X16>{}); return;
    case kQ51X16: f(std::integral_constant<int, kQ51X16>{}); return;
    case kIQ4XSX16: f(std::integral_constant<int, kIQ4XSX16>{}); return;
    default: TORCH_CHECK(false, "not a repacked 32-weight type: ", type);
  }
}

void x32_tile(const QuantizedX& xq, int64_t m0, int64_t m1, int64_t K, const Part& w, int64_t n0, int64_t n1,
              const float* bias, float* y, int64_t N, AmxScratch& amx) {
  const bool tiles = !xq.t32d.empty() && m1 - m0 >= kAmxMinRows;
  with_x32_type(w.type, [&](auto tt) {
    constexpr int T = decltype(tt)::value;
    if (tiles)
      x32_amx_tile<T>(xq, m0, m1, K, w, n0, n1, bias, y, N, amx);
    else
      x32_tile_t<T>(xq, m0, m1, K, w, n0, n1, bias, y, N);
  });
}

// The plain type of a repacked one.
int64_t lanes_plain(int type) {
  int64_t plain = -1;
  if (is_x16(type))
    with_x16_type(type, [&](auto kt) { plain = Lanes16<decltype(kt)::value>::kPlain; });
  else
    with_x32_type(type, [&](auto tt) { plain = Lanes32<decltype(tt)::value>::kPlain; });
  return plain;
}

// Row n of a repacked part as its plain row (the file's bytes) into out.
void lanes_unpack_row(const Part& w, int64_t n, int64_t K, uint8_t* out) {
  if (is_x16(w.type)) return x16_unpack_row(w, n, K, out);
  const uint8_t* g = w.data + (n / 16) * 16 * w.row_bytes;
  const int c = static_cast<int>(n % 16);
  with_x32_type(w.type, [&](auto tt) {
    using L = Lanes32<decltype(tt)::value>;
    if constexpr (L::kSuper)  // a block of 256 inputs at a time
      for (int64_t b = 0; b < K / 256; ++b) x32_unpack_block<decltype(tt)::value>(g + b * 2208, c, out + b * 136);
    else
      for (int64_t b = 0; b < K / 32; ++b) x32_unpack_block<decltype(tt)::value>(g + b * L::kBytes, c, out + b * L::kPlainBytes);
  });
}

PartKinds part_kinds(const std::vector<Part>& parts) {
  PartKinds out;
  for (const Part& p : parts) {
    if (is_x32(p.type))
      out.x32 = true, out.min |= p.type == kQ41X16 || p.type == kQ51X16;
    else if (is_x16(p.type))
      out.k = true;
    else if (has_k_kernel(p.type))
      out.k = out.rows = true;
    else
      out.other = true;
  }
  return out;
}

// Channels [n0, n1) (multiples of 16) of a repacked part for rows [m0, m1): each group of
// 16 channels against four rows at a time, then the rest.
template <int KT>
PAGODA_AVX512 void x16_tile_t(const QuantizedX& xq, int64_t m0, int64_t m1, int64_t K, const Part& w, int64_t n0,
                              int64_t n1, const float* bias, float* y, int64_t N) {
  constexpr bool Q6 = KT == kQ6KX16 || KT == kQ3KX16 || KT == kQ2KX16;  // Q6_K_X16's shape
  auto rows = [&](auto rr, int64_t r, const uint8_t* grp, int64_t col) {
    if constexpr (Q6)
      x16_q6k_rows<decltype(rr)::value, KT>(xq, K, r, grp, bias, y, N, col);
    else
      x16_rows<decltype(rr)::value, KT == kQ5KX16>(xq, K, r, grp, bias, y, N, col);
  };
  for (int64_t n = n0; n < n1; n += 16) {
    const uint8_t* grp = w.data + n * w.row_bytes;
    const int64_t col = w.col + n;
    int64_t r = m0;
    if constexpr (Q6)
      for (; r + 8 <= m1; r += 8) rows(std::integral_constant<int, 8>{}, r, grp, col);
    for (; r + 4 <= m1; r += 4) rows(std::integral_constant<int, 4>{}, r, grp, col);
    switch (m1 - r) {
      case 3: rows(std::integral_constant<int, 3>{}, r, grp, col); break;
      case 2: rows(std::integral_constant<int, 2>{}, r, grp, col); break;
      case 1: rows(std::integral_constant<int, 1>{}, r, grp, col); break;
      default: break;
    }
  }
}

void x16_tile(const QuantizedX& xq, int64_t m0, int64_t m1, int64_t K, const Part& w, int64_t n0, int64_t n1,
              const float* bias, float* y, int64_t N, AmxScratch& amx) {
  auto run = [&](auto kt) {
    constexpr int KT = decltype(kt)::value;
    if (xq.amx && m1 - m0 >= kAmxMinRows)
      x16_amx_tile<KT>(xq, m0, m1, K, w, n0, n1, bias, y, N, amx);
    else
      x16_tile_t<KT>(xq, m0, m1, K, w, n0, n1, bias, y, N);
  };
  with_x16_type(w.type, run);
}

// y for rows [r0, r0 + MR) and decoded channels [c0, c0 + NC), int8 products.
template <int T, int MR, int NC>
void int8_dot(const QuantizedX& xq, int64_t K, int64_t r0, const DecodedRows& dr, int c0, const Part& w,
              int64_t n0, const float* bias, float* y, int64_t N) {
  constexpr int sub = sub_block_of(T);
  const __m256i ones = _mm256_set1_epi16(1);
  Sums<MR, NC> sums;
  auto& acc = sums.acc;
  auto& off = sums.off;
  for (int64_t g = 0; g < K / 32; ++g) {
    __m256i qs[NC], u[NC];
    for (int o = 0; o < NC; ++o) {
      qs[o] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dr.qc(c0 + o) + 32 * g));
      u[o] = _mm256_abs_epi8(qs[o]);
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t row = r0 + r;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + row * K + 32 * g));
      const int64_t gi = row * (K / 32) + g;
      const float dx = xq.d[gi];
      for (int o = 0; o < NC; ++o) {
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u[o], _mm256_sign_epi8(xv, qs[o])), ones);
        const float* a = dr.ac(c0 + o);
        __m256 scale;
        if constexpr (sub == 32)
          scale = _mm256_set1_ps(a[g] * dx);
        else  // int32 lanes 0-3 hold inputs 0-15 (sub-block 2g), lanes 4-7 inputs 16-31
          scale = _mm256_set_m128(_mm_set1_ps(a[2 * g + 1] * dx), _mm_set1_ps(a[2 * g] * dx));
        acc[r][o] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p), acc[r][o]);
        if constexpr (has_offset(T)) {
          const int32_t* s16 = xq.s16.data() + 2 * gi;
          const float* b = dr.bc(c0 + o);
          if constexpr (sub == 32)
            off[r][o] += b[g] * (dx * static_cast<float>(s16[0] + s16[1]));
          else
            off[r][o] += b[2 * g] * (dx * static_cast<float>(s16[0])) + b[2 * g + 1] * (dx * static_cast<float>(s16[1]));
        }
      }
    }
  }
  sums.store(y, N, r0, w.col + n0 + c0, bias);
}

// int8_dot for a block32 type without decoded rows: the NC channels' blocks are read
// and decoded in registers as the products go (steps of few rows, where decoding whole
// rows first cost more than the products). The same values and the same operations in
// the same order as int8_dot: the same bits. (The row loop is int8_dot's, written out
// again: shared through an inline helper taking the values by pointer, the one-row
// product ran at 0.5-0.7x this speed, its registers spilled.)
template <int T, int MR, int NC>
void int8_dot32(const QuantizedX& xq, int64_t K, int64_t r0, const Part& w, int64_t n0, int c0, const float* bias,
                float* y, int64_t N) {
  const int64_t bytes = format_of(T).bytes;
  constexpr bool kUnsigned = T == kQ4_1 || T == kQ5_1;  // values 0..15 / 0..31
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* rows[NC];
  for (int o = 0; o < NC; ++o) rows[o] = w.data + (n0 + c0 + o) * w.row_bytes;
  Sums<MR, NC> sums;
  auto& acc = sums.acc;
  auto& off = sums.off;
  for (int64_t g = 0; g < K / 32; ++g) {
    __m256i qs[NC], u[NC];
    float a[NC], b[NC];
    for (int o = 0; o < NC; ++o) {
      const uint8_t* p = rows[o] + g * bytes;
      qs[o] = block32_values<T>(p);
      if constexpr (!kUnsigned) u[o] = _mm256_abs_epi8(qs[o]);
      a[o] = block32_scale<T>(p);
      if constexpr (has_offset(T)) b[o] = block32_offset<T>(p, a[o]);
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t row = r0 + r;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + row * K + 32 * g));
      const int64_t gi = row * (K / 32) + g;
      const float dx = xq.d[gi];
      float xo = 0.f;  // the offset's factor, the same for every channel
      if constexpr (has_offset(T)) {
        const int32_t* s16 = xq.s16.data() + 2 * gi;
        xo = dx * static_cast<float>(s16[0] + s16[1]);
      }
      for (int o = 0; o < NC; ++o) {
        // Values of 0..31 multiply x as they are (maddubs takes them unsigned); signed
        // ones lend x their sign. The same integers either way.
        const __m256i prod = kUnsigned ? _mm256_maddubs_epi16(qs[o], xv)
                                       : _mm256_maddubs_epi16(u[o], _mm256_sign_epi8(xv, qs[o]));
        const __m256i p = _mm256_madd_epi16(prod, ones);
        acc[r][o] = _mm256_fmadd_ps(_mm256_set1_ps(a[o] * dx), _mm256_cvtepi32_ps(p), acc[r][o]);
        if constexpr (has_offset(T)) off[r][o] += b[o] * xo;
      }
    }
  }
  sums.store(y, N, r0, w.col + n0 + c0, bias);
}

// Steps of up to this many rows multiply block32 types with int8_dot32 (no decoded rows).
constexpr int64_t kDirect32Rows = 2;

}  // namespace

torch::Tensor gguf_dequantize(torch::Tensor data, int64_t type, int64_t K, c10::optional<torch::Tensor> rows) {
  const std::vector<Part> parts = check_parts({data}, {type}, K);
  const Part& w = parts[0];
  const int64_t* idx = nullptr;
  int64_t R = w.rows;
  torch::Tensor index;
  if (rows.has_value() && rows->defined()) {
    index = rows->to(torch::kInt64).contiguous();
    idx = index.data_ptr<int64_t>();
    R = index.numel();
    for (int64_t i = 0; i < R; ++i)
      TORCH_CHECK(idx[i] >= 0 && idx[i] < w.rows, "row index ", idx[i], " out of range for ", w.rows, " rows");
  }
  auto y = torch::empty({R, K}, torch::kFloat32);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    const bool x16 = is_lanes(w.type);
    const int64_t plain = x16 ? lanes_plain(w.type) : w.type;
    Buffer<uint8_t> row(x16 ? K / format_of(plain).block * format_of(plain).bytes : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t src = idx ? idx[r] : r;
      if (x16) {  // the channel's row in the file's layout again, then dequantized as such
        lanes_unpack_row(w, src, K, row.data());
        dequantize_row(static_cast<int>(plain), row.data(), K, yp + r * K);
      } else {
        dequantize_row(w.type, w.data + src * w.row_bytes, K, yp + r * K);
      }
    }
  });
  return y;
}

torch::Tensor gguf_repack_x16(torch::Tensor data, int64_t type, int64_t K) {
  static const std::pair<int64_t, int> kLanes[] = {
      {kQ4_K, kQ4KX16}, {kQ6_K, kQ6KX16}, {kQ4_0, kQ40X16}, {kQ4_1, kQ41X16}, {kQ8_0, kQ80X16},
      {kIQ4_NL, kIQ4NLX16}, {kMXFP4, kMXFP4X16}, {kQ5_K, kQ5KX16}, {kQ3_K, kQ3KX16}, {kQ2_K, kQ2KX16},
      {kQ5_0, kQ50X16}, {kQ5_1, kQ51X16}, {kIQ4_XS, kIQ4XSX16}};
  int lanes = -1;
  for (const auto& [plain, packed] : kLanes)
    if (plain == type) lanes = packed;
  TORCH_CHECK(lanes >= 0, "only Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS and MXFP4 "
              "repack with 16 channels in the lanes, not type ", type);
  const std::vector<Part> parts = check_parts({data}, {type}, K);
  const Part& w = parts[0];
  TORCH_CHECK(w.rows % 16 == 0, "repacking needs a multiple of 16 channels, not ", w.rows);
  // bytes: a channel's block in the file; packed: in the repacked layout (16 of them a group).
  const BlockFormat f = format_of(type);
  const int64_t nb = K / f.block, bytes = f.bytes, packed = format_of(lanes).bytes;
  auto out = torch::empty({w.rows, nb * packed}, torch::kUInt8);
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, w.rows / 16, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* src[16];
        for (int c = 0; c < 16; ++c) src[c] = w.data + (16 * g + c) * w.row_bytes + b * bytes;
        uint8_t* dst = op + (g * nb + b) * 16 * packed;
        if (is_x16(lanes))
          with_x16_type(lanes, [&](auto kt) { Lanes16<decltype(kt)::value>::pack(src, dst); });
        else
          with_x32_type(lanes, [&](auto tt) { x32_pack_block<decltype(tt)::value>(src, dst); });
      }
  });
  return out;
}

namespace {

// A linear layer's call, checked: x [M, K] float32 (contiguous), the weight's parts, the
// output width N and the bias (or null).
struct LinearCall {
  torch::Tensor x;
  std::vector<Part> parts;
  int64_t M, K, N;
  const float* bias;
};

LinearCall check_linear(torch::Tensor x, const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& types,
                        const c10::optional<torch::Tensor>& bias, int64_t k_multiple) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  LinearCall c{x.contiguous(), {}, x.size(0), x.size(1), 0, nullptr};
  TORCH_CHECK(c.K % k_multiple == 0, "in_features must be a multiple of ", k_multiple, ", got ", c.K);
  c.parts = check_parts(weights, types, c.K);
  c.N = c.parts.back().col + c.parts.back().rows;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == c.N && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous(),
                "bias must be contiguous float32 [out_features]");
    c.bias = bias->data_ptr<float>();
  }
  return c;
}

}  // namespace

namespace {

// gguf_linear's small steps (M <= kSmallSteps rows): tiles of output channels, and the
// rows of one tile kept per thread.
// A thread's scratch for small_step_tile.
struct FloatScratch {
  std::vector<float> buf;
};

std::vector<Tile> small_step_tiles(const std::vector<Part>& parts, int64_t M, int64_t K, int64_t* per_tile) {
  *per_tile = std::max<int64_t>(3, (24576 / (4 * K)) / 3 * 3);
  std::vector<Tile> tiles;
  for (size_t p = 0; p < parts.size(); ++p) {
    const int64_t step = tiles_only(parts[p].type) || M > kDirectRows ? *per_tile : 8;
    for (int64_t n0 = 0; n0 < parts[p].rows; n0 += step)
      tiles.push_back({static_cast<int>(p), n0, std::min(parts[p].rows, n0 + step)});
  }
  return tiles;
}

// One such tile: block types up to kDirectRows rows multiply from decoded rows (xs: the
// sums of x per 16, group_sums16; direct_tile prefetches as it goes), otherwise the
// tile's rows are dequantized to float32 (about 24 KiB) for the float32 micro-kernel.
void small_step_tile(const float* xp, int64_t M, int64_t K, const Part& w, const Tile& tile, const float* xs,
                     const float* bp, float* yp, int64_t N, int64_t per_tile, std::vector<float>& buf) {
  if (!tiles_only(w.type) && M <= kDirectRows) {
    direct_tile(xp, M, K, w, tile.n0, tile.n1, xs, bp, yp, N);
    return;
  }
  prefetch_rows(w, tile.n0 + 4 * (tile.n1 - tile.n0), tile.n0 + 5 * (tile.n1 - tile.n0));
  buf.resize(per_tile * K);
  for (int64_t n = tile.n0; n < tile.n1; ++n)
    dequantize_row(w.type, w.data + n * w.row_bytes, K, buf.data() + (n - tile.n0) * K);
  f32_all_rows(xp, M, K, buf.data(), bp ? bp + w.col : nullptr, yp + w.col, N, tile.n0, tile.n1);
}

}  // namespace

torch::Tensor gguf_linear(torch::Tensor x_in, std::vector<torch::Tensor> weights, std::vector<int64_t> types,
                          c10::optional<torch::Tensor> bias) {
  const LinearCall call = check_linear(x_in, weights, types, bias, 8);
  for (const Part& p : call.parts)
    TORCH_CHECK(!is_lanes(p.type), "repacked weights multiply in the gguf mode only (gguf_linear_int8)");
  const torch::Tensor& x = call.x;
  const int64_t M = call.M, K = call.K, N = call.N;
  const std::vector<Part>& parts = call.parts;
  const float* bp = call.bias;
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M <= kSmallSteps) {
    // Block types up to kDirectRows rows: products from decoded rows, tiles of 8
    // channels. Otherwise tiles of rows dequantized to float32 (about 24 KiB) for the
    // float32 micro-kernel.
    // Sums of x per 16 inputs: only the decoded-row products use them.
    const std::vector<float> xs = M <= kDirectRows ? group_sums16(xp, M, K) : std::vector<float>{};
    int64_t per_tile;
    const std::vector<Tile> tiles = small_step_tiles(parts, M, K, &per_tile);
    for_each_unit<FloatScratch>(static_cast<int64_t>(tiles.size()), [&](int64_t t, FloatScratch& sc) {
      small_step_tile(xp, M, K, parts[tiles[t].part], tiles[t], xs.data(), bp, yp, N, per_tile, sc.buf);
    });
    return y;
  }
  // Panels of 64-256 channels (up to 4 MiB of float32 weights), each multiplied by BLAS in
  // one call: BLAS packs x again for every call, which panels of 256 KiB amortized poorly
  // (the 1B file's layers, two threads: 32 rows 1.1x, 128 rows 1.2x, 512 rows 1.4x faster
  // than 256 KiB panels; the same bits).
  // At least two panels a thread, so that the threads' shares come out about even.
  const int64_t even = (N + 2 * at::get_num_threads() - 1) / (2 * at::get_num_threads());
  const int64_t per_panel =
      std::min(std::clamp<int64_t>((int64_t{1} << 20) / K, 64, 256), std::max<int64_t>(16, (even + 15) / 16 * 16));
  const std::vector<Tile> panels = tiles_of(parts, per_panel);
  at::parallel_for(0, static_cast<int64_t>(panels.size()), 1, [&](int64_t t0, int64_t t1) {
    // Worker threads do not inherit the caller's inference mode, and y may be an inference tensor.
    c10::InferenceMode guard;
    auto buf = torch::empty({per_panel, K}, torch::kFloat32);
    for (int64_t t = t0; t < t1; ++t) {
      const Tile& tile = panels[t];
      const Part& w = parts[tile.part];
      const int64_t n = tile.n1 - tile.n0;
      for (int64_t i = 0; i < n; ++i)
        dequantize_row(w.type, w.data + (tile.n0 + i) * w.row_bytes, K, buf.data_ptr<float>() + i * K);
      const torch::Tensor panel = buf.narrow(0, 0, n);
      torch::Tensor out = y.narrow(1, w.col + tile.n0, n);
      if (bp)
        out.copy_(at::addmm(bias->narrow(0, w.col + tile.n0, n), x, panel.t()));
      else
        out.copy_(at::mm(x, panel.t()));
    }
  });
  return y;
}

// gguf_linear's small steps of block types (1 to kDirectRows rows) through
// direct_tile_reference, one thread: what the tests compare direct_tile's bits with.
torch::Tensor gguf_linear_direct_reference(torch::Tensor x_in, std::vector<torch::Tensor> weights,
                                           std::vector<int64_t> types, c10::optional<torch::Tensor> bias) {
  const LinearCall call = check_linear(x_in, weights, types, bias, 8);
  TORCH_CHECK(call.M >= 1 && call.M <= kDirectRows, "the reference covers steps of 1 to ", kDirectRows, " rows");
  auto y = torch::empty({call.M, call.N}, call.x.options());
  const std::vector<float> xs = group_sums16(call.x.data_ptr<float>(), call.M, call.K);
  DecodedRows dr;
  for (const Part& w : call.parts) {
    TORCH_CHECK(!is_float_type(w.type), "the reference covers block types");
    direct_tile_reference(call.x.data_ptr<float>(), call.M, call.K, w, 0, w.rows, xs.data(), call.bias,
                          y.data_ptr<float>(), call.N, dr);
  }
  return y;
}

namespace {

// A thread's scratch for int8_tile.
struct Int8Scratch {
  DecodedRows dr;
  VnniPanel vp;
  K2Panel kp;
  AmxScratch amx;
};

// Channels per tile of a Q4_K / Q6_K part in a step of M rows: two panels for the VNNI
// and the AVX2 panel kernels, 8 for a few rows (k_row8).
int64_t k_channels_per_tile(int64_t M, bool vnni) {
  return vnni ? 2 * kVnniChannels : M >= kPanelRows ? 2 * kPanel : M < kRow8MaxRows ? 8 : kChannels;
}

// What the K-quant kernels of a step of M rows read besides xk.q: the VNNI kernels' packed
// rows, or the AVX2 Q6_K panels' unsigned rows.
void k_rows_layout(QuantizedX& xk, int64_t M, int64_t K, bool vnni) {
  if (vnni)
    pack_rows16(xk, M, K);
  else if (panel_rows(M))
    unsigned_rows(xk);
}

// One tile of gguf_linear_int8: channels [tile.n0, tile.n1) of part w for rows [m0, m1).
void int8_tile(const QuantizedX& xq, const QuantizedX& xk, int64_t m0, int64_t m1, int64_t K, const Part& w,
               const Tile& tile, const float* bp, float* yp, int64_t N, Int8Scratch& sc) {
  DecodedRows& dr = sc.dr;
  if (is_lanes(w.type)) {
    TORCH_CHECK(cpu_has_avx512_vnni(), "repacked weights need an AVX-512 VNNI CPU");
    if (is_x32(w.type))
      x32_tile(xq, m0, m1, K, w, tile.n0, tile.n1, bp, yp, N, sc.amx);
    else
      x16_tile(xk, m0, m1, K, w, tile.n0, tile.n1, bp, yp, N, sc.amx);
    return;
  }
  if (has_k_kernel(w.type)) {
    if (!xk.p4.empty())  // packed for the VNNI kernels
      k_tile_vnni(xk, m0, m1, K, w, tile.n0, tile.n1, bp, yp, N, sc.vp);
    else if (panel_rows(m1 - m0))
      k_tile_panel(xk, m0, m1, K, w, tile.n0, tile.n1, bp, yp, N, sc.kp);
    else  // one stream of rows, which the hardware prefetchers follow
      k_tile(xk, m0, m1, K, w, tile.n0, tile.n1, bp, yp, N);
    return;
  }
  prefetch_rows(w, tile.n0 + 4 * (tile.n1 - tile.n0), tile.n0 + 5 * (tile.n1 - tile.n0));
  with_block_type(w.type, [&](auto tt) {
    constexpr int T = decltype(tt)::value;
    const int nc = static_cast<int>(tile.n1 - tile.n0);
    if constexpr (is_block32(T)) {
      if (m1 - m0 <= kDirect32Rows) {
        auto dot = [&](auto mr, auto ncc) {
          return [&, mr, ncc](int64_t r, int c) {
            int8_dot32<T, decltype(mr)::value, decltype(ncc)::value>(xq, K, r, w, tile.n0, c, bp, yp, N);
          };
        };
        using I1 = std::integral_constant<int, 1>;
        using I2 = std::integral_constant<int, 2>;
        using I4 = std::integral_constant<int, 4>;
        for_row_channel_blocks(m0, m1, nc, dot(I1{}, I4{}), dot(I1{}, I1{}), dot(I2{}, I2{}), dot(I2{}, I1{}));
        return;
      }
    }
    decode_rows<T>(w, tile.n0, nc, K, dr);
    auto dot = [&](auto mr, auto ncc) {
      return [&, mr, ncc](int64_t r, int c) {
        int8_dot<T, decltype(mr)::value, decltype(ncc)::value>(xq, K, r, dr, c, w, tile.n0, bp, yp, N);
      };
    };
    using I1 = std::integral_constant<int, 1>;
    using I2 = std::integral_constant<int, 2>;
    using I4 = std::integral_constant<int, 4>;
    for_row_channel_blocks(m0, m1, nc, dot(I1{}, I4{}), dot(I1{}, I1{}), dot(I2{}, I2{}), dot(I2{}, I1{}));
  });
}

}  // namespace

torch::Tensor gguf_linear_int8(torch::Tensor x_in, std::vector<torch::Tensor> weights, std::vector<int64_t> types,
                               c10::optional<torch::Tensor> bias) {
  const LinearCall call = check_linear(x_in, weights, types, bias, 32);
  const std::vector<Part>& parts = call.parts;
  for (const Part& p : parts)
    TORCH_CHECK(int8_type(p.type), "the int8 product needs quantized blocks of integers, not ggml type ", p.type);
  const torch::Tensor& x = call.x;
  const int64_t M = call.M, K = call.K, N = call.N;
  const float* bp = call.bias;
  auto y = torch::empty({M, N}, x.options());
  const PartKinds kinds = part_kinds(parts);
  QuantizedX xq = kinds.groups32() ? quantize_x(x.data_ptr<float>(), M, K) : QuantizedX{};
  if (kinds.x32 && xq.amx && M >= kAmxMinRows) amx_rows32(xq, M, K, kinds.min);
  QuantizedX xk = kinds.k ? quantize_x(x.data_ptr<float>(), M, K, 256) : QuantizedX{};
  const bool vnni = kinds.rows && vnni_k_rows(M);
  if (kinds.rows) k_rows_layout(xk, M, K, vnni);
  float* yp = y.data_ptr<float>();
  // Chunks of kRowChunk rows (their int8 x in L2 or L3); within a chunk, tiles of
  // kChannels output channels (the VNNI kernels' K-quant parts: 2 panels), decoded once,
  // that every row of the chunk runs over.
  const std::vector<Tile> tiles = tiles_of(parts, kChannels, k_channels_per_tile(M, vnni));
  // The AMX kernel makes its weights' tiles once per unit: longer chunks share them (where
  // every part is repacked; the other kernels keep a chunk's x in L2).
  const bool amx_only = (xk.amx || xq.amx) && M >= kAmxMinRows && !kinds.rows && !kinds.other;
  const int64_t chunk = amx_only ? kAmxRowChunk : kRowChunk;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m1 = std::min(M, m0 + chunk);
    for_each_unit<Int8Scratch>(static_cast<int64_t>(tiles.size()), [&](int64_t t, Int8Scratch& sc) {
      int8_tile(xq, xk, m0, m1, K, parts[tiles[t].part], tiles[t], bp, yp, N, sc);
    });
  }
  return y;
}

// ---- mixture of experts: every active expert of a layer in one call -------------------
// Tokens are grouped by expert; each expert's rows are multiplied as gguf_linear_int8 (the
// gguf mode) or gguf_linear (the exact mode) multiplies them (gate/up, then SiLU(gate) x up,
// then down), the work units of all experts sharing one parallel region per projection.
// Each token's output is the sum over its experts in expert order of weight x expert
// output, rounded as transformers (and pagoda's per-expert path) round it.

namespace {

// A MoE layer's call, checked, its tokens grouped by expert.
struct MoeCall {
  torch::Tensor x, ids, wts;
  int64_t T, H, E, k, I;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> rows;  // per expert: (token, slot), tokens in order
  const std::vector<torch::Tensor>& gate_up;
  const std::vector<int64_t>& gate_up_types;
  const std::vector<torch::Tensor>& down;
  const std::vector<int64_t>& down_types;
  std::vector<torch::Tensor> gate_up_bias, down_bias;  // per expert, float32, or none

  MoeCall(torch::Tensor x_in, torch::Tensor ids_in, torch::Tensor weights_in, const std::vector<torch::Tensor>& gu,
          const std::vector<int64_t>& gut, const std::vector<torch::Tensor>& dn, const std::vector<int64_t>& dnt,
          const std::vector<torch::Tensor>& gub, const std::vector<torch::Tensor>& dnb)
      : gate_up(gu), gate_up_types(gut), down(dn), down_types(dnt) {
    TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
    x = x_in.contiguous();
    ids = ids_in.to(torch::kInt64).contiguous();
    wts = weights_in.to(torch::kFloat32).contiguous();
    T = x.size(0), H = x.size(1), E = static_cast<int64_t>(dn.size());
    TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && wts.sizes() == ids.sizes(), "ids and weights must be [T, k]");
    TORCH_CHECK(static_cast<int64_t>(gu.size()) == 2 * E && gut.size() == gu.size() &&
                static_cast<int64_t>(dnt.size()) == E && E > 0, "two gate/up parts and one down part per expert");
    k = ids.size(1), I = gu[0].size(0);
    TORCH_CHECK(H % 32 == 0 && I % 32 == 0, "hidden and intermediate sizes must be multiples of 32");
    TORCH_CHECK(gub.size() == dnb.size() && (gub.empty() || static_cast<int64_t>(gub.size()) == E),
                "expert biases: none, or one gate/up and one down bias per expert");
    for (int64_t e = 0; e < static_cast<int64_t>(gub.size()); ++e) {
      TORCH_CHECK(gub[e].numel() == 2 * I && dnb[e].numel() == H, "expert ", e, "'s biases must have ", 2 * I,
                  " and ", H, " values");
      gate_up_bias.push_back(gub[e].to(torch::kFloat32).contiguous());
      down_bias.push_back(dnb[e].to(torch::kFloat32).contiguous());
    }
    const int64_t* ip = ids.data_ptr<int64_t>();
    rows.resize(E);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = ip[t * k + j];
        TORCH_CHECK(e >= 0 && e < E, "expert id ", e, " out of range for ", E, " experts");
        rows[e].push_back({t, j});
      }
  }

  std::vector<Part> gate_up_parts(int64_t e) const {
    auto parts = check_parts({gate_up[2 * e], gate_up[2 * e + 1]}, {gate_up_types[2 * e], gate_up_types[2 * e + 1]}, H);
    TORCH_CHECK(parts[0].rows == I && parts[1].rows == I, "expert ", e, "'s gate/up has the wrong shape");
    return parts;
  }

  std::vector<Part> down_parts(int64_t e) const {
    auto parts = check_parts({down[e]}, {down_types[e]}, I);
    TORCH_CHECK(parts[0].rows == H, "expert ", e, "'s down projection has the wrong shape");
    return parts;
  }

  // Expert e's gate/up (first) or down bias, or null.
  const float* bias(int64_t e, bool first) const {
    if (gate_up_bias.empty()) return nullptr;
    return (first ? gate_up_bias : down_bias)[e].data_ptr<float>();
  }
  c10::optional<torch::Tensor> bias_tensor(int64_t e, bool first) const {
    if (gate_up_bias.empty()) return c10::nullopt;
    return (first ? gate_up_bias : down_bias)[e];
  }

  // Expert e's rows of x, [n, H].
  torch::Tensor gather(int64_t e) const {
    const int64_t n = static_cast<int64_t>(rows[e].size());
    auto xe = torch::empty({n, H}, x.options());
    const float* xp = x.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(xe.data_ptr<float>() + r * H, xp + rows[e][r].first * H, H * sizeof(float));
    return xe;
  }

  // out[t] += weight x y[r] for expert e's (token t, slot) = rows[e][r].
  void add_weighted(int64_t e, const float* y, float* out) const {
    const float* wp = wts.data_ptr<float>();
    for (size_t r = 0; r < rows[e].size(); ++r) {
      const auto [t, j] = rows[e][r];
      const float w = wp[t * k + j];
      const float* yr = y + r * H;
      float* o = out + t * H;
      for (int64_t h = 0; h < H; ++h) o[h] += yr[h] * w;
    }
  }
};

}  // namespace

// An expert's activation of [n, 2I] gate/up rows into [n, I]: act 0 SiLU(gate) x up (pagoda's
// one-pass kernel), 1 tanh-GELU(gate) x up (Gemma's; torch's own gelu, as the per-expert path).
static void activate_rows(float* gu, float* out, int64_t n, int64_t I, int64_t act) {
  if (act == kActSilu) {
    pagoda_silu_mul_rows(gu, out, n, I);
    return;
  }
  torch::from_blob(out, {n, I}).copy_(gated_activation(torch::from_blob(gu, {n, 2 * I}), act));
}

// f(a) for every active expert a, the experts shared between the threads: each expert's
// activation is the very call it was alone (torch's elementwise ops run serially inside a
// parallel region), so the same bits; the main thread alone spent ~1 % of a Gemma 4-shaped
// 16-stream step here while the other waited.
template <typename F>
void activate_experts(int64_t n, F&& f) {
  at::parallel_for(0, n, 1, [&](int64_t a0, int64_t a1) {
    c10::InferenceMode guard;  // worker threads do not inherit the caller's mode
    for (int64_t a = a0; a < a1; ++a) f(a);
  });
}

torch::Tensor gguf_moe_int8(torch::Tensor x_in, torch::Tensor ids_in, torch::Tensor weights_in,
                            std::vector<torch::Tensor> gate_up, std::vector<int64_t> gate_up_types,
                            std::vector<torch::Tensor> down, std::vector<int64_t> down_types, int64_t activation,
                            std::vector<torch::Tensor> gate_up_bias, std::vector<torch::Tensor> down_bias) {
  const MoeCall c(x_in, ids_in, weights_in, gate_up, gate_up_types, down, down_types, gate_up_bias, down_bias);
  const int64_t H = c.H, I = c.I;
  struct Active {
    int64_t e, n;
    std::vector<Part> gu, dn;
    Buffer<float> ge, he, ye;  // every element written by the tiles / the activation
    QuantizedX xq, xk, hq, hk;
    bool vnni_in = false, vnni_hidden = false;  // whether its K-quant parts take the VNNI row layout
  };
  std::vector<Active> act;
  PartKinds first_kinds;  // of every active expert's gate/up parts
  for (int64_t e = 0; e < c.E; ++e) {
    if (c.rows[e].empty()) continue;
    Active a{e, static_cast<int64_t>(c.rows[e].size()), c.gate_up_parts(e), c.down_parts(e)};
    for (const Part& p : a.gu) TORCH_CHECK(int8_type(p.type), "the int8 product needs quantized blocks of integers");
    TORCH_CHECK(int8_type(a.dn[0].type), "the int8 product needs quantized blocks of integers");
    const PartKinds k = part_kinds(a.gu);
    first_kinds.k |= k.k, first_kinds.rows |= k.rows, first_kinds.other |= k.other, first_kinds.x32 |= k.x32;
    act.push_back(std::move(a));
  }
  // The experts share the layer's x: each token's row quantized once (a row is quantized
  // on its own, so each expert's rows are the values quantize_x gives them alone), then
  // each expert's rows gathered.
  const float* xp = c.x.data_ptr<float>();
  const QuantizedX x32 = first_kinds.groups32() ? quantize_x(xp, c.T, H) : QuantizedX{};
  const QuantizedX x256 = first_kinds.k ? quantize_x(xp, c.T, H, 256) : QuantizedX{};
  const int64_t n_act = static_cast<int64_t>(act.size());
  // Each expert's inputs of one projection (its rows of x gathered, or its activations
  // quantized), the experts shared between the threads (nested parallel_for calls run
  // inline: each expert's the very values it gets alone).
  auto prepare = [&](bool first) {
    activate_experts(n_act, [&](int64_t a) {
      Active& s = act[a];
      const std::vector<Part>& parts = first ? s.gu : s.dn;
      const int64_t K = first ? H : I;
      const PartKinds kinds = part_kinds(parts);
      QuantizedX& xq = first ? s.xq : s.hq;
      QuantizedX& xk = first ? s.xk : s.hk;
      if (kinds.groups32()) {
        xq = first ? gather_quantized(x32, c.rows[s.e], H, 32) : quantize_x(s.he.data(), s.n, K);
        if (kinds.x32 && xq.amx && s.n >= kAmxMinRows) amx_rows32(xq, s.n, K, kinds.min);
      }
      const bool vnni = kinds.rows && vnni_k_rows(s.n);
      (first ? s.vnni_in : s.vnni_hidden) = vnni;
      if (kinds.k) {
        xk = first ? gather_quantized(x256, c.rows[s.e], H, 256) : quantize_x(s.he.data(), s.n, K, 256);
        if (kinds.rows) k_rows_layout(xk, s.n, K, vnni);
      }
      (first ? s.ge : s.ye).resize(s.n * (first ? 2 * I : H));
    });
  };
  // Runs every (expert, tile) unit of one projection in one parallel region.
  auto project = [&](bool first) {
    prepare(first);
    std::vector<std::pair<int64_t, Tile>> units;
    for (int64_t a = 0; a < n_act; ++a) {
      const Active& s = act[a];
      const std::vector<Part>& parts = first ? s.gu : s.dn;
      for (const Tile& t : tiles_of(parts, kChannels, k_channels_per_tile(s.n, first ? s.vnni_in : s.vnni_hidden)))
        units.push_back({a, t});
    }
    for_each_unit<Int8Scratch>(static_cast<int64_t>(units.size()), [&](int64_t u, Int8Scratch& sc) {
      Active& s = act[units[u].first];
      const Tile& t = units[u].second;
      if (first)
        int8_tile(s.xq, s.xk, 0, s.n, H, s.gu[t.part], t, c.bias(s.e, true), s.ge.data(), 2 * I, sc);
      else
        int8_tile(s.hq, s.hk, 0, s.n, I, s.dn[t.part], t, c.bias(s.e, false), s.ye.data(), H, sc);
    });
  };
  project(true);
  for (Active& s : act) s.he.resize(s.n * I);
  activate_experts(n_act, [&](int64_t a) {
    activate_rows(act[a].ge.data(), act[a].he.data(), act[a].n, I, activation);
  });
  project(false);
  // out[t] = sum over its experts, in expert order, of weight x expert output: columns
  // shared between the threads, each element's sum in the same order.
  auto out = torch::zeros({c.T, H}, c.x.options());
  float* op = out.data_ptr<float>();
  const float* wp = c.wts.data_ptr<float>();
  at::parallel_for(0, H, 512, [&](int64_t h0, int64_t h1) {
    for (const Active& s : act)
      for (size_t r = 0; r < c.rows[s.e].size(); ++r) {
        const auto [t, j] = c.rows[s.e][r];
        const float w = wp[t * c.k + j];
        const float* yr = s.ye.data() + r * H;
        float* o = op + t * H;
        for (int64_t h = h0; h < h1; ++h) o[h] += yr[h] * w;
      }
  });
  return out;
}

// The exact mode's MoE layer: gguf_linear's float32 products (the blocks' dequantized
// values, float32 sums). An expert with at most kSmallSteps rows runs its tiles in the
// layer's shared parallel region, one with more (a long prompt's popular expert)
// gguf_linear's BLAS panels on its own. Bit for bit the per-expert path.
torch::Tensor gguf_moe(torch::Tensor x_in, torch::Tensor ids_in, torch::Tensor weights_in,
                       std::vector<torch::Tensor> gate_up, std::vector<int64_t> gate_up_types,
                       std::vector<torch::Tensor> down, std::vector<int64_t> down_types, int64_t activation,
                       std::vector<torch::Tensor> gate_up_bias, std::vector<torch::Tensor> down_bias) {
  const MoeCall c(x_in, ids_in, weights_in, gate_up, gate_up_types, down, down_types, gate_up_bias, down_bias);
  for (int64_t t : gate_up_types) TORCH_CHECK(!is_lanes(t), "repacked weights multiply in the gguf mode only");
  for (int64_t t : down_types) TORCH_CHECK(!is_lanes(t), "repacked weights multiply in the gguf mode only");
  const int64_t H = c.H, I = c.I;
  struct Active {
    int64_t e, n;
    std::vector<Part> gu, dn;
    torch::Tensor xe, ge, he, ye;  // [n, H], [n, 2I], [n, I], [n, H]
  };
  std::vector<Active> act;
  for (int64_t e = 0; e < c.E; ++e)
    if (!c.rows[e].empty())
      act.push_back({e, static_cast<int64_t>(c.rows[e].size()), c.gate_up_parts(e), c.down_parts(e), c.gather(e)});
  auto project = [&](bool first) {
    std::vector<std::pair<int64_t, Tile>> units;
    std::vector<std::vector<float>> sums(act.size());
    std::vector<int64_t> per_tile(act.size());
    for (int64_t a = 0; a < static_cast<int64_t>(act.size()); ++a) {
      Active& s = act[a];
      const std::vector<Part>& parts = first ? s.gu : s.dn;
      const torch::Tensor& in = first ? s.xe : s.he;
      const int64_t K = first ? H : I;
      if (s.n > kSmallSteps) {  // gguf_linear's large-step path, on its own
        std::vector<torch::Tensor> ws = first ? std::vector<torch::Tensor>{c.gate_up[2 * s.e], c.gate_up[2 * s.e + 1]}
                                              : std::vector<torch::Tensor>{c.down[s.e]};
        std::vector<int64_t> ts;
        for (const Part& p : parts) ts.push_back(p.type);
        (first ? s.ge : s.ye) = gguf_linear(in, ws, ts, c.bias_tensor(s.e, first));
        continue;
      }
      (first ? s.ge : s.ye) = torch::empty({s.n, first ? 2 * I : H}, c.x.options());
      if (s.n <= kDirectRows) sums[a] = group_sums16(in.data_ptr<float>(), s.n, K);
      for (const Tile& t : small_step_tiles(parts, s.n, K, &per_tile[a])) units.push_back({a, t});
    }
    for_each_unit<FloatScratch>(static_cast<int64_t>(units.size()), [&](int64_t u, FloatScratch& sc) {
      const int64_t a = units[u].first;
      Active& s = act[a];
      const Tile& t = units[u].second;
      if (first)
        small_step_tile(s.xe.data_ptr<float>(), s.n, H, s.gu[t.part], t, sums[a].data(), c.bias(s.e, true),
                        s.ge.data_ptr<float>(), 2 * I, per_tile[a], sc.buf);
      else
        small_step_tile(s.he.data_ptr<float>(), s.n, I, s.dn[t.part], t, sums[a].data(), c.bias(s.e, false),
                        s.ye.data_ptr<float>(), H, per_tile[a], sc.buf);
    });
  };
  project(true);
  for (Active& s : act) s.he = torch::empty({s.n, I}, c.x.options());
  activate_experts(static_cast<int64_t>(act.size()), [&](int64_t a) {
    activate_rows(act[a].ge.data_ptr<float>(), act[a].he.data_ptr<float>(), act[a].n, I, activation);
  });
  project(false);
  auto out = torch::zeros({c.T, H}, c.x.options());
  for (const Active& s : act) c.add_weighted(s.e, s.ye.data_ptr<float>(), out.data_ptr<float>());
  return out;
}
