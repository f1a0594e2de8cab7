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
  std::vector<torch::Tensor> run(torch::Tensor x, c10::optional<torch::Tensor> residual_in,
                                 const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
                                 const std::vector<torch::Tensor>& caches,
                                 const std::vector<c10::optional<torch::Tensor>>& cache_scales,
                                 const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                                 const torch::Tensor& seq_lens, int64_t start, int64_t end) const {
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
      torch::Tensor qkv = L.qkv(h);
      if (L.qk_norm) qkv = L.norm_qk(qkv);
      const auto qkv_out = rope_qkv(qkv, cos2[L.rope_table], sin2[L.rope_table], L.num_heads, L.num_kv_heads,
                                    caches[i], slot_mapping, cache_scales[i]);
      const torch::Tensor o = paged_decode_attention(qkv_out[0], caches[i], block_tables, seq_lens, L.scale,
                                                     cache_scales[i], L.window, L.softcap, L.sinks);
      h = L.o(o.reshape({t, -1}));
      h = rms_norm(h.contiguous(), L.post_attention_norm, L.eps, residual);
      x = L.down(silu_mul(L.gate_up(h).contiguous()));
    }
    return {x, residual};
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

 private:
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
                       double softcap, c10::optional<torch::Tensor> sinks, int64_t rope_table) {
             TORCH_CHECK(qk_norm >= 0 && qk_norm <= 2 && (qk_norm == 0 || (q_norm && k_norm)),
                         "qk_norm 1 (per head) or 2 (whole projection) needs q_norm and k_norm");
             TORCH_CHECK(rope_table >= 0, "rope_table must be an index");
             return DecodeLayer{input_norm.contiguous(), post_attention_norm.contiguous(), eps, std::move(qkv),
                                std::move(o), std::move(gate_up), std::move(down), num_heads, num_kv_heads,
                                head_dim, qk_norm, q_norm ? q_norm->contiguous() : torch::Tensor(),
                                k_norm ? k_norm->contiguous() : torch::Tensor(), qk_eps, scale, window, softcap,
                                sinks, rope_table};
           }),
           py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("eps"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("qk_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("qk_eps"), py::arg("scale"),
           py::arg("window"), py::arg("softcap"), py::arg("sinks"), py::arg("rope_table"));
  py::class_<DecodeStack>(m, "DecodeStack", "a model's decoder layers for decode-only steps, run in one call")
      .def(py::init<std::vector<c10::optional<DecodeLayer>>>(), py::arg("layers"))
      .def("run", &DecodeStack::run, py::arg("x"), py::arg("residual"), py::arg("cos"), py::arg("sin"),
           py::arg("caches"), py::arg("cache_scales"), py::arg("slot_mapping"), py::arg("block_tables"),
           py::arg("seq_lens"), py::arg("start"), py::arg("end"))
      .def("__len__", &DecodeStack::size);
}
