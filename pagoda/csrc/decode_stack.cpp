// decode_stack: a decode step's decoder layers in one call.
//
// A decode-only step of a small model spends most of its time between the kernels, not in
// them: per layer about ten Python calls (modules, views, argument parsing, the lists of
// weight parts converted again on every call). Measured on the bundled 135M model at one
// stream: 28 % of a 23.6 ms step in the kernels, the rest in Python and torch's dispatch.
// A DecodeStack holds each layer's weights and settings once (built by
// pagoda/model/layers/decode_stack.py) and runs a step's layers calling the same kernels
// in the same order with the same arguments as DecoderLayer.forward does, so every result
// has the bits of the Python path (tested).

#include <torch/extension.h>

#include <algorithm>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

// One projection: which kernel, and its arguments as the Python module passes them.
struct DecodeLinear {
  enum Kind : int64_t { kBlocks = 0, kBlocksInt8 = 1, kInt8 = 2, kQ4 = 3, kTorch = 4 };
  int64_t kind = kBlocks;
  std::vector<torch::Tensor> parts;  // kBlocks / kBlocksInt8: GGUF parts; kInt8: qweight, scale,
                                     // outlier_idx, outlier_w; kQ4: qweight, scales, mins;
                                     // kTorch: nn.Linear's weight (F.linear)
  std::vector<int64_t> types;        // the parts' ggml types
  c10::optional<torch::Tensor> bias, vnni_weight, vnni_comp;
  int64_t small_rows = 0;

  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (kind) {
      case kBlocks:
        return gguf_linear(x, parts, types, bias);
      case kBlocksInt8:
        return gguf_linear_int8(x, parts, types, bias);
      case kInt8:
        return int8_linear(x, parts[0], parts[1], bias, small_rows, parts[2], parts[3], vnni_weight, vnni_comp,
                           c10::nullopt);
      case kQ4:
        return q4_linear(x, parts[0], parts[1], parts[2], bias);
      default:
        return at::linear(x, parts[0], bias);
    }
  }
};

DecodeLinear make_linear(int64_t kind, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                         c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> vnni_weight,
                         c10::optional<torch::Tensor> vnni_comp, int64_t small_rows) {
  const size_t need = kind == DecodeLinear::kInt8 ? 4 : kind == DecodeLinear::kQ4 ? 3 : kind == DecodeLinear::kTorch;
  TORCH_CHECK(kind >= DecodeLinear::kBlocks && kind <= DecodeLinear::kTorch, "unknown projection kind ", kind);
  TORCH_CHECK(need ? parts.size() == need : !parts.empty() && parts.size() == types.size(),
              "wrong number of weight tensors for projection kind ", kind);
  DecodeLinear l;
  l.kind = kind;
  l.parts = std::move(parts);
  l.types = std::move(types);
  l.bias = std::move(bias);
  l.vnni_weight = std::move(vnni_weight);
  l.vnni_comp = std::move(vnni_comp);
  l.small_rows = small_rows;
  return l;
}

// A gated MLP as GatedMLP.forward computes it: gate_up, the activation (gated_activation's
// codes), down.
torch::Tensor gated_mlp(const DecodeLinear& gate_up, const DecodeLinear& down, int64_t act, const torch::Tensor& x) {
  return down(gated_activation(gate_up(x), act));
}

// A mixture-of-experts block as SparseMoeBlock.route and experts_forward compute it, the
// experts in gguf_moe(_int8)'s one call (weights kept as GGUF blocks).
struct DecodeMoe {
  DecodeLinear router;
  bool sigmoid = false;
  int64_t top_k = 1;
  bool norm_topk = false;
  double norm_min = 0.0;   // the renormalising sum's floor (0: none)
  bool weights_on_input = false;
  double scaling = 1.0;
  c10::optional<torch::Tensor> score_bias;
  int64_t groups = 0, kept = 0;  // group-limited routing (0: none)
  bool group_max = true;         // a group's rank: its best expert (else its best two)
  // Gemma 4: routed on unit_norm(x) x router_scale x root; each weight times its expert's scale.
  c10::optional<torch::Tensor> router_scale, router_unit, per_expert_scale;
  double router_eps = 0.0, root = 1.0;
  bool int8 = true;
  std::vector<torch::Tensor> gate_up, down;
  std::vector<int64_t> gate_up_types, down_types;
  int64_t activation = 0;
  std::vector<torch::Tensor> gate_up_bias, down_bias;  // the GGUF experts' biases (GPT-OSS), or none
  c10::optional<DecodeLinear> shared_gate_up, shared_down, shared_gate;
  int64_t shared_act = 0;
  torch::Tensor expert_tokens;  // the block's counts (/metrics), added to in place
  // Experts not kept as GGUF blocks (the int8 mode's, an HF checkpoint's float32): one MLP
  // each, run as SparseMoeBlock._experts_sum runs them (no gate_up / down parts above).
  std::vector<DecodeLinear> expert_gate_up, expert_down;
  int64_t expert_act = 0;

