"""Falcon-H1's tiny checkpoints for tests/model/test_hybrid.py: every layer attention and a
Mamba-2 mixer side by side (4 heads of 24 in 2 groups, d_state 8, mamba_d_ssm 96, not
mamba_expand x hidden), every multiplier away from 1; the mixer's gate plain (``falconh1``,
as the published checkpoints) or with its group RMSNorm before the gate, the embedding tied
(``falconh1norm``).

Their Mamba states are 18 KiB a request (4 layers of 128 x 3 convolution inputs and 4 x 24 x 8
of S, float32), a 16-token block's KV 16 KiB: 64-token blocks keep their end states, and
16-token ones turn prefix caching off (test_a_state_larger_than_a_blocks_kv_...). ``falconh1``
as llama.cpp's ``falcon-h1`` file too (``write_falconh1_gguf``); not ``falconh1norm``, whose
file would differ from transformers as llama.cpp's does: its norm comes after the gate, and
a tied embedding carries the embedding's multiplier into the logits."""

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
    "falconh1": HybridFamily(_falconh1, block=64, gguf_writer=lambda *a: write_falconh1_gguf(*a)),
    "falconh1norm": HybridFamily(_falconh1_norm, block=64),
}


def write_falconh1_gguf(model, path: str, hf_dir: str) -> str:
    """A tiny Falcon-H1 checkpoint as llama.cpp's FalconH1Model writes a ``falcon-h1`` file:
    the Mamba tensors as its Mamba2Model stores them, every multiplier folded into the weights
    (in_proj's per part), the MLP's norm bare as ``blk.N.ffn_pre_norm``; Q/K not permuted."""
    from tests.model.granite_gguf_writer import add_tensor, finish, gguf_writer, mamba_tensor, read_state

    c = model.config
    n, inner, groups = c.num_hidden_layers, c.mamba_d_ssm, c.mamba_n_groups
    w, table = gguf_writer(path, "falcon-h1", n)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(n)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_ssm_conv_kernel(c.mamba_d_conv)
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(c.mamba_d_state)
    w.add_ssm_time_step_rank(c.mamba_n_heads)
    w.add_ssm_group_count(groups)
    m0, m1 = c.mlp_multipliers
    gs = groups * c.mamba_d_state
    for name, t in read_state(hf_dir).items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name, t = mamba_tensor(name, t.float(), groups)
        if "down_proj" in name:
            t = t * m1
        elif "gate_proj" in name:
            t = t * m0
        elif "k_proj" in name:
            t = t * c.key_multiplier * c.attention_in_multiplier
        elif "q_proj" in name or "v_proj" in name:
            t = t * c.attention_in_multiplier
        elif "o_proj" in name:
            t = t * c.attention_out_multiplier
        elif "out_proj" in name:
            t = t * c.ssm_out_multiplier
        elif "in_proj" in name:
            t = t * c.ssm_in_multiplier
            for (a, b), k in zip([(0, inner), (inner, 2 * inner), (2 * inner, 2 * inner + gs),
                                  (2 * inner + gs, 2 * inner + 2 * gs), (2 * inner + 2 * gs, t.shape[0])],
                                 c.ssm_multipliers):
                t[a:b] *= k
        elif "lm_head" in name:
            t = t * c.lm_head_multiplier
        elif "embed_tokens" in name:
            t = t * c.embedding_multiplier
        add_tensor(w, table, name, t)
    return finish(w, path)
