"""What the hybrid families (pagoda/model/models/lfm2.py, granite_hybrid.py) share: the
pre-norm block whose mixer is a state layer or attention, the order a state layer walks
the step's sequences in, and their checkpoint names."""

from __future__ import annotations

import itertools
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


def state_kernels(states: torch.Tensor, meta: AttentionMetadata | None = None):
    """The kernels a state layer runs this step over ``states``: those of the step's
    attention backend (``AttentionBackend.state_kernels``: the CPU backend's C++ kernels for
    float32 states; None, the layer's torch path, for the torch reference and Triton
    backends); where no backend built the metadata (calibration, kernel tests), the CPU
    backend's choice."""
    backend = getattr(meta, "backend", None)
    if backend is not None:
        return backend.state_kernels(states)
    from pagoda.attention.cpu import cpu_state_kernels

    return cpu_state_kernels(states)


def _longs(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def kernel_calls(meta: AttentionMetadata) -> list:
    """The state kernels' calls of a step (pagoda/csrc/recurrent.cpp), made once a step for
    every state layer: sequences not restoring a prefix hit's saved state, then those that
    do (the state they restore may be one the first call saves); per call, the (slot, saved
    entry) restores before it, its token rows (a slice, or an index tensor), and its index
    tensors: slots, token offsets, and the saves' sequence, offset and entry."""
    plan: StepStates = meta.states
    calls = plan.memo.get("kernel_calls")
    if calls is not None:
        return calls
    spans = sequence_spans(meta)
    calls = plan.memo["kernel_calls"] = []
    first = [i for i in range(len(spans)) if plan.restore[i] < 0]
    later = [i for i in range(len(spans)) if plan.restore[i] >= 0]
    for group in (first, later):
        if not group:
            continue
        rows = [r for i in group for r in range(spans[i][0], spans[i][0] + spans[i][1])]
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))   # (decodes first: usually so)
        take = slice(rows[0], rows[0] + len(rows)) if contiguous else torch.tensor(rows)
        saves = [(j, at, row) for j, i in enumerate(group) for at, row in plan.checkpoints[i]]
        args = (_longs(plan.slots[i] for i in group),
                _longs(itertools.accumulate((spans[i][1] for i in group), initial=0)),
                _longs(s[0] for s in saves), _longs(s[1] for s in saves), _longs(s[2] for s in saves))
        calls.append(([(plan.slots[i], plan.restore[i]) for i in group if plan.restore[i] >= 0], take, args))
    return calls


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
