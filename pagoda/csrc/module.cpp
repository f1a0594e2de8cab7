// The Python module of pagoda's CPU kernels (pagoda/ops/cpu_kernels.py builds every
// pagoda/csrc/*.cpp into it); the kernels are declared in kernels.h.

#include <torch/extension.h>

#include "kernels.h"
#include "simd.h"

// decode_stack.cpp: a decode step's decoder layers in one call (classes DecodeLinear,
// DecodeLayer, DecodeStack).
void bind_decode_stack(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "x @ W^T with W in 4-bit groups of 32 (scale + min)");
  m.def("q8_linear", &q8_linear, "x @ W^T with W int8 per output channel, float activations");
  m.def("i8_mm", &i8_mm, "int8 x int8^T -> int32, exact (small steps of int8 mode)");
  m.def("int8_linear", &int8_linear, "int8 mode's linear layer: float outlier channels, per-token int8 product of the rest",
        py::arg("x"), py::arg("qweight"), py::arg("weight_scale"), py::arg("bias"), py::arg("small_rows"),
        py::arg("outlier_idx"), py::arg("outlier_w"), py::arg("vnni_weight") = py::none(),
        py::arg("vnni_comp") = py::none(), py::arg("token_amax") = py::none());
  m.def("int8_pack_vnni", &int8_pack_vnni, "int8 weights [N, K] -> (AVX-512 VNNI tile layout, -128 x channel sums)");
  m.def("avx512_enabled", &use_avx512, "whether the AVX-512 VNNI kernels run (the CPU has them, PAGODA_CPU_ISA is not avx2)");
  m.def("amx_enabled", &use_amx, "whether the AMX int8 kernels run (the CPU has the tiles, the process was granted them, "
        "PAGODA_CPU_ISA is neither avx2 nor avx512)");
  m.def("silu_mul", &silu_mul, "F.silu(gate) * up of the fused [M, 2 x I] gate/up output, bit for bit");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) of a 2-D float32 tensor");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, optionally of (residual += x)");
  m.def("rope_qkv", &rope_qkv, "rotary embedding of fused qkv -> q, k, v (k and v also into the cache)",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("kv_cache") = py::none(), py::arg("slot_mapping") = py::none(), py::arg("kv_scales") = py::none());
  m.def("gguf_repack_x16", &gguf_repack_x16, "blocks of an integer GGUF type [N, row bytes] -> 16 channels in the "
        "lanes (blocks.py LANES_TYPES: the plain type's bytes a channel, but Q3_K_X16's 114, Q4_K_X16's 148, "
        "Q5_K_X16's 180 a block, IQ4_XS_X16's 138) for the gguf mode's AVX-512 VNNI and AMX kernels",
        py::arg("data"), py::arg("ggml_type"), py::arg("K"));
  m.def("gguf_dequantize", &gguf_dequantize, "rows of a GGUF tensor (all, or those indexed) as float32",
        py::arg("data"), py::arg("ggml_type"), py::arg("in_features"), py::arg("rows") = py::none());
  m.def("gguf_linear", &gguf_linear, "x @ W^T (+ bias) in float32, W given as GGUF parts of any supported type",
        py::arg("x"), py::arg("weights"), py::arg("ggml_types"), py::arg("bias") = py::none());
  m.def("gguf_linear_direct_reference", &gguf_linear_direct_reference, "tests only: gguf_linear's 1-4 row steps of "
        "block types as first written (whole decoded rows), for the bit-for-bit comparison",
        py::arg("x"), py::arg("weights"), py::arg("ggml_types"), py::arg("bias") = py::none());
  m.def("gguf_linear_int8", &gguf_linear_int8, "x @ W^T (+ bias) with x quantized to int8 per 32 and W's GGUF blocks "
        "as integers (llama.cpp's arithmetic)",
        py::arg("x"), py::arg("weights"), py::arg("ggml_types"), py::arg("bias") = py::none());
  m.def("gguf_moe_int8", &gguf_moe_int8, "a mixture-of-experts layer in the gguf mode: tokens grouped by expert, "
        "each expert's gate/up (+ its bias), the activation (0 SiLU, 1 tanh-GELU, 2 GPT-OSS's clamped SwiGLU) and "
        "down (+ its bias) as gguf_linear_int8 computes them, weighted sums in expert order",
        py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("gate_up"), py::arg("gate_up_types"),
        py::arg("down"), py::arg("down_types"), py::arg("activation") = 0,
        py::arg("gate_up_bias") = std::vector<torch::Tensor>{}, py::arg("down_bias") = std::vector<torch::Tensor>{});
  m.def("gguf_moe", &gguf_moe, "a mixture-of-experts layer in the exact mode: gguf_moe_int8's grouping with "
        "gguf_linear's float32 products", py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("gate_up"),
        py::arg("gate_up_types"), py::arg("down"), py::arg("down_types"), py::arg("activation") = 0,
        py::arg("gate_up_bias") = std::vector<torch::Tensor>{}, py::arg("down_bias") = std::vector<torch::Tensor>{});
  // gated_activation's code 2: GPT-OSS's clamped SwiGLU at this limit and alpha.
  m.attr("SWIGLU_OAI") = py::make_tuple(kSwigluLimit, kSwigluAlpha);
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache",
        py::arg("q"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("kv_scales") = py::none(), py::arg("window") = 0, py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none());
  m.def("gated_delta_rule", &gated_delta_rule, "a Gated DeltaNet layer's convolution and delta rule over a step's "
        "sequences, in place in their state slots", py::arg("states"), py::arg("slots"), py::arg("starts"),
        py::arg("mixed"), py::arg("conv_weight"), py::arg("a"), py::arg("b"), py::arg("z"), py::arg("A"),
        py::arg("dt_bias"), py::arg("norm_weight"), py::arg("eps"), py::arg("out"), py::arg("saved"), py::arg("save_seq"), py::arg("save_at"), py::arg("save_row"), py::arg("k_heads"),
        py::arg("k_dim"), py::arg("v_dim"), py::arg("tiled"));
  m.def("mamba2_scan", &mamba2_scan, "a Mamba-2 mixer's convolution and scan over a step's sequences, in place in "
        "their state slots", py::arg("states"), py::arg("slots"), py::arg("starts"), py::arg("xbc"), py::arg("dt"),
        py::arg("conv_weight"), py::arg("conv_bias"), py::arg("dt_bias"), py::arg("A"), py::arg("D"),
        py::arg("dt_min"), py::arg("dt_max"), py::arg("y"), py::arg("saved"), py::arg("save_seq"),
        py::arg("save_at"), py::arg("save_row"), py::arg("heads"), py::arg("head_dim"), py::arg("groups"),
        py::arg("d_state"));
  bind_decode_stack(m);
}
