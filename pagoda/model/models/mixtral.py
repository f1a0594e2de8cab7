"""Mixtral: Llama's decoder with a mixture of experts in place of every MLP (top-2 of 8,
softmax router, the two weights renormalised). Checkpoints name the block
``block_sparse_moe`` and an expert's projections w1 (gate), w3 (up), w2 (down);
llama.cpp writes Mixtral as a ``llama`` file with ``llama.expert_count`` set, which
``LlamaForCausalLM.arch_from_gguf`` reads."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig, moe_fields
from pagoda.model.models.llama import LlamaForCausalLM

_RENAMES = (("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def block_sparse_moe_name(name: str) -> str:
    """Mixtral's expert names (block_sparse_moe.experts.N.w1) as the model's (mlp.experts.N.gate_proj)."""
    if ".block_sparse_moe." not in name:
        return name
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


class MixtralForCausalLM(LlamaForCausalLM):
    unquantized_modules = (".mlp.gate",)

    @classmethod
    def hf_name(cls, name: str) -> str:
        return block_sparse_moe_name(name)

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        fields = ModelArchConfig.hf_fields(config, architecture)
        return ModelArchConfig(**fields, **moe_fields(config["num_local_experts"], config["num_experts_per_tok"],
                                                      fields["intermediate_size"], True))
