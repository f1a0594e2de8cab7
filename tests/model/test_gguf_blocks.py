"""GGUF files whose weights stay in their blocks: the loader maps every projection, the
LM head and the embedding without a float copy, computes what the dequantized model
computes, keeps its memory near the file's size, and refuses types it cannot read by
name. Files are random-weight GGUFs of small shapes written tensor by tensor
(pagoda.bench.gguf_files), in llama.cpp's Q4_K_M type mix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagoda.bench.gguf_files import ModelShape, write_model
from pagoda.hub.gguf_file import GGUFFile
from pagoda.hub.paths import ModelLoadError
from pagoda.model.layers.blocks import Q6_K_X16, BlocksEmbedding, BlocksLinear
from pagoda.model.layers.quantization import quantize_model
from pagoda.model.loader import _load_gguf, load_model
from pagoda.ops import cpu_kernels
from tests.model.test_reference import pagoda_prompt_logits

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="GGUF blocks need pagoda's CPU kernels")

# Llama-like, rows of whole 256-blocks (Q4_K / Q6_K); Qwen2-like with q/k/v biases and
# rows of 320 (llama.cpp's fallbacks: Q5_0 for Q4_K, Q8_0 for Q6_K).
LLAMA = ModelShape("llama", 256, 2, 4, 2, 512, True, 10000.0)
QWEN2 = ModelShape("qwen2", 320, 2, 5, 1, 768, False, 1000000.0, qkv_bias=True)
PROMPT = [1, 504, 2031, 17, 9, 4000, 123, 49000, 77, 3]


@pytest.fixture(scope="module", params=[LLAMA, QWEN2], ids=["llama-q4_k_m", "qwen2-q4_k_m"])
def gguf_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    return str(write_model(str(path), request.param, "Q4_K_M", show_progress=False))


def test_weights_stay_blocks_and_compute_the_dequantized_model(gguf_path):
    loaded = load_model(gguf_path, show_progress=False)
    model = loaded.model
    types = {t.ggml_type for t in GGUFFile(gguf_path).tensors.values()}
    assert types >= {Q.Q4_K} and types & {Q.Q6_K, Q.Q8_0, Q.Q5_0}
    linears = [m for m in model.modules() if isinstance(m, BlocksLinear)]
    assert len(linears) == 4 * model.config.num_hidden_layers + 1
    assert isinstance(model.model.embed_tokens, BlocksEmbedding)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    # No float copy: the float parameters are the norms (and biases) alone.
    floats = sum(p.numel() for p in model.parameters())
    assert floats < 10 * model.config.hidden_size * (model.config.num_hidden_layers + 1)
    if model.config.tie_word_embeddings:
        assert model.lm_head.parts[0] is model.model.embed_tokens.blocks

    reference = _load_gguf(gguf_path, torch.float32, torch.device("cpu"), False)  # dequantized by gguf's numpy code
    for chunks in ([len(PROMPT)], [1] * len(PROMPT), [3, 4, 3]):
        got = pagoda_prompt_logits(model, PROMPT, chunks)
        ref = pagoda_prompt_logits(reference.model, PROMPT, [len(PROMPT)])
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()), (got - ref).abs().max()


def test_gguf_mode_multiplies_the_blocks_with_int8_activations(gguf_path):
    loaded = load_model(gguf_path, show_progress=False, quantization="gguf")
    linears = [m for m in loaded.model.modules() if isinstance(m, BlocksLinear)]
    assert linears and all(m.int8_activations for m in linears)
    # Each layer: its product with int8 activations is close to the float one (a random
    # model amplifies such differences through its layers, so compare layer by layer;
    # the real model's perplexity bounds are in test_quantization).
    g = torch.Generator().manual_seed(0)
    for layer in linears:
        x = torch.randn(5, layer.in_features, generator=g)
        got = layer(x)
        ref = x @ layer.dequantized().T + (0 if layer.bias is None else layer.bias)
        assert not torch.equal(got, ref)
        assert (got - ref).norm() < 0.02 * ref.norm(), layer
    got = pagoda_prompt_logits(loaded.model, PROMPT, [len(PROMPT)])
    assert torch.isfinite(got).all()
    # The same numbers for a row whatever its step.
    alone = pagoda_prompt_logits(loaded.model, PROMPT, [1] * len(PROMPT))
    assert torch.allclose(alone, got, rtol=0, atol=1e-4 * got.abs().max().item())


def test_gguf_mode_needs_blocks():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with pytest.raises(ValueError, match="needs a GGUF file"):
        quantize_model(model, "gguf", torch.device("cpu"))


def test_unsupported_tensor_type_is_named(tmp_path):
    path = str(tmp_path / "iq2.gguf")
    write_model(path, LLAMA, "Q4_K_M", show_progress=False, overrides={"blk.1.ffn_up.weight": Q.IQ2_XXS})
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up\.weight has type IQ2_XXS"):
        load_model(path, show_progress=False)



def test_a_random_file_says_the_context_it_was_given(tmp_path):
    """--context-length: the context the file says it was trained for (a real Llama 3.2's
    131072 for long-context runs), as the loader reads it."""
    path = str(tmp_path / "long.gguf")
    write_model(path, LLAMA, "Q4_K_M", show_progress=False, context_length=65536)
    assert GGUFFile(path).metadata["llama.context_length"] == 65536
    assert load_model(path, show_progress=False).arch.max_position_embeddings == 65536


RSS_SCRIPT = r"""
import gc, os, sys, torch
from pagoda.ops import cpu_kernels
from pagoda.model.loader import load_model
cpu_kernels.kernels()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
del load_model(sys.argv[1], show_progress=False).model  # imports and one-time set-up (~80 MB)
gc.collect()
before = rss()
loaded = load_model(sys.argv[1], show_progress=False)
after_load = rss()
from tests.model.test_reference import pagoda_prompt_logits
pagoda_prompt_logits(loaded.model, [1, 2, 3, 4], [4])
print(before, after_load, rss())
"""


def test_loader_memory_stays_near_the_file_size(tmp_path):
    """RSS after loading and running one prompt stays under the file's size plus a bound
    (a float32 copy would be ~7x the file)."""
    shape = ModelShape("llama", 1024, 4, 8, 2, 2816, False, 10000.0)
    path = str(tmp_path / "rss.gguf")
    write_model(path, shape, "Q4_K_M", show_progress=False)
    size = os.path.getsize(path)
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, path], capture_output=True, text=True, check=True,
                         timeout=600).stdout.split()
    before, after_load, after_run = map(int, out)
    assert after_load - before < 0.25 * size + (32 << 20)    # mapped, not read
    assert after_run - before < size + (64 << 20), (after_run - before, size)


# Qwen3-MoE-like: 4 experts of 256 (2 per token) stacked per layer as llama.cpp writes them
# ([experts, rows, columns] Q4_K / Q6_K tensors), a float32 router.
MOE = ModelShape("qwen3moe", 256, 2, 4, 2, 512, True, 1000000.0, head_dim=64, qk_norm=True,
                 experts=4, experts_used=2, expert_ffn=256)


def _per_expert_logits(model, prompt, chunks) -> torch.Tensor:
    """The prompt's logits with every MoE layer's experts run one at a time (no one-call
    kernel)."""
    blocks = [lyr.mlp for lyr in model.model.layers]
    for block in blocks:
        block._fused = False
    try:
        return pagoda_prompt_logits(model, prompt, chunks)
    finally:
        for block in blocks:
            block._fused = None


def test_moe_experts_stay_blocks_and_compute_the_dequantized_model(tmp_path):
    from pagoda.model.layers.decoder import SparseMoeBlock

    path = write_model(str(tmp_path / "moe.gguf"), MOE, "Q4_K_M", show_progress=False)
    info = GGUFFile(path).tensors
    assert info["blk.0.ffn_gate_exps.weight"].shape == (4, 256, 256) and info["blk.0.ffn_gate_inp.weight"].ggml_type == Q.F32
    model = load_model(path, show_progress=False).model
    moe = model.model.layers[0].mlp
    assert isinstance(moe, SparseMoeBlock) and len(moe.experts) == 4 and moe.top_k == 2
    # Each expert's gate/up/down: row views into the file's stacked tensors, one after another.
    gate = [e.gate_up_proj.parts[0] for e in moe.experts]
    assert all(g.file_mapped and g.out_features == 256 for g in gate)
    assert gate[1].data.data_ptr() - gate[0].data.data_ptr() == gate[0].nbytes
    reference = _load_gguf(path, torch.float32, torch.device("cpu"), False)
    assert moe._fused_args()[0] is cpu_kernels.kernels().gguf_moe   # the exact mode's one-call layer
    long_prompt = PROMPT * 7                 # 70 tokens: some expert gets more than 16 rows
    for prompt, chunks in ((PROMPT, [len(PROMPT)]), (PROMPT, [1] * len(PROMPT)), (long_prompt, [len(long_prompt)])):
        got = pagoda_prompt_logits(model, prompt, chunks)
        ref = pagoda_prompt_logits(reference.model, prompt, [len(prompt)])
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()), (got - ref).abs().max()
        assert torch.equal(_per_expert_logits(model, prompt, chunks), got)   # the per-expert path's numbers
    # The gguf mode: int8 activations for the experts, the router left in float32.
    fast = load_model(path, show_progress=False, quantization="gguf").model
    layer = fast.model.layers[0].mlp
    assert not layer.gate.int8_activations and all(e.down_proj.int8_activations for e in layer.experts)
    # One kernel call per layer (gguf_moe_int8), the per-expert path's very numbers, at
    # every step size (one token, a prompt).
    assert layer._fused_args()
    for chunks in ([len(PROMPT)], [1] * len(PROMPT)):
        fused = pagoda_prompt_logits(fast, PROMPT, chunks)
        assert torch.isfinite(fused).all() and torch.equal(fused, _per_expert_logits(fast, PROMPT, chunks))


@pytest.mark.skipif(not cpu_kernels.has_avx512_vnni(), reason="needs a CPU with AVX-512 VNNI")
def test_gguf_mode_repacks_k_quants_into_the_lanes_with_the_same_numbers(tmp_path, monkeypatch):
    """On AVX-512 VNNI CPUs the gguf mode repacks Q4_K / Q6_K weights at load (16 channels
    in the vector lanes): the experts and projections run other kernels on other bytes and
    give the very logits of the file's layout, one token at a time and as a prompt."""
    path = write_model(str(tmp_path / "moe.gguf"), MOE, "Q4_K_M", show_progress=False)
    monkeypatch.setenv("PAGODA_GGUF_REPACK", "0")
    plain = load_model(path, show_progress=False, quantization="gguf").model
    monkeypatch.delenv("PAGODA_GGUF_REPACK")
    lanes = load_model(path, show_progress=False, quantization="gguf").model
    types = {p.ggml_type.name for m in lanes.modules() if isinstance(m, BlocksLinear) and m.int8_activations
             and m is not lanes.lm_head for p in m.parts}
    assert {"Q4_K_X16", "Q6_K_X16"} <= types and not types & {"Q4_K", "Q6_K"}, types
    # the Q6_K head: repacked where the CPU has AMX (measured faster there), as it is elsewhere
    head = lanes.lm_head.parts[0].ggml_type
    assert head == (Q6_K_X16 if cpu_kernels.kernels().amx_enabled() else Q.Q6_K), head
    expert = lanes.model.layers[0].mlp.experts[1]
    assert not expert.down_proj.parts[0].file_mapped   # its own memory; the file's pages let go
    for chunks in ([len(PROMPT)], [1] * len(PROMPT)):
        got = pagoda_prompt_logits(lanes, PROMPT, chunks)
        assert torch.isfinite(got).all() and torch.equal(got, pagoda_prompt_logits(plain, PROMPT, chunks))


