"""How many KV blocks a process can hold: the engine core (rank 0) and every
tensor-parallel worker size their own pools with the same rule."""

from __future__ import annotations

import torch

from pagoda.config import EngineConfig
from pagoda.host import available_memory_bytes
from pagoda.worker.model_runner import kv_cache_bytes_per_block

# Default KV budget on CPU: this share of available memory, at most this much.
_CPU_KV_FRACTION = 0.25
_CPU_KV_MAX_BYTES = 4 << 30


def kv_blocks_for(config: EngineConfig, model, device: torch.device, dtype: torch.dtype,
                  per_block: int | None = None) -> int:
    """KV blocks this process can hold: --num-kv-blocks, else the memory budget over
    the bytes of one block (of the heads this process holds; ``per_block`` overrides,
    e.g. to add a draft model's cache)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if per_block is None:
        per_block = kv_cache_bytes_per_block(model, config.block_size, dtype)
    budget = config.kv_cache_memory
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * 0.8)
        else:
            budget = min(int(available_memory_bytes() * _CPU_KV_FRACTION), _CPU_KV_MAX_BYTES)
    return budget // per_block