  // (weights [T, k], ids [T, k]) for the stream x, as route() chooses them.
  std::pair<torch::Tensor, torch::Tensor> route(const torch::Tensor& x) const {
    torch::Tensor xr = x;
    if (router_scale) xr = rms_norm(x.contiguous(), *router_unit, router_eps, c10::nullopt) * *router_scale * root;
    const torch::Tensor logits = router(xr).to(torch::kFloat32);
    const torch::Tensor probs = sigmoid ? torch::sigmoid(logits) : torch::softmax(logits, -1);
    torch::Tensor choice = score_bias ? probs + score_bias->to(torch::kFloat32) : probs;
    if (groups) {
      const int64_t t = choice.size(0);
      const torch::Tensor by_group = choice.view({t, groups, -1});
      const torch::Tensor rank =
          group_max ? std::get<0>(by_group.max(-1)) : std::get<0>(by_group.topk(2, -1)).sum(-1);
      const torch::Tensor best = std::get<1>(torch::topk(rank, kept, -1));
      torch::Tensor keep = torch::zeros({t, groups, 1}, choice.options().dtype(torch::kBool));
      keep.scatter_(1, best.unsqueeze(-1), true);
      choice = by_group.masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity()).view({t, -1});
    }
    torch::Tensor weights, ids;
    if (!score_bias && !groups) {
      std::tie(weights, ids) = torch::topk(probs, top_k, -1);
    } else {
      ids = std::get<1>(torch::topk(choice, top_k, -1));
      weights = probs.gather(1, ids);
    }
    if (norm_topk) {
      const torch::Tensor total = weights.sum(-1, true);
      weights = weights / (norm_min ? total.clamp_min(norm_min) : total);
    }
    if (scaling != 1.0) weights = weights * scaling;
    {  // the picks into the block's counts (torch.bincount's values; without its passes over ids)
      const torch::Tensor flat = ids.contiguous();
      const int64_t* ip = flat.data_ptr<int64_t>();
      int64_t* counts = expert_tokens.data_ptr<int64_t>();
      for (int64_t i = 0; i < flat.numel(); ++i) ++counts[ip[i]];
    }
    if (per_expert_scale) weights = weights * per_expert_scale->to(torch::kFloat32).index({ids});
    return {weights, ids};
  }

  // _experts_sum: each expert's weighted output added per token in expert order (one token:
  // its experts by index, added in place; more: each expert's tokens in order, index_add_).
  torch::Tensor experts_sum(const torch::Tensor& x, const torch::Tensor& weights, const torch::Tensor& ids) const {
    torch::Tensor out = torch::zeros_like(x);
    const int64_t T = ids.size(0), k = ids.size(1), E = static_cast<int64_t>(expert_down.size());
    const torch::Tensor flat = ids.contiguous();
    const int64_t* ip = flat.data_ptr<int64_t>();
    auto run = [&](int64_t e, const torch::Tensor& xe, const torch::Tensor& w) {
      return weights_on_input ? gated_mlp(expert_gate_up[e], expert_down[e], expert_act, xe * w)
                              : gated_mlp(expert_gate_up[e], expert_down[e], expert_act, xe) * w;
    };
    if (T == 1) {
      std::vector<std::pair<int64_t, int64_t>> order;
      for (int64_t j = 0; j < k; ++j) order.push_back({ip[j], j});
      std::sort(order.begin(), order.end());
      for (const auto& [e, j] : order) out += run(e, x, weights.narrow(1, j, 1));
      return out;
    }
    std::vector<std::vector<int64_t>> rows(E);  // per expert its (token, slot) pairs as t * k + j, in order
    for (int64_t f = 0; f < T * k; ++f) {
      TORCH_CHECK(ip[f] >= 0 && ip[f] < E, "expert id ", ip[f], " out of range for ", E, " experts");
      rows[ip[f]].push_back(f);
    }
    const auto opts = torch::TensorOptions().dtype(torch::kInt64);
    for (int64_t e = 0; e < E; ++e) {
      if (rows[e].empty()) continue;
      const int64_t n = static_cast<int64_t>(rows[e].size());
      torch::Tensor tokens = torch::empty({n}, opts), slots = torch::empty({n}, opts);
      for (int64_t i = 0; i < n; ++i)
        tokens.data_ptr<int64_t>()[i] = rows[e][i] / k, slots.data_ptr<int64_t>()[i] = rows[e][i] % k;
      const torch::Tensor w = weights.index({tokens, slots}).unsqueeze(1);
      out.index_add_(0, tokens, run(e, x.index_select(0, tokens), w));
    }
    return out;
  }

  // The experts' (and shared experts') output for x, routed as chosen.
  torch::Tensor experts(const torch::Tensor& x, torch::Tensor weights, const torch::Tensor& ids) const {
    torch::Tensor routed_in = x;
    if (weights_on_input) {  // top_k == 1 (the builder's condition)
      routed_in = x * weights;
      weights = torch::ones_like(weights);
    }
    torch::Tensor out;
    if (!expert_down.empty())
      out = experts_sum(routed_in, weights, ids);
    else
      out = int8 ? gguf_moe_int8(routed_in, ids, weights, gate_up, gate_up_types, down, down_types, activation,
                                 gate_up_bias, down_bias)
                 : gguf_moe(routed_in, ids, weights, gate_up, gate_up_types, down, down_types, activation,
                            gate_up_bias, down_bias);
    if (!shared_gate_up) return out;
    torch::Tensor shared = gated_mlp(*shared_gate_up, *shared_down, shared_act, x);
    if (shared_gate) shared = torch::sigmoid((*shared_gate)(x)) * shared;
    return out + shared;
  }
};