# gpt-oss-20b's structure, small: sinks, biases everywhere, a window on even layers, YaRN,
# top-2 of 4 experts in MXFP4 (llama.cpp's GPT-OSS files), the rest float16.
GPT_OSS = ModelShape("gpt-oss", 256, 2, 4, 2, 256, False, 150000.0, qkv_bias=True, head_dim=64, experts=4,
                     experts_used=2, expert_ffn=256, gpt_oss=True, sliding_window=4, yarn=(4.0, 64))


def test_gpt_oss_mxfp4_file_from_its_blocks_equals_its_dequantized_model(tmp_path):
    path = str(write_model(str(tmp_path / "gpt-oss.gguf"), GPT_OSS, "MXFP4", show_progress=False))
    assert {t.ggml_type for t in GGUFFile(path).tensors.values()} == {Q.MXFP4, Q.F16, Q.F32}
    loaded = load_model(path, show_progress=False)
    expert = loaded.model.model.layers[1].mlp.experts[3]
    assert isinstance(expert.down_proj, BlocksLinear) and expert.down_proj.parts[0].ggml_type == Q.MXFP4
    assert loaded.arch.layer_types == ("sliding_attention", "full_attention")
    reference = _load_gguf(path, torch.float32, torch.device("cpu"), False)  # dequantized by gguf's numpy code
    ref = pagoda_prompt_logits(reference.model, PROMPT, [len(PROMPT)])
    fast = load_model(path, show_progress=False, quantization="gguf").model
    for chunks in ([len(PROMPT)], [1] * len(PROMPT), [3, 4, 3]):
        got = pagoda_prompt_logits(loaded.model, PROMPT, chunks)
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()), (got - ref).abs().max()
        # The experts (biases, clamped SwiGLU) in one kernel call a layer, in either mode:
        # the per-expert path's very numbers.
        for model, want in ((loaded.model, got), (fast, pagoda_prompt_logits(fast, PROMPT, chunks))):
            assert all(lyr.mlp._fused_args() for lyr in model.model.layers)
            assert torch.isfinite(want).all() and torch.equal(want, _per_expert_logits(model, PROMPT, chunks))
    # The kernel's arguments checked by name: biases for every expert or none, of the right
    # sizes; an activation it has.
    kernel, gate_up, gate_up_types, down, down_types, act, gate_up_bias, down_bias = fast.model.layers[0].mlp._fused_args()
    assert act == 2 and len(gate_up_bias) == len(down_bias) == 4
    x, ids, weights = torch.randn(3, 256), torch.tensor([[0, 1], [2, 3], [1, 0]]), torch.full((3, 2), 0.5)
    args = [x, ids, weights, gate_up, gate_up_types, down, down_types]
    with pytest.raises(RuntimeError, match="none, or one gate/up and one down bias per expert"):
        kernel(*args, act, gate_up_bias[:3], down_bias[:3])
    with pytest.raises(RuntimeError, match="expert 1's biases must have 512 and 256 values"):
        kernel(*args, act, gate_up_bias[:1] + [down_bias[1]] + gate_up_bias[2:], down_bias)
    with pytest.raises(RuntimeError, match="activation 7 is not 0"):
        kernel(*args, 7, gate_up_bias, down_bias)
    assert torch.isfinite(kernel(*args, act, gate_up_bias, down_bias)).all()
