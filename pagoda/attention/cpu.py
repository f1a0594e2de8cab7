"""The CPU backend: pagoda's C++ kernels (``pagoda/csrc``). One kernel call reads every
decode's K/V in place through its block table (no copy, no padding to the longest
context; a windowed layer starts each sequence at its window); prompt chunks run the
torch backend's SDPA. The CPU's fused RoPE op writes K/V into the cache it reads
(``kernel_cache``), and decode-only steps may run the whole stack of layers in one C++
call (``pagoda/model/layers/decode_stack.py``), which reads this backend's metadata."""

from __future__ import annotations

import torch

from pagoda.attention.kv_quant import QuantizedKVCache
from pagoda.attention.metadata import AttentionMetadata
from pagoda.attention.torch_ref import TorchBackend
from pagoda.ops import cpu_kernels


def kernel_cache(kv_cache: torch.Tensor | QuantizedKVCache) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """What pagoda's CPU kernels read and write in place: (cache tensor, None) for a float32
    or float16 cache, (int8 values, scales) for an int8 QuantizedKVCache; None for the others
    (fp8, bfloat16), which go through torch."""
    if isinstance(kv_cache, QuantizedKVCache):
        return (kv_cache.data, kv_cache.scales) if kv_cache.dtype == torch.int8 else None
    return (kv_cache, None) if kv_cache.dtype in (torch.float32, torch.float16) else None


def cpu_state_kernels(states: torch.Tensor):
    """pagoda's C++ state kernels where they apply: float32, contiguous states on the CPU."""
    if states.dtype != torch.float32 or states.device.type != "cpu" or not states.is_contiguous():
        return None
    return cpu_kernels.kernels()


class CpuBackend(TorchBackend):
    name = "cpu"

    def state_kernels(self, states: torch.Tensor):
        return cpu_state_kernels(states)

    def build(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device, group: int = 0) -> AttentionMetadata:  # fmt: skip
        meta = AttentionMetadata.build(query_lens, context_lens, block_tables, block_size, device, decode_kernel=True)
        meta.backend = self
        return meta

    def decodes_in_place(self, meta: AttentionMetadata) -> bool:
        return meta.decode_block_tables is not None

    def decode_in_place(self, q: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache, meta: AttentionMetadata,
                        scale: float, window: int | None, softcap: float | None,
                        sinks: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        cache, scales = kernel_cache(kv_cache)
        return cpu_kernels.kernels().paged_decode_attention(
            q, cache, meta.decode_block_tables, meta.decode_seq_lens, scale, scales, window or 0, softcap or 0.0,
            None if sinks is None else sinks.float()
        )
