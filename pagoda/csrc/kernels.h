// pagoda's CPU kernels, built on first use with torch.utils.cpp_extension
// (pagoda/ops/cpu_kernels.py), where plain torch leaves most of the machine unused or
// spends a decode step on per-op overhead. Declared here, one source file per family:
//
// q4_linear.cpp
//   q4_linear: y = x W^T with W in 4-bit groups of 32 (asymmetric: w = d*q + m, d and m fp16,
//     q in 0..15; the GGUF Q4_1 scheme, with the nibble order of ggml: byte j of a
//     group holds weights j (low nibble) and j + 16 (high nibble)), x quantized to int8
//     per row and group of 32 (llama.cpp's Q4_1 x Q8_1): integer dot products on
//     maddubs. Single-stream decode reads every weight once per token, so its speed is
//     set by bytes per weight: 5 bits here against 32 for fp32.
//   q8_linear: the same with int8 weights per output channel (q4 mode's LM head).
// int8_linear.cpp
//   i8_mm / int8_linear: int8 mode's per-token int8 x int8 products (AVX2, or AVX-512
//     VNNI on weights packed by int8_pack_vnni).
// gguf_blocks.cpp
//   gguf_linear / gguf_dequantize: exact mode's float32 products with weights kept in
//     the file's GGUF blocks, every type; gguf_linear_int8, gguf_moe(_int8).
// attention.cpp
//   paged_decode_attention: one query token per sequence against its K/V read in
//     place from the paged cache through the block table (no gathered, padded
//     copy). Each (sequence, query head) has a fixed summation order, so a
//     sequence's result does not depend on its batch.
// elementwise.cpp
//   silu_mul, rms_norm, rope_qkv: a layer's elementwise work in one call each.
// sampling.cpp
//   argmax_rows: the greedy sampler's argmax.
// recurrent.cpp
//   gated_delta_rule: a Gated DeltaNet layer's convolution and delta rule over a step's
//     sequences, in place in their state slots (hybrid models); mamba2_scan: a Mamba-2
//     mixer's convolution and scan, likewise.
// decode_stack.cpp
//   DecodeStack: a decode-only step's decoder layers in one call (the kernels above in
//   DecoderLayer.forward's order; pagoda/model/layers/decode_stack.py builds it).
// simd.h (with cpu_features.cpp): the helpers the kernels share, and the run-time
// choice between AVX2 and AVX-512 versions; f32_tiles.h: the float32 micro-kernel;
// module.cpp: the Python bindings.
//
// Every kernel computes a row of x the same way whatever the number of rows, so a
// request's numbers do not depend on its batch, its chunking or its prefix-cache hits.
#pragma once
#include <torch/types.h>

#include <cstdint>
#include <vector>

// ---- q4_linear.cpp ----
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                        torch::Tensor mins, c10::optional<torch::Tensor> bias);
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales);

// ---- int8_linear.cpp ----
torch::Tensor i8_mm(torch::Tensor xq, torch::Tensor qweight);
std::vector<torch::Tensor> int8_pack_vnni(torch::Tensor qweight);
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor weight_scale,
                          c10::optional<torch::Tensor> bias, int64_t small_rows,
                          torch::Tensor outlier_idx, torch::Tensor outlier_w,
                          c10::optional<torch::Tensor> vnni_weight, c10::optional<torch::Tensor> vnni_comp,
                          c10::optional<torch::Tensor> token_amax);

// ---- attention.cpp ----
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, c10::optional<torch::Tensor> kv_scales,
                                     int64_t window, double softcap, c10::optional<torch::Tensor> sinks);

