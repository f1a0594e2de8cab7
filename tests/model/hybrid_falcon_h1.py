"""Falcon-H1's tiny checkpoints for tests/model/test_hybrid.py: every layer attention and a
Mamba-2 mixer side by side (4 heads of 24 in 2 groups, d_state 8, mamba_d_ssm 96, not
mamba_expand x hidden), every multiplier away from 1; the mixer's gate plain (``falconh1``,
as the published checkpoints) or with its group RMSNorm before the gate, the embedding tied
(``falconh1norm``).

Their Mamba states are 18 KiB a request (4 layers of 128 x 3 convolution inputs and 4 x 24 x 8
of S, float32), a 16-token block's KV 16 KiB: 64-token blocks keep their end states, and
16-token ones turn prefix caching off (test_a_state_larger_than_a_blocks_kv_...). No GGUF
file yet: pagoda refuses Falcon-H1's (pagoda/model/models/falcon_h1.py)."""

from __future__ import annotations

import transformers

from tests.model.hybrid_families import TINY, HybridFamily


def _falconh1(**overrides):
    return transformers.FalconH1Config(**{
        **TINY, "mamba_d_ssm": 96, "mamba_n_heads": 4, "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_chunk_size": 16, "mamba_rms_norm": False, "embedding_multiplier": 2.0,
        "lm_head_multiplier": 0.5, "key_multiplier": 0.7, "attention_in_multiplier": 1.3,
        "attention_out_multiplier": 0.8, "ssm_in_multiplier": 1.2, "ssm_out_multiplier": 0.6,
        "ssm_multipliers": [0.9, 1.1, 0.8, 1.25, 0.7], "mlp_multipliers": [1.2, 0.75], **overrides})


def _falconh1_norm():
    return _falconh1(mamba_rms_norm=True, mamba_norm_before_gate=True, tie_word_embeddings=True)


FAMILIES: dict[str, HybridFamily] = {
    "falconh1": HybridFamily(_falconh1, block=64),
    "falconh1norm": HybridFamily(_falconh1_norm, block=64),
}
