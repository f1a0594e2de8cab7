"""`pagoda bench throughput/embed --compare-hf`: transformers runs on pagoda's device and
dtype (it ran on the CPU in float32 whatever --device said: a GPU run compared pagoda on
the GPU with transformers on the CPU)."""

from __future__ import annotations

import torch

from pagoda.bench.throughput import bench_hf, hf_placement, load_hf
from pagoda.config import EngineConfig


def test_hf_comparison_takes_pagodas_device_and_dtype(tiny_llama_dir):
    assert hf_placement(EngineConfig(model=tiny_llama_dir, device="cuda", dtype="bfloat16")) == (
        torch.device("cuda"), torch.bfloat16)
    assert hf_placement(EngineConfig(model=tiny_llama_dir, device="cuda:1", dtype="float16")) == (
        torch.device("cuda:1"), torch.float16)
    # auto is float32; so is the CPU's bf16 mode, whose reference stays float32.
    assert hf_placement(EngineConfig(model=tiny_llama_dir)) == (torch.device("cpu"), torch.float32)
    assert hf_placement(EngineConfig(model=tiny_llama_dir, dtype="bfloat16"))[1] == torch.float32
    model = load_hf(tiny_llama_dir, EngineConfig(model=tiny_llama_dir, device="cpu", dtype="float16"))
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def test_bench_hf_generates_every_token_and_names_its_placement(tiny_llama_dir):
    prompts = [[5 + i + j for j in range(12)] for i in range(3)]
    result = bench_hf(tiny_llama_dir, EngineConfig(model=tiny_llama_dir), prompts, 6, 2)
    assert result["output_tokens"] == 18 and result["input_tokens"] == 36
    assert result["engine"] == "hf-transformers (static batch 2)"
    result = bench_hf(tiny_llama_dir, EngineConfig(model=tiny_llama_dir, dtype="float16"), prompts, 6, 3)
    assert result["engine"] == "hf-transformers (static batch 3, cpu float16)"
    assert result["output_tokens"] == 18