// ---- elementwise.cpp ----
torch::Tensor silu_mul(torch::Tensor gate_up);
// silu_mul's rows, for callers in C++ (gguf_blocks.cpp's MoE kernel).
void pagoda_silu_mul_rows(const float* gu, float* out, int64_t M, int64_t I);
// The gated MLPs' activations (GatedMLP.forward): [gate | up] [M, 2I] -> [M, I] with the
// module's own ops, so its bits: 0 SiLU(gate) x up, 1 tanh-GELU(gate) x up, 2 GPT-OSS's
// clamped SwiGLU, (clamp(up, -7, 7) + 1) x g x sigmoid(1.702 g) for g = min(gate, 7) (the
// kernels' limit and alpha, SWIGLU_OAI in Python; a model with others keeps its Python path).
constexpr int64_t kActSilu = 0, kActGeluTanh = 1, kActSwigluOai = 2;
constexpr double kSwigluLimit = 7.0, kSwigluAlpha = 1.702;
torch::Tensor gated_activation(const torch::Tensor& gu, int64_t act);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                       c10::optional<torch::Tensor> residual);
std::vector<torch::Tensor> rope_qkv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                    int64_t num_heads, int64_t num_kv_heads,
                                    c10::optional<torch::Tensor> kv_cache,
                                    c10::optional<torch::Tensor> slot_mapping,
                                    c10::optional<torch::Tensor> kv_scales);

// ---- sampling.cpp ----
torch::Tensor argmax_rows(torch::Tensor x);

// ---- gguf_blocks.cpp ----
torch::Tensor gguf_dequantize(torch::Tensor data, int64_t type, int64_t K, c10::optional<torch::Tensor> rows);
torch::Tensor gguf_repack_x16(torch::Tensor data, int64_t type, int64_t K);
torch::Tensor gguf_linear(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<int64_t> types,
                          c10::optional<torch::Tensor> bias);
torch::Tensor gguf_linear_direct_reference(torch::Tensor x, std::vector<torch::Tensor> weights,
                                           std::vector<int64_t> types, c10::optional<torch::Tensor> bias);
torch::Tensor gguf_linear_int8(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<int64_t> types,
                               c10::optional<torch::Tensor> bias);
// gate_up_bias / down_bias: none, or one a expert ([2I] / [H] float32: GPT-OSS's).
torch::Tensor gguf_moe_int8(torch::Tensor x, torch::Tensor ids, torch::Tensor weights,
                            std::vector<torch::Tensor> gate_up, std::vector<int64_t> gate_up_types,
                            std::vector<torch::Tensor> down, std::vector<int64_t> down_types, int64_t activation = 0,
                            std::vector<torch::Tensor> gate_up_bias = {}, std::vector<torch::Tensor> down_bias = {});
torch::Tensor gguf_moe(torch::Tensor x, torch::Tensor ids, torch::Tensor weights,
                       std::vector<torch::Tensor> gate_up, std::vector<int64_t> gate_up_types,
                       std::vector<torch::Tensor> down, std::vector<int64_t> down_types, int64_t activation = 0,
                       std::vector<torch::Tensor> gate_up_bias = {}, std::vector<torch::Tensor> down_bias = {});

// ---- recurrent.cpp ----
void gated_delta_rule(torch::Tensor states, torch::Tensor slots, torch::Tensor starts, torch::Tensor mixed,
                      torch::Tensor conv_weight, torch::Tensor a, torch::Tensor b, torch::Tensor z,
                      torch::Tensor A, torch::Tensor dt_bias, torch::Tensor norm_weight, double eps,
                      torch::Tensor out, c10::optional<torch::Tensor> saved, torch::Tensor save_seq,
                      torch::Tensor save_at, torch::Tensor save_row, int64_t k_heads, int64_t k_dim, int64_t v_dim,
                      bool tiled);
void mamba2_scan(torch::Tensor states, torch::Tensor slots, torch::Tensor starts, torch::Tensor xbc,
                 torch::Tensor dt, torch::Tensor conv_weight, c10::optional<torch::Tensor> conv_bias,
                 torch::Tensor dt_bias, torch::Tensor A, torch::Tensor D, double dt_min, double dt_max,
                 torch::Tensor y, c10::optional<torch::Tensor> saved, torch::Tensor save_seq, torch::Tensor save_at,
                 torch::Tensor save_row, int64_t heads, int64_t head_dim, int64_t groups, int64_t d_state);
