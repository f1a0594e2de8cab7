"""Attention over the paged KV cache behind one interface (``backend.py``): the metadata a
step builds once, the backends that build and read it, and the call every model layer
makes (``paged_attention``)."""

from __future__ import annotations

import torch

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.cpu import CpuBackend, kernel_cache
from pagoda.attention.kv_quant import QuantizedKVCache
from pagoda.attention.metadata import AttentionMetadata, PrefillChunk
from pagoda.attention.selector import ATTENTION_BACKENDS, select_backend

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "PrefillChunk", "kernel_cache",
           "paged_attention", "rope_writes_kv", "select_backend"]

# Metadata built by ``AttentionMetadata.build`` alone (tests, drafts, the roofline) runs the
# path it was built for: the CPU kernel where it holds decode block tables, torch otherwise.
_UNNAMED = CpuBackend()


def paged_attention(
    q: torch.Tensor,          # [T, H, D]
    k: torch.Tensor,          # [T, KVH, D]
    v: torch.Tensor,          # [T, KVH, D]
    kv_cache: torch.Tensor | QuantizedKVCache,   # [2, num_blocks, block_size, KVH, D]
    meta: AttentionMetadata,
    scale: float,
    kv_written: bool = False,  # the caller already wrote k and v to their slots
    window: int | None = None,  # a sliding-window layer's window
    softcap: float | None = None,  # Gemma 2: scores -> softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None,  # [H] GPT-OSS: a logit per head in every softmax, with no value
) -> torch.Tensor:            # [T, H, D]
    backend = meta.backend if meta.backend is not None else _UNNAMED
    return backend.forward(q, k, v, kv_cache, meta, scale, kv_written, window, softcap, sinks)


def rope_writes_kv(meta: AttentionMetadata) -> bool:
    """Whether a layer may let the CPU's fused RoPE op store K/V for this step's backend."""
    return meta.backend is None or meta.backend.rope_writes_kv
