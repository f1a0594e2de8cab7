// Recurrent state layers of hybrid models (pagoda/csrc/kernels.h): gated_delta_rule, the
// Gated DeltaNet of Qwen3.5 / Qwen3-Next (pagoda/model/layers/gated_deltanet.py) over a
// step's sequences, each from the state in its slot, updated there in place.
//
// A slot's row is the convolution's last K - 1 inputs [conv_dim, K - 1] then every value
// head's memory S [k_dim, v_dim]. Per sequence, the depthwise convolution (SiLU) runs over
// its tokens, q and k are L2-normalised (q scaled by 1/sqrt(k_dim)); then per value head,
// token by token,
//     S <- decay S,  S <- S + k (beta (v - S^T k))^T,  o = S^T q,
// with two passes over S a token (S^T k, then the update with o accumulated), S staying in
// cache between them; decay = exp(A softplus(a + dt_bias)), beta = sigmoid(b) per token and
// value head, and the output is RMSNorm(o) w silu(z) (the layer's gated norm). States saved for the prefix cache (``saved`` rows) are copied after
// the token that completes their block. Sequences are independent: (sequence, value head)
// pairs run in parallel, each in a fixed order, so a sequence's numbers do not depend on
// its batch.

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

void l2norm(float* x, int64_t n, float scale) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = scale / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace

namespace {

// Rows of a [tokens, n] float32 view whose rows may be strided.
struct Rows {
  const float* p;
  int64_t ld;
  explicit Rows(const torch::Tensor& t) : p(t.data_ptr<float>()), ld(t.stride(0)) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.stride(1) == 1,
                "gated_delta_rule: float32 [tokens, n] inputs with contiguous rows");
  }
  const float* operator[](int64_t t) const { return p + t * ld; }
};

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// The states to save for the prefix cache: after token at[m] of sequence seq[m], into row[m].
struct Saves {
  int64_t M;
  const int64_t *seq, *at, *row;
  float* rows = nullptr;
  Saves(const c10::optional<torch::Tensor>& saved, const torch::Tensor& save_seq, const torch::Tensor& save_at,
        const torch::Tensor& save_row, int64_t width)
      : M(save_seq.numel()), seq(save_seq.data_ptr<int64_t>()), at(save_at.data_ptr<int64_t>()),
        row(save_row.data_ptr<int64_t>()) {
    if (M) {
      TORCH_CHECK(saved.has_value() && saved->is_contiguous() && saved->size(1) == width, "saved: [entries, state]");
      rows = saved->data_ptr<float>();
    }
  }
};

// The depthwise causal convolution (SiLU, optional bias) of every sequence's tokens, from the
// last K - 1 inputs its slot holds (the first C * (K - 1) floats of its row), which it then
// keeps (as do the saved states, at theirs): [T, C].
std::vector<float> causal_conv(float* st, int64_t width, const int64_t* slot, const int64_t* start, int64_t B,
                               int64_t T, const Rows& x, int64_t C, const float* w, int64_t K, const float* bias,
                               const Saves& saves) {
  const int64_t keep = K - 1;
  std::vector<float> conv(T * C);
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> win;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t0 = start[b], n = start[b + 1] - t0;
      float* cs = st + slot[b] * width;   // [C, keep]
      win.resize(keep + n);
      for (int64_t c = 0; c < C; ++c) {
        for (int64_t j = 0; j < keep; ++j) win[j] = cs[c * keep + j];
        for (int64_t t = 0; t < n; ++t) win[keep + t] = x[t0 + t][c];
        const float* wc = w + c * K;
        for (int64_t t = 0; t < n; ++t) {
          float acc = 0.f;
          for (int64_t j = 0; j < K; ++j) acc += wc[j] * win[t + j];
          if (bias) acc += bias[c];
          conv[(t0 + t) * C + c] = silu(acc);
        }
        for (int64_t m = 0; m < saves.M; ++m)
          if (saves.seq[m] == b)
            for (int64_t j = 0; j < keep; ++j) saves.rows[saves.row[m] * width + c * keep + j] = win[saves.at[m] + j];
        for (int64_t j = 0; j < keep; ++j) cs[c * keep + j] = win[n + j];
      }
    }
  });
  return conv;
}

}  // namespace