// One pre-norm decoder layer (Llama's block): settings as DecoderLayer / Attention /
// GatedMLP hold them.
struct DecodeLayer {
  torch::Tensor input_norm, post_attention_norm;
  double eps;
  DecodeLinear qkv, o, gate_up, down;
  int64_t num_heads, num_kv_heads, head_dim;
  int64_t qk_norm;  // 0 none, 1 per head (Qwen3), 2 over the whole projection (OLMo 2)
  torch::Tensor q_norm, k_norm;
  double qk_eps;
  double scale;
  int64_t window;
  double softcap;
  c10::optional<torch::Tensor> sinks;
  int64_t rope_table;  // index into the step's cos / sin tables
  // Qwen3.5's attention: q_proj's rows interleave the query and a gate of each head's output
  // (o x sigmoid(gate)); RoPE on the first rotary_dim dimensions only (0: all).
  bool output_gate = false;
  int64_t rotary_dim = 0;
  // kind 1: a Gated DeltaNet layer (Qwen3.5) in place of attention: qkv is its in_proj, o its
  // out_proj, run by gated_delta_rule on the step's state slots.
  int64_t kind = 0;
  torch::Tensor conv_weight, A, dt_bias, gnorm;
  double gnorm_eps = 0.0;
  int64_t k_heads = 0, k_dim = 0, v_heads = 0, v_dim = 0;
  bool tiled = false;
  // Set after construction (pagoda/model/layers/decode_stack.py):
  // Gemma's sandwich norms: the attention output normed (post_attention_norm), then added to
  // the stream and normed (pre_ff_norm); the MLP's output normed (post_ff_norm).
  bool sandwich = false;
  torch::Tensor pre_ff_norm, post_ff_norm;
  int64_t act = 0;               // the MLP's activation: 0 SiLU, 1 tanh-GELU
  bool tuned = false;            // no RoPE; the layer's table holds each token's query scale (Llama 4)
  bool norm_after_rope = false;  // per-head q/k norms of the rotated heads (HunYuan)
  torch::Tensor v_unit;          // defined: values RMS-normed per head without a weight (Gemma 4)
  double v_eps = 0.0;
  c10::optional<DecodeMoe> moe;  // the experts in place of the MLP, or (moe_beside) beside it
  bool moe_beside = false;       // Gemma 4: dense MLP and experts, each normed, added
  torch::Tensor pre_ff_norm2, post_ff_norm1, post_ff_norm2;
  c10::optional<torch::Tensor> layer_scalar;  // Gemma 4: the layer's output stream scaled

