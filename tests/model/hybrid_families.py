"""The tiny random checkpoints tests/model/test_hybrid.py runs every hybrid family test on:
name -> ``HybridFamily`` (its transformers config, the llama.cpp architecture its GGUF file
is written as, or None where pagoda reads no GGUF file of it yet, and the KV block size
the tests use: large enough that a block's KV outweighs a request's state where the
family's states are large). Families of their own module (tests/model/hybrid_*.py) are
merged in by ``all_families``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import transformers

from tests.model.granite_gguf_writer import write_granite_hybrid_gguf
from tests.model.lfm2_gguf_writer import write_lfm2moe_gguf


@dataclass(frozen=True)
class HybridFamily:
    config: Callable[[], Any]     # -> a transformers config
    gguf_arch: str | None = None
    block: int = 16
    # (hf model, path, hf folder) -> the GGUF file written, where tests/model/hf_to_gguf.py's
    # write_gguf does not know the family (None: write_gguf with gguf_arch)
    gguf_writer: Callable[[Any, str, str], str] | None = None
    # How far prompt logprobs may be from transformers'
    logprob_tol: float = 1e-3
    # The share of prompt positions whose top token the bf16 / int8 / gguf modes keep
    quantized_agree: float = 0.85


# What every family's tiny checkpoint shares (each family maps it to its own keys).
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=4, max_position_embeddings=1024, initializer_range=0.3, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)


def _lfm2():
    return transformers.Lfm2Config(**TINY, layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3,
                                   block_auto_adjust_ff_dim=False)


def _lfm2moe():   # the first layer dense, then 8 experts of 32, 2 per token
    return transformers.Lfm2MoeConfig(**TINY, layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3,
                                      moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                      num_dense_layers=1)


def _granite4h(**overrides):   # Mamba-2 layers (4 heads of 32 in 2 groups, d_state 8) and attention
    return transformers.GraniteMoeHybridConfig(**{
        **TINY, "shared_intermediate_size": 96, "num_local_experts": 0,
        "layer_types": ["mamba", "attention", "mamba", "attention"], "mamba_n_heads": 4, "mamba_n_groups": 2,
        "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 16, "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 3.0,
        "position_embedding_type": "rope", **overrides})


def _granite4hmoe():   # Granite 4.0-H Tiny's structure: 4 experts of 32, 2 per token, beside the shared MLP
    return _granite4h(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)


FAMILIES: dict[str, HybridFamily] = {
    "lfm2": HybridFamily(_lfm2, "lfm2"),
    "lfm2moe": HybridFamily(_lfm2moe, "lfm2moe", gguf_writer=write_lfm2moe_gguf),
    # Blocks whose KV outweighs a request's state (this Granite 4.0-H's Mamba states are
    # 12 KiB, a 16-token block's KV 8 KiB).
    "granite4h": HybridFamily(_granite4h, block=64, gguf_writer=write_granite_hybrid_gguf),
    "granite4hmoe": HybridFamily(_granite4hmoe, "granitehybrid", block=64, gguf_writer=write_granite_hybrid_gguf),
}


def all_families() -> dict[str, HybridFamily]:
    """These families and those of every tests/model/hybrid_*.py module."""
    import importlib
    import pkgutil

    import tests.model as package

    families = dict(FAMILIES)
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("hybrid_") and info.name != "hybrid_families":
            families.update(importlib.import_module(f"tests.model.{info.name}").FAMILIES)
    return families