void gated_delta_rule(torch::Tensor states, torch::Tensor slots, torch::Tensor starts, torch::Tensor mixed,
                      torch::Tensor conv_weight, torch::Tensor a, torch::Tensor b, torch::Tensor z,
                      torch::Tensor A, torch::Tensor dt_bias, torch::Tensor norm_weight, double eps,
                      torch::Tensor out, c10::optional<torch::Tensor> saved, torch::Tensor save_seq,
                      torch::Tensor save_at, torch::Tensor save_row, int64_t k_heads, int64_t k_dim, int64_t v_dim,
                      bool tiled) {
  TORCH_CHECK(states.scalar_type() == torch::kFloat32 && states.is_contiguous() && states.dim() == 2,
              "states: contiguous float32 [slots, state]");
  TORCH_CHECK(mixed.scalar_type() == torch::kFloat32 && mixed.dim() == 2 && mixed.stride(1) == 1,
              "mixed: float32 [tokens, conv_dim], rows contiguous");
  TORCH_CHECK(conv_weight.scalar_type() == torch::kFloat32 && conv_weight.is_contiguous(), "conv_weight: float32");
  TORCH_CHECK(out.is_contiguous() && A.is_contiguous() && dt_bias.is_contiguous() && norm_weight.is_contiguous(),
              "out, A, dt_bias, norm_weight: contiguous");
  const int64_t B = slots.numel(), T = mixed.size(0), C = mixed.size(1), K = conv_weight.size(1);
  const int64_t nv = A.numel(), r = nv / k_heads, key = k_heads * k_dim, keep = K - 1;
  const int64_t conv_size = C * keep, head = k_dim * v_dim, width = states.size(1);
  TORCH_CHECK(conv_weight.size(0) == C && C == 2 * key + nv * v_dim && width == conv_size + nv * head,
              "gated_delta_rule: shapes disagree");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  TORCH_CHECK(starts.numel() == B + 1 && start[B] <= T, "starts: B + 1 token offsets");
  float* st = states.data_ptr<float>();
  const Rows ar(a), br(b), zr(z);
  const float* Ah = A.data_ptr<float>();
  const float* dtb = dt_bias.data_ptr<float>();
  const float* nw = norm_weight.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  float* o = out.data_ptr<float>();
  const Saves saves(saved, save_seq, save_at, save_row, width);
  // 1. The convolution of every sequence's tokens; q and k normalised.
  std::vector<float> conv = causal_conv(st, width, slot, start, B, T, Rows(mixed), C, conv_weight.data_ptr<float>(),
                                        K, nullptr, saves);
  const float qscale = 1.f / std::sqrt(static_cast<float>(k_dim));
  at::parallel_for(0, start[B], 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < k_heads; ++h) {
        l2norm(&conv[t * C + h * k_dim], k_dim, qscale);
        l2norm(&conv[t * C + key + h * k_dim], k_dim, 1.f);
      }
  });
  // 2. Per (sequence, value head): the delta rule token by token on S in the slot.
  at::parallel_for(0, B * nv, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> kv(v_dim), delta(v_dim);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / nv, h = p % nv, kh = tiled ? h % k_heads : h / r;
      float* S = st + slot[b] * width + conv_size + h * head;   // [k_dim, v_dim]
      for (int64_t t = start[b]; t < start[b + 1]; ++t) {
        const float* q = &conv[t * C + kh * k_dim];
        const float* k = &conv[t * C + key + kh * k_dim];
        const float* v = &conv[t * C + 2 * key + h * v_dim];
        const float g = std::exp(Ah[h] * softplus(ar[t][h] + dtb[h]));
        const float bt = 1.f / (1.f + std::exp(-br[t][h]));
        std::fill(kv.begin(), kv.end(), 0.f);
        for (int64_t i = 0; i < k_dim; ++i) {
          const float ki = k[i];
          const float* Si = S + i * v_dim;
          for (int64_t j = 0; j < v_dim; ++j) kv[j] += Si[j] * ki;
        }
        for (int64_t j = 0; j < v_dim; ++j) delta[j] = (v[j] - g * kv[j]) * bt;
        float* ot = o + (t * nv + h) * v_dim;
        std::fill(ot, ot + v_dim, 0.f);
        for (int64_t i = 0; i < k_dim; ++i) {
          const float ki = k[i], qi = q[i];
          float* Si = S + i * v_dim;
          for (int64_t j = 0; j < v_dim; ++j) {
            const float s = Si[j] * g + ki * delta[j];
            Si[j] = s;
            ot[j] += s * qi;
          }
        }
        // The gated RMSNorm of the head's output.
        float ss = 0.f;
        for (int64_t j = 0; j < v_dim; ++j) ss += ot[j] * ot[j];
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(v_dim) + feps);
        const float* zt = zr[t] + h * v_dim;
        for (int64_t j = 0; j < v_dim; ++j) ot[j] = ot[j] * inv * nw[j] * silu(zt[j]);
        for (int64_t m = 0; m < saves.M; ++m)
          if (saves.seq[m] == b && start[b] + saves.at[m] == t + 1)
            std::memcpy(saves.rows + saves.row[m] * width + conv_size + h * head, S, head * sizeof(float));
      }
    }
  });
}

