"""Memory while serving pre-quantized checkpoints (FP8, NVFP4, GPTQ): the weights stay in
their blocks (about the checkpoint's size), no float copy is made at load or while running,
and the checkpoint's pages of a repacked weight are let go."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from pagoda.ops import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="float blocks need pagoda's CPU kernels")

HIDDEN, INTER, LAYERS, VOCAB = 1024, 2816, 4, 512

RSS_SCRIPT = r"""
import gc, os, sys
from pagoda.ops import cpu_kernels
from pagoda.model.loader import load_model
cpu_kernels.kernels()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
del load_model(sys.argv[1], show_progress=False).model  # imports and one-time set-up
gc.collect()
before = rss()
loaded = load_model(sys.argv[1], show_progress=False)
from tests.model.test_reference import pagoda_prompt_logits
pagoda_prompt_logits(loaded.model, [1, 2, 3, 4], [4])
print(before, rss())
"""


def _layer_tensors(fmt: str, name: str, out_f: int, in_f: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tensors of one projection in the format (random bytes: memory, not values, matters)."""
    if fmt == "fp8":
        q = torch.randint(0, 0x7E, (out_f, in_f), generator=g, dtype=torch.uint8)
        return {f"{name}.weight": q.view(torch.float8_e4m3fn),
                f"{name}.weight_scale_inv": torch.rand(-(-out_f // 128), -(-in_f // 128), generator=g) / 100}
    if fmt == "gptq":   # 4 bits, groups of 128, packed int32 (values: any bits)
        groups = in_f // 128
        return {f"{name}.qweight": torch.randint(-2**31, 2**31 - 1, (in_f // 8, out_f), generator=g, dtype=torch.int32),
                f"{name}.qzeros": torch.randint(-2**31, 2**31 - 1, (groups, out_f // 8), generator=g, dtype=torch.int32),
                f"{name}.scales": (torch.rand(groups, out_f, generator=g) / 100).half(),
                f"{name}.g_idx": torch.arange(in_f, dtype=torch.int32) // 128}
    return {f"{name}.weight_packed": torch.randint(0, 256, (out_f, in_f // 2), generator=g, dtype=torch.uint8),
            f"{name}.weight_scale": (torch.rand(out_f, in_f // 16, generator=g) * 400).to(torch.float8_e4m3fn),
            f"{name}.weight_global_scale": torch.tensor([1000.0])}


def _checkpoint(path: str, fmt: str) -> int:
    """A Llama checkpoint of random quantized projections; returns its size in bytes."""
    os.makedirs(path)
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g).bfloat16(),
               "model.norm.weight": torch.ones(HIDDEN).bfloat16()}
    kv = 2 * 64
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(HIDDEN).bfloat16()
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(HIDDEN).bfloat16()
        for name, out_f, in_f in (("self_attn.q_proj", HIDDEN, HIDDEN), ("self_attn.k_proj", kv, HIDDEN),
                                  ("self_attn.v_proj", kv, HIDDEN), ("self_attn.o_proj", HIDDEN, HIDDEN),
                                  ("mlp.gate_proj", INTER, HIDDEN), ("mlp.up_proj", INTER, HIDDEN),
                                  ("mlp.down_proj", HIDDEN, INTER)):
            tensors.update(_layer_tensors(fmt, f"{p}.{name}", out_f, in_f, g))
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if fmt == "fp8":
        qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    elif fmt == "gptq":
        qconfig = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False}
    else:
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}
        qconfig = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
              "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
              "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16", "quantization_config": qconfig}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return os.path.getsize(os.path.join(path, "model.safetensors"))


@pytest.mark.slow   # a subprocess each, ~5-12 s
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "gptq"])
def test_memory_stays_near_the_checkpoint_size(tmp_path, fmt):
    if fmt == "nvfp4":
        pytest.importorskip("compressed_tensors")
    path = str(tmp_path / fmt)
    size = _checkpoint(path, fmt)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, path], capture_output=True, text=True, check=True,
                         timeout=600, env=env, cwd=root).stdout.split()
    before, after = map(int, out)
    # FP8 blocks: 8.25 bits per weight (8 in the file), NVFP4 and GPTQ: 4.75 (4.5, 4.25); the
    # file's pages kept next to them would be 2x, a float32 copy 4x / 7x the checkpoint.
    assert after - before < 1.3 * size + (16 << 20), (after - before, size)
