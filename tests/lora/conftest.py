"""LoRA fixtures: adapters saved with peft for the tiny random Llama and the default model."""

from __future__ import annotations

import pytest
import torch

from tests.lora.helpers import make_adapter


@pytest.fixture(scope="session")
def tiny_hf(tiny_llama_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_adapters(tiny_hf, tmp_path_factory) -> dict[str, str]:
    """Four adapters covering every target, stacked slices alone, rsLoRA and per-module ranks."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("tiny-loras")
    return {
        "all": make_adapter(tiny_hf, str(root / "all"), seed=1, rank=8, alpha=16, b_std=0.2),
        "kv-rslora": make_adapter(tiny_hf, str(root / "kv"), seed=2, rank=4, alpha=8, b_std=0.3,
                                  targets=("k_proj", "v_proj"), use_rslora=True),
        "mlp": make_adapter(tiny_hf, str(root / "mlp"), seed=3, rank=16, alpha=8, b_std=0.2,
                            targets=("gate_proj", "up_proj", "down_proj"), rank_pattern={"down_proj": 4}),
        "q-o": make_adapter(tiny_hf, str(root / "qo"), seed=4, rank=2, alpha=4, b_std=0.3,
                            targets=("q_proj", "o_proj")),
    }


@pytest.fixture(scope="session")
def default_adapters(hf_default_model, tmp_path_factory) -> dict[str, str]:
    """Three adapters for the bundled SmolLM2-135M (GGUF), strong enough to change its greedy output."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("default-loras")
    return {
        "all": make_adapter(hf_default_model, str(root / "all"), seed=11, rank=8, alpha=16, b_std=0.02),
        "attn": make_adapter(hf_default_model, str(root / "attn"), seed=12, rank=16, alpha=16, b_std=0.03,
                             targets=("q_proj", "k_proj", "v_proj", "o_proj"), use_rslora=True),
        "mlp": make_adapter(hf_default_model, str(root / "mlp"), seed=13, rank=4, alpha=8, b_std=0.03,
                            targets=("gate_proj", "up_proj", "down_proj")),
    }
