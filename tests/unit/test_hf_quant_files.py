"""pagoda.bench.hf_quant_files: random-weight GPTQ / AWQ / FP8 checkpoint folders of model
shapes, written tensor by tensor, that pagoda loads as its own blocks with the weights'
scale intended (std ~0.01-0.02, zero-mean), computes finite logits from, and tokenizes as
the bundled GGUF's tokenizer (its chat template and end-of-generation tokens too)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagoda.bench.gguf_files import ModelShape
from pagoda.bench.hf_quant_files import (
    AWQ_ORDER,
    Entry,
    _pack,
    main,
    quantization_config,
    write_checkpoint,
    write_safetensors,
)
from pagoda.hub.paths import ModelLoadError, default_model_path
from pagoda.model.hf_quant import method_for
from pagoda.model.hf_quant.awq import unpack_awq
from pagoda.model.hf_quant.int_groups import unpack_int32
from pagoda.model.layers.blocks import BlocksEmbedding, BlocksLinear
from pagoda.model.loader import load_model
from pagoda.ops import cpu_kernels
from pagoda.tokenizer import model_tokenizer
from tests.model.test_reference import pagoda_prompt_logits

# Dimensions that are whole GPTQ / AWQ groups (128) and FP8 blocks (128) but for the KV
# projections (128 x 256: one block row), two layers.
LLAMA = ModelShape("llama", 256, 2, 4, 2, 512, True, 10000.0)
QWEN2_UNTIED = ModelShape("qwen2", 256, 2, 4, 2, 384, False, 1000000.0, qkv_bias=True)
QWEN3_MOE = ModelShape("qwen3moe", 256, 1, 4, 2, 512, True, 1000000.0, head_dim=64, qk_norm=True,
                       experts=4, experts_used=2, expert_ffn=128)
KINDS = {"gptq": "PAGODA_Q4Z", "awq": "PAGODA_Q4Z", "fp8": "FP8_128"}
PROMPT = [1, 504, 2031, 17, 9, 4000, 123, 49000, 77, 3]

needs_kernels = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="the blocks need pagoda's CPU kernels")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hfq")
    return {fmt: write_checkpoint(str(root / fmt), LLAMA, fmt, seed=3, show_progress=False) for fmt in KINDS}


@needs_kernels
@pytest.mark.parametrize("fmt", list(KINDS))
def test_loads_as_blocks_and_computes_finite_logits(folders, fmt):
    path = folders[fmt]
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    assert config["quantization_config"] == quantization_config(fmt)
    assert type(method_for(config)).name == fmt

    model = load_model(path, show_progress=False).model
    linears = [m for m in model.modules() if isinstance(m, BlocksLinear) and m is not model.lm_head]
    assert len(linears) == 4 * LLAMA.layers   # fused qkv, o, fused gate/up, down per layer
    assert {p.ggml_type.name for m in linears for p in m.parts} == {KINDS[fmt]}
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.model.embed_tokens, BlocksEmbedding)
    assert model.lm_head.parts[0] is model.model.embed_tokens.blocks   # tied, bf16
    # The weights the blocks stand for: zero-mean (zero-points at the middle of 0..15), and
    # of a trained model's scale.
    w = linears[0].parts[0].dequantize()
    assert 0.005 < w.std() < 0.04 and abs(w.mean()) < 0.1 * w.std(), (w.std(), w.mean())
    for chunks in ([len(PROMPT)], [4, 3, 3]):
        logits = pagoda_prompt_logits(model, PROMPT, chunks)
        assert logits.shape == (len(PROMPT), 49152) and torch.isfinite(logits).all()
        assert 0.01 < logits.std() < 10


@needs_kernels
@pytest.mark.parametrize("shape", [QWEN2_UNTIED, QWEN3_MOE], ids=["qwen2-untied-bias", "qwen3-moe"])
def test_other_families(tmp_path, shape):
    """Qwen2's q/k/v biases and an untied (bf16) LM head; Qwen3-MoE's experts quantized, router in bf16."""
    path = write_checkpoint(str(tmp_path / "q"), shape, "gptq", show_progress=False)
    model = load_model(path, show_progress=False).model
    assert {p.ggml_type.name for p in model.lm_head.parts} == {"BF16"}
    if shape.experts:
        experts = model.model.layers[0].mlp.experts
        assert len(experts) == 4 and {p.ggml_type.name for p in experts[0].down_proj.parts} == {"PAGODA_Q4Z"}
    else:
        assert model.model.layers[0].self_attn.qkv_proj.bias is not None
        assert model.lm_head.parts[0] is not model.model.embed_tokens.blocks
    assert torch.isfinite(pagoda_prompt_logits(model, PROMPT, [len(PROMPT)])).all()


def test_tokenizer_is_the_bundled_gguf_tokenizer(folders):
    ours, gguf = model_tokenizer(folders["gptq"]), model_tokenizer(default_model_path())
    text = "Hello, world!  Tabs\tand 12345 digits, émoji 🙂 <|im_start|>user\nhi<|im_end|>"
    ids = ours.encode(text)
    assert ids == gguf.encode(text) and ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == gguf.decode(ids)   # the special tokens dropped alike
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "eos_token_ids", "add_bos_token",
                 "vocab_size", "all_special_ids"):
        assert getattr(ours, attr) == getattr(gguf, attr), attr
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == gguf.apply_chat_template(messages)
    assert rendered.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in rendered


def test_packing_is_what_pagodas_unpackers_read():
    codes = torch.arange(16 * 8, dtype=torch.int32).reshape(8, 16) % 16
    torch.testing.assert_close(unpack_int32(_pack(codes), 4, 1), codes)   # GPTQ's order
    torch.testing.assert_close(unpack_awq(_pack(codes, AWQ_ORDER)), codes)


def test_zero_points_are_stored_as_each_format_says(folders):
    """GPTQ v1 stores zero - 1, AWQ the zero in its interleaved order: both read back 7 or 8."""
    with safe_open(os.path.join(folders["gptq"], "model.safetensors"), "pt") as f:
        stored = unpack_int32(f.get_tensor("model.layers.0.self_attn.q_proj.qzeros"), 4, 1)
        assert set((stored + 1).unique().tolist()) == {7, 8}
        assert torch.equal(f.get_tensor("model.layers.0.self_attn.q_proj.g_idx"),
                           torch.arange(256, dtype=torch.int32) // 128)
    with safe_open(os.path.join(folders["awq"], "model.safetensors"), "pt") as f:
        assert set(unpack_awq(f.get_tensor("model.layers.0.mlp.down_proj.qzeros")).unique().tolist()) == {7, 8}
        assert f.get_tensor("model.layers.0.mlp.down_proj.qweight").shape == (512, 256 // 8)
    with safe_open(os.path.join(folders["fp8"], "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
        assert w.dtype == torch.float8_e4m3fn and torch.isfinite(w.float()).all()
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight_scale_inv").shape == (1, 2)
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def test_the_same_seed_writes_the_same_file_and_another_seed_another(tmp_path):
    files = [write_checkpoint(str(tmp_path / name), LLAMA, "awq", seed=seed, show_progress=False)
             for name, seed in (("a", 1), ("b", 1), ("c", 2))]
    data = [Path(p, "model.safetensors").read_bytes() for p in files]
    assert data[0] == data[1] and data[0] != data[2]


def test_streamed_file_matches_safetensors_reader(tmp_path):
    entries = [Entry("a", torch.float16, (3, 5), lambda: torch.arange(15, dtype=torch.float16).reshape(3, 5)),
               Entry("b", torch.int32, (7,), lambda: torch.arange(7, dtype=torch.int32) - 3),
               Entry("c", torch.bfloat16, (2,), lambda: torch.tensor([1.5, -2.0], dtype=torch.bfloat16))]
    path = str(tmp_path / "x.safetensors")
    write_safetensors(path, entries)
    with safe_open(path, "pt") as f:
        assert sorted(f.keys()) == ["a", "b", "c"]
        for e in entries:
            assert torch.equal(f.get_tensor(e.name), e.make())
    bad = [Entry("a", torch.float16, (3,), lambda: torch.zeros(4, dtype=torch.float16))]
    with pytest.raises(AssertionError, match="planned"):
        write_safetensors(str(tmp_path / "bad.safetensors"), bad)
    assert os.listdir(tmp_path) == ["x.safetensors"]   # nor a partial file left


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown shape 'nope'"):
        write_checkpoint(str(tmp_path / "x"), "nope", "gptq")
    with pytest.raises(ValueError, match="format must be one of gptq, awq, fp8"):
        write_checkpoint(str(tmp_path / "x"), LLAMA, "exl2")
    with pytest.raises(ValueError, match="GPT-OSS"):
        write_checkpoint(str(tmp_path / "x"), "gpt-oss-20b", "gptq")
    odd = ModelShape("llama", 192, 1, 3, 1, 384, True, 10000.0)   # 192 inputs: not whole groups of 128
    with pytest.raises(ValueError, match="whole groups of 128"):
        write_checkpoint(str(tmp_path / "odd"), odd, "awq", show_progress=False)
    # An unfinished folder has no config.json: the loader says so rather than reading it.
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path / "odd"), show_progress=False)
    with pytest.raises(SystemExit):
        main(["llama-3.2-1b", str(tmp_path / "y"), "--format", "int3"])


def _compare_module():
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("bench_compare", root / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_runs_pagoda_on_a_folder_and_refuses_what_cannot_serve_it(folders, tmp_path):
    compare = _compare_module()
    assert compare.check_engines(["pagoda", "pagoda-gguf", "pagoda-gguf-offline", "hf"], folders["gptq"]) == []
    assert compare.check_engines(["pagoda"], folders["fp8"]) == []
    assert compare.check_engines(["llama-server", "pagoda-int8"], default_model_path()) == []   # a GGUF file
    problems = compare.check_engines(["pagoda", "llama-server", "openvino-int4"], folders["awq"])
    assert len(problems) == 2 and all("reads GGUF files only" in p for p in problems)
    # FP8 has no gguf mode; pagoda's loader says so, before any server starts.
    (problem,) = compare.check_engines(["pagoda", "pagoda-gguf"], folders["fp8"])
    assert problem.startswith("pagoda-gguf: ") and "--quantization gguf does not apply" in problem
    args = argparse.Namespace(input_len=128, output_len=64, pagoda_args="", pagoda_threads=None,
                              model=folders["gptq"])
    spec = compare.server_spec("pagoda", args, 8000, 1)
    assert spec.cmd[spec.cmd.index("serve") + 1] == folders["gptq"]
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="llama-server reads GGUF files only"):
        compare.main(["run", "--model", folders["gptq"], "--engines", "pagoda,llama-server",
                      "--out-dir", str(out)])
    assert not out.exists()   # refused before anything ran
