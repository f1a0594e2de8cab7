"""What the hybrid families (pagoda/model/models/lfm2.py, granite_hybrid.py) share: the
pre-norm block whose mixer is a state layer or attention, the order a state layer walks
the step's sequences in, and their checkpoint names."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from pagoda.attention import AttentionMetadata
from pagoda.attention.state import StepStates
from pagoda.model.arch import ModelArchConfig
from pagoda.model.layers.decoder import Attention, GatedMLP, SparseMoeBlock
from pagoda.model.layers.norm import RMSNorm


def renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint name with each (old, new) part replaced, in order."""
    for old, new in renames:
        name = name.replace(old, new)
    return name


def sequence_spans(meta: AttentionMetadata) -> list[tuple[int, int, int]]:
    """(first token, tokens, tokens before them) of every sequence of the step, in the
    metadata's order (decodes, one token each, then the prompt chunks)."""
    return [(i, 1, 1) for i in range(meta.num_decodes)] + \
        [(p.token_start, p.query_len, p.context_len) for p in meta.prefills]


def processing_order(plan: StepStates) -> list[int]:
    """The sequences a state layer computes, those restoring a block's end state (a prefix
    hit) last: the block may be one another sequence of this step computes."""
    n = len(plan.slots)
    return [i for i in range(n) if plan.restore[i] < 0] + [i for i in range(n) if plan.restore[i] >= 0]


class HybridDecoderLayer(nn.Module):
    """Pre-norm: a state layer (``mixer_name``: the checkpoint's name for it) or attention,
    then the MLP (or experts), each scaled by the residual multiplier (Granite's; 1 for
    others) before its add; the residual stream carried separately (as ``DecoderLayer``)."""

    mixer_name: ClassVar[str]

    def __init__(self, config: ModelArchConfig, layer_idx: int, mixer: nn.Module | None) -> None:
        super().__init__()
        self.is_state = mixer is not None
        if self.is_state:
            setattr(self, self.mixer_name, mixer)
        else:
            self.self_attn = Attention(config, layer_idx)
        self.mlp = SparseMoeBlock(config) if config.is_moe_layer(layer_idx) else GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier

    @property
    def rope_table(self) -> str:
        return "global" if self.is_state else self.self_attn.rope_table

    def forward(self, x, residual, cos, sin, cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        if self.is_state:
            h = getattr(self, self.mixer_name)(h, cache, meta)
        else:
            h = self.self_attn(h, cos, sin, cache, meta)
        m = self.residual_multiplier
        h, residual = self.post_attention_layernorm(h * m if m != 1.0 else h, residual)
        h = self.mlp(h)
        return (h * m if m != 1.0 else h), residual
