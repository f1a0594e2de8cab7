"""Mixtral: Llama's decoder with a mixture of experts in place of every MLP (top-2 of 8,
softmax router, the two weights renormalised). Checkpoints name the block
``block_sparse_moe`` and an expert's projections w1 (gate), w3 (up), w2 (down);
llama.cpp writes Mixtral as a ``llama`` file with ``llama.expert_count`` set."""

from __future__ import annotations

from typing import Any

from pagoda.model.arch import ModelArchConfig
from pagoda.model.models.llama import LlamaForCausalLM

_RENAMES = (("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def moe_fields(experts: int, per_token: int, intermediate: int, norm_topk_prob: bool) -> dict[str, Any]:
    return dict(num_experts=experts, num_experts_per_tok=per_token, moe_intermediate_size=intermediate,
                norm_topk_prob=norm_topk_prob)


def gguf_moe_layers(tensor_names: set[str], layers: int) -> tuple[bool, ...] | None:
    """Which layers of a GGUF file have experts (a router, ``ffn_gate_inp``); None: all."""
    moe = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(layers))
    return None if all(moe) else moe


class MixtralForCausalLM(LlamaForCausalLM):
    unquantized_modules = (".mlp.gate",)

    @classmethod
    def hf_name(cls, name: str) -> str:
        if ".block_sparse_moe." not in name:
            return name
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return name

    @classmethod
    def arch_from_hf(cls, config: dict[str, Any], architecture: str) -> ModelArchConfig:
        fields = ModelArchConfig.hf_fields(config, architecture)
        return ModelArchConfig(**fields, **moe_fields(config["num_local_experts"], config["num_experts_per_tok"],
                                                      fields["intermediate_size"], True))

    @classmethod
    def arch_from_gguf(cls, md: dict[str, Any], tensor_names: set[str], architecture: str) -> ModelArchConfig:
        p = f"{md['general.architecture']}."
        fields = ModelArchConfig.gguf_fields(md, tensor_names, architecture)
        return ModelArchConfig(**fields, **moe_fields(md[p + "expert_count"], md[p + "expert_used_count"],
                                                      fields["intermediate_size"], True),
                               moe_layers=gguf_moe_layers(tensor_names, fields["num_hidden_layers"]))