// ---- Mamba-2 ------------------------------------------------------------------------
// mamba2_scan: a Mamba-2 mixer's convolution (SiLU, optional bias) over [x; B; C] and its
// scan over a step's sequences, in place in their slots (a slot's row: the convolution's
// last K - 1 inputs [conv_dim, K - 1], then every head's S [head_dim, d_state]). Per head
// h (its group's B and C), per token: dt = clamp(softplus(dt + dt_bias), dt_min, dt_max),
//     S <- exp(dt A) S + dt x B^T,   y = S C + D x   (y before the gate).

void mamba2_scan(torch::Tensor states, torch::Tensor slots, torch::Tensor starts, torch::Tensor xbc,
                 torch::Tensor dt, torch::Tensor conv_weight, c10::optional<torch::Tensor> conv_bias,
                 torch::Tensor dt_bias, torch::Tensor A, torch::Tensor D, double dt_min, double dt_max,
                 torch::Tensor y, c10::optional<torch::Tensor> saved, torch::Tensor save_seq, torch::Tensor save_at,
                 torch::Tensor save_row, int64_t heads, int64_t head_dim, int64_t groups, int64_t d_state) {
  TORCH_CHECK(states.scalar_type() == torch::kFloat32 && states.is_contiguous() && states.dim() == 2,
              "states: contiguous float32 [slots, state]");
  TORCH_CHECK(y.is_contiguous() && conv_weight.is_contiguous() && A.is_contiguous() && D.is_contiguous() &&
              dt_bias.is_contiguous(), "y, conv_weight, A, D, dt_bias: contiguous");
  const Rows xr(xbc), dtr(dt);
  const int64_t B = slots.numel(), T = xbc.size(0), C = xbc.size(1), K = conv_weight.size(1), keep = K - 1;
  const int64_t inner = heads * head_dim, gs = groups * d_state, head = head_dim * d_state;
  const int64_t conv_size = C * keep, width = states.size(1), rep = heads / groups;
  TORCH_CHECK(C == inner + 2 * gs && conv_weight.size(0) == C && width == conv_size + heads * head,
              "mamba2_scan: shapes disagree");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  TORCH_CHECK(starts.numel() == B + 1 && start[B] <= T, "starts: B + 1 token offsets");
  float* st = states.data_ptr<float>();
  const float *dtb = dt_bias.data_ptr<float>(), *Ah = A.data_ptr<float>(), *Dh = D.data_ptr<float>();
  float* yo = y.data_ptr<float>();
  const Saves saves(saved, save_seq, save_at, save_row, width);
  std::vector<float> conv = causal_conv(st, width, slot, start, B, T, xr, C, conv_weight.data_ptr<float>(), K,
                                        conv_bias.has_value() ? conv_bias->data_ptr<float>() : nullptr, saves);
  const float lo = static_cast<float>(dt_min), hi = static_cast<float>(dt_max);
  at::parallel_for(0, B * heads, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / heads, h = p % heads, g = h / rep;
      float* S = st + slot[b] * width + conv_size + h * head;   // [head_dim, d_state]
      for (int64_t t = start[b]; t < start[b + 1]; ++t) {
        const float* x = &conv[t * C + h * head_dim];
        const float* Bt = &conv[t * C + inner + g * d_state];
        const float* Ct = &conv[t * C + inner + gs + g * d_state];
        const float step = std::min(std::max(softplus(dtr[t][h] + dtb[h]), lo), hi);
        const float dA = std::exp(step * Ah[h]);
        float* yt = yo + t * inner + h * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) {
          const float sx = step * x[i];
          float* Si = S + i * d_state;
          float acc = 0.f;
          for (int64_t j = 0; j < d_state; ++j) {
            const float s = Si[j] * dA + sx * Bt[j];
            Si[j] = s;
            acc += s * Ct[j];
          }
          yt[i] = acc + Dh[h] * x[i];
        }
        for (int64_t m = 0; m < saves.M; ++m)
          if (saves.seq[m] == b && start[b] + saves.at[m] == t + 1)
            std::memcpy(saves.rows + saves.row[m] * width + conv_size + h * head, S, head * sizeof(float));
      }
    }
  });
}
