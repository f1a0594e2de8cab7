"""Nemotron-H's tiny checkpoint for tests/model/test_hybrid.py: one layer of each kind and
two of the state and attention ones (mamba, attention, moe, mamba, attention, mlp); Mamba-2
with 4 heads of 32 in 2 groups, d_state 8; 8 relu² experts of 32 in 2 groups (1 kept),
2 per token, scaled 2.5, a shared expert of 64.

Its Mamba states are 12 KiB a request (2 layers of 160 x 3 convolution inputs and 4 x 32 x 8
of S, float32), a 16-token block's KV (2 attention layers of 2 x 16 wide K and V) 8 KiB:
64-token blocks keep their end states.

tests/model/test_nemotron_h.py covers what the shared family tests cannot."""

from __future__ import annotations

import transformers

from tests.model.hybrid_families import TINY, HybridFamily

_LAYERS = ["mamba", "attention", "moe", "mamba", "attention", "mlp"]


def _nemotronh(**overrides):
    tiny = {k: v for k, v in TINY.items() if k not in ("num_hidden_layers", "intermediate_size")}
    return transformers.NemotronHConfig(**{
        **tiny, "intermediate_size": 96, "layers_block_type": _LAYERS, "head_dim": 16, "mamba_num_heads": 4,
        "mamba_head_dim": 32, "n_groups": 2, "ssm_state_size": 8, "conv_kernel": 4, "chunk_size": 16,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 64, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
        **overrides})


FAMILIES = {"nemotronh": HybridFamily(_nemotronh, block=64)}


