"""A layer's KV cache in 8 bits (``--kv-cache-dtype int8|fp8``): a quarter of float32's memory
(half of bfloat16's), so the same budget holds about 4x (2x) the blocks.

Each written K or V vector (one token, one KV head) gets its own float32 scale: absmax / 127
for int8 (round to nearest), absmax / 448 for fp8 e4m3. A scale per slot rather than per
block means a block never needs requantizing when a later token in it is larger than the
ones before; it costs 4 bytes per head_dim bytes (6 % with head_dim 64). Reads dequantize the
gathered context to the query's dtype; attention itself runs as before.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8")


def storage_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The 8-bit storage type, or None for ``auto`` (the model's dtype)."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype == "fp8":
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


class QuantizedKVCache:
    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, pin_memory: bool = False) -> None:  # fmt: skip
        self.dtype = dtype
        self.qmax = 127.0 if dtype == torch.int8 else float(torch.finfo(dtype).max)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # fp8 is kept as its raw bytes (uint8): CPU kernels such as index_copy_ lack fp8.
        self._raw = torch.int8 if dtype == torch.int8 else torch.uint8
        self.data = torch.empty(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=self._raw, device=device,
                                pin_memory=pin_memory)  # fmt: skip
        self.scales = torch.empty(2, num_blocks, block_size, num_kv_heads, dtype=torch.float32, device=device,
                                  pin_memory=pin_memory)  # fmt: skip

    @staticmethod
    def bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int) -> int:
        """Per layer: K and V, one byte per element plus a float32 scale per head per token."""
        return 2 * block_size * num_kv_heads * (head_dim + 4)

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize the new tokens' K and V ([T, KVH, D]) into their slots."""
        for i, x in enumerate((k, v)):
            x = x.float()
            scale = x.abs().amax(-1).clamp_min(1e-12) / self.qmax      # [T, KVH]
            q = x / scale[..., None]
            if self.dtype == torch.int8:
                q = q.round().clamp(-self.qmax, self.qmax).to(torch.int8)
            else:
                q = q.to(self.dtype).view(self._raw)
            self.data[i].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, q)
            self.scales[i].view(-1, self.num_kv_heads).index_copy_(0, slot_mapping, scale)

    def read(self, i: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """K (i=0) or V (i=1) at ``slots`` (any shape S), dequantized: [*S, KVH, D]."""
        q = self.data[i].view(-1, self.num_kv_heads, self.head_dim)[slots]
        if self.dtype != torch.int8:
            q = q.view(self.dtype)
        scale = self.scales[i].view(-1, self.num_kv_heads)[slots]
        return (q.float() * scale[..., None]).to(dtype)

    def copy_blocks_to(self, dst: QuantizedKVCache, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
        """Blocks src_idx of this cache -> blocks dst_idx of ``dst`` (swap preemption)."""
        dev = dst.data.device
        dst.data.index_copy_(1, dst_idx, self.data.index_select(1, src_idx).to(dev))
        dst.scales.index_copy_(1, dst_idx, self.scales.index_select(1, src_idx).to(dev))