  // q / k norms as Attention._norm_qk computes them (RMSNorm.rows per head: rows of
  // head_dim; or whole rows).
  torch::Tensor norm_qk(const torch::Tensor& qkv) const {
    const int64_t t = qkv.size(0), qs = num_heads * head_dim, kvs = num_kv_heads * head_dim;
    torch::Tensor q = qkv.narrow(1, 0, qs), k = qkv.narrow(1, qs, kvs), v = qkv.narrow(1, qs + kvs, kvs);
    if (qk_norm == 1) {
      q = rms_norm(q.reshape({t * num_heads, head_dim}).contiguous(), q_norm, qk_eps, c10::nullopt).view({t, -1});
      k = rms_norm(k.reshape({t * num_kv_heads, head_dim}).contiguous(), k_norm, qk_eps, c10::nullopt)
              .view({t, -1});
    } else {
      q = rms_norm(q.contiguous(), q_norm, qk_eps, c10::nullopt);
      k = rms_norm(k.contiguous(), k_norm, qk_eps, c10::nullopt);
    }
    return torch::cat({q, k, v}, -1);
  }
};

class DecodeStack {
 public:
  explicit DecodeStack(std::vector<c10::optional<DecodeLayer>> layers) : layers_(std::move(layers)) {}

  // Layers [start, end) of a decode-only step (one token per sequence): x and the residual
  // stream (None before the first layer) in, both out, as CausalLM.run_layers returns them.
  // A hybrid model's state layers also get their slots' states and saved states (``states``,
  // ``saved``: per layer, empty for attention layers) and the step's state arguments
  // (``state_args``: slots, token offsets, saves' sequence, offset and entry).
  std::vector<torch::Tensor> run(torch::Tensor x, c10::optional<torch::Tensor> residual_in,
                                 const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
                                 const std::vector<torch::Tensor>& caches,
                                 const std::vector<c10::optional<torch::Tensor>>& cache_scales,
                                 const std::vector<torch::Tensor>& slot_mapping,
                                 const std::vector<torch::Tensor>& block_tables,
                                 const std::vector<torch::Tensor>& seq_lens, int64_t start, int64_t end,
                                 const std::vector<torch::Tensor>& states,
                                 const std::vector<c10::optional<torch::Tensor>>& saved,
                                 const std::vector<torch::Tensor>& state_args) const {
    TORCH_CHECK(start >= 0 && start <= end && end <= static_cast<int64_t>(layers_.size()), "layer range [", start,
                ", ", end, ") outside the stack's ", layers_.size(), " layers");
    TORCH_CHECK(caches.size() == layers_.size() && cache_scales.size() == layers_.size(),
                "one cache (and scales) per layer");
    const size_t n = layers_.size(), groups = slot_mapping.size();
    TORCH_CHECK((groups == 1 || groups == n) && block_tables.size() == groups && seq_lens.size() == groups,
                "one slot mapping, block table and length tensor for every layer, or one for all");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be 2-D float32");
    const int64_t t = x.size(0);
    std::vector<torch::Tensor> cos2(cos.size()), sin2(sin.size());
    for (size_t i = 0; i < cos.size(); ++i)   // (a query-scale table has no sines: an empty tensor)
      cos2[i] = cos[i].view({t, -1}), sin2[i] = sin[i].numel() ? sin[i].view({t, -1}) : sin[i];
    torch::Tensor residual = residual_in.has_value() ? *residual_in : torch::Tensor();
    for (int64_t i = start; i < end; ++i) {
      TORCH_CHECK(layers_[i].has_value(), "layer ", i, " is not held here");
      const DecodeLayer& L = *layers_[i];
      torch::Tensor h;
      if (!residual.defined()) {
        residual = x;
        h = rms_norm(x.contiguous(), L.input_norm, L.eps, c10::nullopt);
      } else {
        h = rms_norm(x.contiguous(), L.input_norm, L.eps, residual);
      }
      if (L.kind == 1) {
        h = delta_layer(L, h, states[i], saved[i], state_args);
      } else {
        const size_t g = groups == 1 ? 0 : static_cast<size_t>(i);
        h = attention(L, h, cos2[L.rope_table], sin2[L.rope_table], caches[i], cache_scales[i], slot_mapping[g],
                      block_tables[g], seq_lens[g]);
      }
      if (L.sandwich) {
        h = rms_norm(rms_norm(h.contiguous(), L.post_attention_norm, L.eps, c10::nullopt), L.pre_ff_norm, L.eps,
                     residual);
        h = gated_mlp(L.gate_up, L.down, L.act, h);
        if (L.moe_beside) {  // routed on the stream after attention, the experts' input normed
          auto [weights, ids] = L.moe->route(residual);
          const torch::Tensor routed =
              L.moe->experts(rms_norm(residual.contiguous(), L.pre_ff_norm2, L.eps, c10::nullopt), weights, ids);
          h = rms_norm(h.contiguous(), L.post_ff_norm1, L.eps, c10::nullopt) +
              rms_norm(routed.contiguous(), L.post_ff_norm2, L.eps, c10::nullopt);
        }
        h = rms_norm(h.contiguous(), L.post_ff_norm, L.eps, c10::nullopt);
      } else {
        h = rms_norm(h.contiguous(), L.post_attention_norm, L.eps, residual);
        if (L.moe) {
          auto [weights, ids] = L.moe->route(h);
          h = L.moe->experts(h, weights, ids);
        } else {
          h = gated_mlp(L.gate_up, L.down, L.act, h);
        }
      }
      if (L.layer_scalar) {
        x = h * *L.layer_scalar;
        residual.mul_(*L.layer_scalar);
      } else {
        x = h;
      }
    }
    return {x, residual};
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

 private:
  static torch::Tensor attention(const DecodeLayer& L, const torch::Tensor& h, const torch::Tensor& cos,
                                 const torch::Tensor& sin, const torch::Tensor& cache,
                                 const c10::optional<torch::Tensor>& scales, const torch::Tensor& slot_mapping,
                                 const torch::Tensor& block_tables, const torch::Tensor& seq_lens) {
    const int64_t t = h.size(0), D = L.head_dim, qs = L.num_heads * D, kvs = L.num_kv_heads * D;
    torch::Tensor qkv = L.qkv(h), gate;
    if (L.output_gate) {   // as Attention.forward: per head, the query then the gate
      const torch::Tensor qg = qkv.narrow(1, 0, 2 * qs).view({t, L.num_heads, 2, D});
      gate = qg.select(2, 1).reshape({t, qs});
      qkv = torch::cat({qg.select(2, 0).reshape({t, qs}), qkv.narrow(1, 2 * qs, 2 * kvs)}, -1);
    }
    if (L.qk_norm && !L.norm_after_rope) qkv = L.norm_qk(qkv);
    if (L.v_unit.defined()) {  // as Attention.forward: v's heads normed, then q, k, v again
      const torch::Tensor v = rms_norm(qkv.narrow(1, qs + kvs, kvs).reshape({t * L.num_kv_heads, D}).contiguous(),
                                       L.v_unit, L.v_eps, c10::nullopt);
      qkv = torch::cat({qkv.narrow(1, 0, qs), qkv.narrow(1, qs, kvs), v.view({t, kvs})}, -1);
    }
    std::vector<torch::Tensor> qkv_out;
    if (L.tuned) {  // no RoPE: the queries scaled per token; K and V stored as the backend stores them
      const torch::Tensor k = qkv.narrow(1, qs, kvs).reshape({t, L.num_kv_heads, D});
      const torch::Tensor v = qkv.narrow(1, qs + kvs, kvs).reshape({t, L.num_kv_heads, D});
      qkv_out = {qkv.narrow(1, 0, qs).reshape({t, L.num_heads, D}) * cos.view({t, 1, 1})};
      write_kv(cache, scales, slot_mapping, k, v);
    } else if (L.norm_after_rope) {  // rotated, then normed per head, then stored
      const auto r = rope_qkv(qkv, cos, sin, L.num_heads, L.num_kv_heads, c10::nullopt, c10::nullopt, c10::nullopt);
      const auto rows = [&](const torch::Tensor& x, const torch::Tensor& w) {
        return rms_norm(x.reshape({-1, D}).contiguous(), w, L.qk_eps, c10::nullopt).view(x.sizes());
      };
      qkv_out = {rows(r[0], L.q_norm)};
      write_kv(cache, scales, slot_mapping, rows(r[1], L.k_norm), r[2]);
    } else if (L.rotary_dim) {
      // Partial rotary as apply_rope computes it (torch ops, the same bits); K and V stored as
      // the backend stores them.
      const int64_t r = L.rotary_dim, half = r / 2;
      const torch::Tensor c = cos.view({t, 1, r}), s = sin.view({t, 1, r});
      auto rope = [&](const torch::Tensor& x) {
        const torch::Tensor xr = x.narrow(-1, 0, r);
        const torch::Tensor rotated = torch::cat({-xr.narrow(-1, half, half), xr.narrow(-1, 0, half)}, -1);
        return torch::cat({xr * c + rotated * s, x.narrow(-1, r, D - r)}, -1);
      };
      qkv_out = {rope(qkv.narrow(1, 0, qs).view({t, L.num_heads, D}))};
      write_kv(cache, scales, slot_mapping, rope(qkv.narrow(1, qs, kvs).view({t, L.num_kv_heads, D})),
               qkv.narrow(1, qs + kvs, kvs).view({t, L.num_kv_heads, D}));
    } else {
      qkv_out = rope_qkv(qkv, cos, sin, L.num_heads, L.num_kv_heads, cache, slot_mapping, scales);
    }
    torch::Tensor o = paged_decode_attention(qkv_out[0], cache, block_tables, seq_lens, L.scale, scales, L.window,
                                             L.softcap, L.sinks)
                          .reshape({t, -1});
    if (L.output_gate) o = o * torch::sigmoid(gate);
    return L.o(o);
  }

  // New keys and values into their slots as the torch backend writes them (a float cache:
  // converted; an int8 cache: QuantizedKVCache.write's rounding and scales).
  static void write_kv(const torch::Tensor& cache, const c10::optional<torch::Tensor>& scales,
                       const torch::Tensor& slots, const torch::Tensor& k, const torch::Tensor& v) {
    const int64_t kvh = k.size(1), D = k.size(2);
    for (int64_t i = 0; i < 2; ++i) {
      const torch::Tensor& x = i ? v : k;
      if (!scales) {
        cache.select(0, i).view({-1, kvh, D}).index_copy_(0, slots, x.to(cache.scalar_type()));
        continue;
      }
      const torch::Tensor xf = x.to(torch::kFloat32);
      const torch::Tensor scale = xf.abs().amax(-1).clamp_min(1e-12) / 127.0;
      const torch::Tensor q = (xf / scale.unsqueeze(-1)).round().clamp(-127.0, 127.0).to(torch::kInt8);
      cache.select(0, i).view({-1, kvh, D}).index_copy_(0, slots, q);
      scales->select(0, i).view({-1, kvh}).index_copy_(0, slots, scale);
    }
  }

  static torch::Tensor delta_layer(const DecodeLayer& L, const torch::Tensor& h, const torch::Tensor& states,
                                   const c10::optional<torch::Tensor>& saved,
                                   const std::vector<torch::Tensor>& args) {
    TORCH_CHECK(args.size() == 5, "a hybrid step needs its state arguments");
    const int64_t t = h.size(0), C = 2 * L.k_heads * L.k_dim + L.v_heads * L.v_dim, vs = L.v_heads * L.v_dim;
    const torch::Tensor proj = L.qkv(h);
    torch::Tensor out = torch::empty({t, L.v_heads, L.v_dim}, h.options());
    gated_delta_rule(states, args[0], args[1], proj.narrow(1, 0, C), L.conv_weight, proj.narrow(1, C + vs + L.v_heads,
                     L.v_heads), proj.narrow(1, C + vs, L.v_heads), proj.narrow(1, C, vs), L.A, L.dt_bias, L.gnorm,
                     L.gnorm_eps, out, saved, args[2], args[3], args[4], L.k_heads, L.k_dim, L.v_dim, L.tiled);
    return L.o(out.view({t, -1}));
  }

  std::vector<c10::optional<DecodeLayer>> layers_;
};

}  // namespace

