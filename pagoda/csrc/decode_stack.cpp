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

#include <string>
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
                                 const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                                 const torch::Tensor& seq_lens, int64_t start, int64_t end,
                                 const std::vector<torch::Tensor>& states,
                                 const std::vector<c10::optional<torch::Tensor>>& saved,
                                 const std::vector<torch::Tensor>& state_args) const {
    TORCH_CHECK(start >= 0 && start <= end && end <= static_cast<int64_t>(layers_.size()), "layer range [", start,
                ", ", end, ") outside the stack's ", layers_.size(), " layers");
    TORCH_CHECK(caches.size() == layers_.size() && cache_scales.size() == layers_.size(),
                "one cache (and scales) per layer");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be 2-D float32");
    const int64_t t = x.size(0);
    std::vector<torch::Tensor> cos2(cos.size()), sin2(sin.size());
    for (size_t i = 0; i < cos.size(); ++i) cos2[i] = cos[i].view({t, -1}), sin2[i] = sin[i].view({t, -1});
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
        h = attention(L, h, cos2[L.rope_table], sin2[L.rope_table], caches[i], cache_scales[i], slot_mapping,
                      block_tables, seq_lens);
      }
      h = rms_norm(h.contiguous(), L.post_attention_norm, L.eps, residual);
      x = L.down(silu_mul(L.gate_up(h).contiguous()));
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
    if (L.qk_norm) qkv = L.norm_qk(qkv);
    std::vector<torch::Tensor> qkv_out;
    if (L.rotary_dim) {
      // Partial rotary as apply_rope computes it (torch ops, the same bits); then rope_qkv with
      // the identity rotation writes K and V into the cache.
      const int64_t r = L.rotary_dim, half = r / 2;
      const torch::Tensor c = cos.view({t, 1, r}), s = sin.view({t, 1, r});
      auto rope = [&](const torch::Tensor& x) {
        const torch::Tensor xr = x.narrow(-1, 0, r);
        const torch::Tensor rotated = torch::cat({-xr.narrow(-1, half, half), xr.narrow(-1, 0, half)}, -1);
        return torch::cat({xr * c + rotated * s, x.narrow(-1, r, D - r)}, -1);
      };
      const torch::Tensor q = rope(qkv.narrow(1, 0, qs).view({t, L.num_heads, D}));
      const torch::Tensor k = rope(qkv.narrow(1, qs, kvs).view({t, L.num_kv_heads, D}));
      qkv = torch::cat({q.reshape({t, qs}), k.reshape({t, kvs}), qkv.narrow(1, qs + kvs, kvs)}, -1);
      qkv_out = rope_qkv(qkv, torch::ones({t, D}), torch::zeros({t, D}), L.num_heads, L.num_kv_heads, cache,
                         slot_mapping, scales);
    } else {
      qkv_out = rope_qkv(qkv, cos, sin, L.num_heads, L.num_kv_heads, cache, slot_mapping, scales);
    }
    torch::Tensor o = paged_decode_attention(qkv_out[0], cache, block_tables, seq_lens, L.scale, scales, L.window,
                                             L.softcap, L.sinks)
                          .reshape({t, -1});
    if (L.output_gate) o = o * torch::sigmoid(gate);
    return L.o(o);
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
           py::arg("output_gate") = false, py::arg("rotary_dim") = 0);
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
