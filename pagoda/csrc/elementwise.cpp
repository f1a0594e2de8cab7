// A layer's elementwise work (pagoda/csrc/kernels.h): silu_mul (SiLU(gate) x up, with an
// AVX-512 version chosen at run time), rms_norm, rope_qkv (which also writes K and V
// into the cache).

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

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

torch::Tensor gated_activation(const torch::Tensor& gu, int64_t act) {
  // The fused silu_mul where the width allows, as the module (no views made: a decode
  // step calls this once a layer).
  if (act == kActSilu && gu.size(1) % 64 == 0) return silu_mul(gu.contiguous());
  const int64_t I = gu.size(1) / 2;
  const torch::Tensor gate = gu.narrow(1, 0, I), up = gu.narrow(1, I, I);
  switch (act) {
    case kActSilu:
      return at::silu(gate) * up;
    case kActGeluTanh:
      return at::gelu(gate, "tanh") * up;
    case kActSwigluOai: {
      const torch::Tensor g = gate.clamp_max(kSwigluLimit);
      return (up.clamp(-kSwigluLimit, kSwigluLimit) + 1) * (g * at::sigmoid(g * kSwigluAlpha));
    }
    default:
      TORCH_CHECK(false, "activation ", act, " is not 0 (SiLU), 1 (tanh-GELU) or 2 (GPT-OSS's clamped SwiGLU)");
  }
}

// ---- per-layer elementwise work -------------------------------------------------------
// A decode step of a small model is dominated by per-op overhead: each torch op costs a
// few microseconds whatever its size, and a layer had ~40 of them. These fuse the
// elementwise runs into one call each.

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
  // Rows split between the threads from 8 K elements (a decode step of several streams:
  // one thread's serial norms kept the other waiting); each row's arithmetic is the same.
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
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
  });
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
