"""GGUF files of tiny LFM2-MoE checkpoints as llama.cpp's converter (its LFM2MoeModel) writes
them (float32), for tests/model/hybrid_families.py's ``lfm2moe`` family."""

from __future__ import annotations

import re

import torch

from tests.model.granite_gguf_writer import add_tensor, finish, gguf_writer, read_state

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.feed_forward\.experts\.(\d+)\.(w[123])\.weight$")


def write_lfm2moe_gguf(model, path: str, hf_dir: str) -> str:
    """A tiny LFM2-MoE checkpoint under ``lfm2moe``: the base converter's keys (KV heads per
    layer, 0 for the convolutions; feed_forward_length the dense layers' width; expert_count,
    expert_used_count), then expert_feed_forward_length, leading_dense_block_count,
    expert_gating_func (sigmoid), vocab_size and shortconv.l_cache; the convolutions squeezed
    to [hidden, L]; each layer's experts stacked per projection ([experts, rows, columns],
    named ``layers.N.feed_forward.experts.wK`` as the converter merges them: ffn_gate_exps,
    ffn_down_exps, ffn_up_exps); ``expert_bias`` renamed ``expert_bias.bias``
    (``blk.N.exp_probs_b.bias``); the router ``feed_forward.gate`` as ffn_gate_inp."""
    from gguf import ExpertGatingFuncType

    c = model.config
    n = c.num_hidden_layers
    w, table = gguf_writer(path, "lfm2moe", n)
    w.add_block_count(n)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if t == "full_attention" else 0 for t in c.layer_types])
    rope = getattr(c, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(c, "rope_theta", 1000000.0))))
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_leading_dense_block_count(c.num_dense_layers)
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    w.add_vocab_size(c.vocab_size)
    w.add_shortconv_l_cache(c.conv_L_cache)
    stacks: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in read_state(hf_dir).items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        m = _EXPERT.match(name)
        if m is not None:
            stacks.setdefault((int(m[1]), m[3]), {})[int(m[2])] = t
            continue
        if name.endswith(".conv.conv.weight"):
            t = t.squeeze(1)   # [hidden, 1, L] -> [hidden, L]
        if name.endswith(".expert_bias"):
            name += ".bias"
        add_tensor(w, table, name, t)
    for (bid, proj), parts in sorted(stacks.items()):
        stacked = torch.stack([parts[e] for e in range(c.num_experts)])
        add_tensor(w, table, f"layers.{bid}.feed_forward.experts.{proj}.weight", stacked)
    return finish(w, path)