void bind_decode_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecodeLinear>(m, "DecodeLinear", "one projection of a DecodeStack layer");
  m.def("decode_linear", &make_linear,
        "a projection for decode_layer: kind 0 gguf_linear, 1 gguf_linear_int8 (parts, types), 2 int8_linear "
        "(qweight, weight_scale, outlier_idx, outlier_w; vnni_weight, vnni_comp, small_rows), 3 q4_linear "
        "(qweight, scales, mins), 4 F.linear (weight)",
        py::arg("kind"), py::arg("parts"), py::arg("types"), py::arg("bias") = py::none(),
        py::arg("vnni_weight") = py::none(), py::arg("vnni_comp") = py::none(), py::arg("small_rows") = 0);
  py::class_<DecodeMoe>(m, "DecodeMoe", "a mixture-of-experts block of a DecodeStack layer")
      .def(py::init([](DecodeLinear router, bool sigmoid, int64_t top_k, bool norm_topk, double norm_min,
                       bool weights_on_input, double scaling, c10::optional<torch::Tensor> score_bias, int64_t groups,
                       int64_t kept, bool group_max, bool int8, std::vector<torch::Tensor> gate_up,
                       std::vector<int64_t> gate_up_types, std::vector<torch::Tensor> down,
                       std::vector<int64_t> down_types, int64_t activation, torch::Tensor expert_tokens) {
             TORCH_CHECK(!weights_on_input || top_k == 1, "weights on the inputs of one expert per token only");
             TORCH_CHECK(expert_tokens.scalar_type() == torch::kInt64 && expert_tokens.is_contiguous() &&
                             (down.empty() || expert_tokens.numel() == static_cast<int64_t>(down.size())),
                         "expert_tokens: one int64 count per expert");
             DecodeMoe moe{std::move(router), sigmoid, top_k, norm_topk, norm_min, weights_on_input, scaling,
                           std::move(score_bias), groups, kept, group_max};
             moe.int8 = int8;
             moe.gate_up = std::move(gate_up), moe.gate_up_types = std::move(gate_up_types);
             moe.down = std::move(down), moe.down_types = std::move(down_types);
             moe.activation = activation;
             moe.expert_tokens = expert_tokens;
             return moe;
           }),
           py::arg("router"), py::arg("sigmoid"), py::arg("top_k"), py::arg("norm_topk"), py::arg("norm_min"),
           py::arg("weights_on_input"), py::arg("scaling"), py::arg("score_bias"), py::arg("groups"),
           py::arg("kept"), py::arg("group_max"), py::arg("int8"), py::arg("gate_up"), py::arg("gate_up_types"),
           py::arg("down"), py::arg("down_types"), py::arg("activation"), py::arg("expert_tokens"))
      .def("set_experts",
           [](DecodeMoe& m, std::vector<DecodeLinear> gate_up, std::vector<DecodeLinear> down, int64_t act) {
             TORCH_CHECK(gate_up.size() == down.size() &&
                             static_cast<int64_t>(down.size()) == m.expert_tokens.numel(),
                         "one gate/up and one down projection per expert");
             m.expert_gate_up = std::move(gate_up), m.expert_down = std::move(down), m.expert_act = act;
           },
           "experts as one MLP each (run as SparseMoeBlock._experts_sum), in place of the GGUF parts",
           py::arg("gate_up"), py::arg("down"), py::arg("act"))
      .def_readwrite("shared_gate_up", &DecodeMoe::shared_gate_up)
      .def_readwrite("shared_down", &DecodeMoe::shared_down)
      .def_readwrite("shared_gate", &DecodeMoe::shared_gate)
      .def_readwrite("shared_act", &DecodeMoe::shared_act)
      .def_readwrite("gate_up_bias", &DecodeMoe::gate_up_bias)
      .def_readwrite("down_bias", &DecodeMoe::down_bias)
      .def_readwrite("router_scale", &DecodeMoe::router_scale)
      .def_readwrite("router_unit", &DecodeMoe::router_unit)
      .def_readwrite("router_eps", &DecodeMoe::router_eps)
      .def_readwrite("root", &DecodeMoe::root)
      .def_readwrite("per_expert_scale", &DecodeMoe::per_expert_scale);
  py::class_<DecodeLayer>(m, "DecodeLayer", "one pre-norm decoder layer of a DecodeStack")
      .def(py::init([](torch::Tensor input_norm, torch::Tensor post_attention_norm, double eps, DecodeLinear qkv,
                       DecodeLinear o, DecodeLinear gate_up, DecodeLinear down, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t qk_norm, c10::optional<torch::Tensor> q_norm,
                       c10::optional<torch::Tensor> k_norm, double qk_eps, double scale, int64_t window,
                       double softcap, c10::optional<torch::Tensor> sinks, int64_t rope_table, bool output_gate,
                       int64_t rotary_dim) {
             TORCH_CHECK(qk_norm >= 0 && qk_norm <= 2 && (qk_norm == 0 || (q_norm && k_norm)),
                         "qk_norm 1 (per head) or 2 (whole projection) needs q_norm and k_norm");
             TORCH_CHECK(rope_table >= 0, "rope_table must be an index");
             DecodeLayer l{input_norm.contiguous(), post_attention_norm.contiguous(), eps, std::move(qkv),
                           std::move(o), std::move(gate_up), std::move(down), num_heads, num_kv_heads,
                           head_dim, qk_norm, q_norm ? q_norm->contiguous() : torch::Tensor(),
                           k_norm ? k_norm->contiguous() : torch::Tensor(), qk_eps, scale, window, softcap,
                           sinks, rope_table};
             l.output_gate = output_gate;
             l.rotary_dim = rotary_dim;
             return l;
           }),
           py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("eps"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("qk_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("qk_eps"), py::arg("scale"),
           py::arg("window"), py::arg("softcap"), py::arg("sinks"), py::arg("rope_table"),
           py::arg("output_gate") = false, py::arg("rotary_dim") = 0)
      .def_readwrite("sandwich", &DecodeLayer::sandwich)
      .def_readwrite("pre_ff_norm", &DecodeLayer::pre_ff_norm)
      .def_readwrite("post_ff_norm", &DecodeLayer::post_ff_norm)
      .def_readwrite("act", &DecodeLayer::act)
      .def_readwrite("tuned", &DecodeLayer::tuned)
      .def_readwrite("norm_after_rope", &DecodeLayer::norm_after_rope)
      .def_readwrite("v_unit", &DecodeLayer::v_unit)
      .def_readwrite("v_eps", &DecodeLayer::v_eps)
      .def_readwrite("moe", &DecodeLayer::moe)
      .def_readwrite("moe_beside", &DecodeLayer::moe_beside)
      .def_readwrite("pre_ff_norm2", &DecodeLayer::pre_ff_norm2)
      .def_readwrite("post_ff_norm1", &DecodeLayer::post_ff_norm1)
      .def_readwrite("post_ff_norm2", &DecodeLayer::post_ff_norm2)
      .def_readwrite("layer_scalar", &DecodeLayer::layer_scalar);
  m.def("decode_delta_layer",
        [](torch::Tensor input_norm, torch::Tensor post_attention_norm, double eps, DecodeLinear in_proj,
           DecodeLinear out_proj, DecodeLinear gate_up, DecodeLinear down, torch::Tensor conv_weight, torch::Tensor A,
           torch::Tensor dt_bias, torch::Tensor norm_weight, double norm_eps, int64_t k_heads, int64_t k_dim,
           int64_t v_heads, int64_t v_dim, bool tiled) {
          DecodeLayer l{input_norm.contiguous(), post_attention_norm.contiguous(), eps, std::move(in_proj),
                        std::move(out_proj), std::move(gate_up), std::move(down), 0, 0, 0, 0, torch::Tensor(),
                        torch::Tensor(), 0.0, 0.0, 0, 0.0, c10::nullopt, 0};
          l.kind = 1;
          l.conv_weight = conv_weight.contiguous();
          l.A = A.contiguous();
          l.dt_bias = dt_bias.contiguous();
          l.gnorm = norm_weight.contiguous();
          l.gnorm_eps = norm_eps;
          l.k_heads = k_heads, l.k_dim = k_dim, l.v_heads = v_heads, l.v_dim = v_dim, l.tiled = tiled;
          return l;
        },
        "a Gated DeltaNet layer of a DecodeStack (Qwen3.5): in_proj, gated_delta_rule on the step's state slots, "
        "out_proj, then the MLP",
        py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("eps"), py::arg("in_proj"), py::arg("out_proj"),
        py::arg("gate_up"), py::arg("down"), py::arg("conv_weight"), py::arg("A"), py::arg("dt_bias"),
        py::arg("norm_weight"), py::arg("norm_eps"), py::arg("k_heads"), py::arg("k_dim"), py::arg("v_heads"),
        py::arg("v_dim"), py::arg("tiled"));
  py::class_<DecodeStack>(m, "DecodeStack", "a model's decoder layers for decode-only steps, run in one call")
      .def(py::init<std::vector<c10::optional<DecodeLayer>>>(), py::arg("layers"))
      .def("run", &DecodeStack::run, py::arg("x"), py::arg("residual"), py::arg("cos"), py::arg("sin"),
           py::arg("caches"), py::arg("cache_scales"), py::arg("slot_mapping"), py::arg("block_tables"),
           py::arg("seq_lens"), py::arg("start"), py::arg("end"),
           py::arg("states") = std::vector<torch::Tensor>(),
           py::arg("saved") = std::vector<c10::optional<torch::Tensor>>(),
           py::arg("state_args") = std::vector<torch::Tensor>())
      .def("__len__", &DecodeStack::size);
}
