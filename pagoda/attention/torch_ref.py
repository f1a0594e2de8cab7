"""The torch backend: the reference path, on any device.

- Decodes: one batched SDPA over gathered, padded contexts; grouped-query attention is
  folded into the query-length axis (the G query heads sharing a KV head act as G
  queries of length 1), so no K/V repeat is needed.
- Prompt chunks: one SDPA per request over its gathered context, with a causal mask
  offset by the tokens already computed.
- Sliding-window layers (``window``): a query at position i sees keys j with
  i - window < j <= i. Prompt chunks read only the keys some query of theirs sees.
- Soft-capping and sinks, which SDPA lacks: scores, mask and softmax written out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.kv_quant import QuantizedKVCache
from pagoda.attention.metadata import AttentionMetadata


class TorchBackend(AttentionBackend):
    name = "torch"

    def build(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device, group: int = 0) -> AttentionMetadata:  # fmt: skip
        meta = AttentionMetadata.build(query_lens, context_lens, block_tables, block_size, device)
        meta.backend = self
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | QuantizedKVCache, meta: AttentionMetadata, scale: float,
                kv_written: bool = False, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        if isinstance(kv_cache, QuantizedKVCache):
            if not kv_written:
                kv_cache.write(meta.slot_mapping, k, v)

            def read(i: int, slots: torch.Tensor) -> torch.Tensor:
                return kv_cache.read(i, slots, q.dtype)
        else:
            k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)
            v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
            if not kv_written:
                k_flat.index_copy_(0, meta.slot_mapping, k.to(kv_cache.dtype))
                v_flat.index_copy_(0, meta.slot_mapping, v.to(kv_cache.dtype))

            def read(i: int, slots: torch.Tensor) -> torch.Tensor:
                return (k_flat if i == 0 else v_flat)[slots].to(q.dtype)

        nd = meta.num_decodes
        if nd == num_tokens and self.decodes_in_place(meta):
            # A decode-only step for an in-place kernel: its output is the result.
            return self.decode_in_place(q, kv_cache, meta, scale, window, softcap, sinks)
        out = torch.empty_like(q)
        if nd and self.decodes_in_place(meta):
            out[:nd] = self.decode_in_place(q[:nd], kv_cache, meta, scale, window, softcap, sinks)
        elif nd:
            # [D, L, KVH, hd] -> [D, KVH, L, hd]; queries [D, KVH, G, hd].
            slots, mask = meta.decode_view(window)
            ks = read(0, slots).transpose(1, 2)
            vs = read(1, slots).transpose(1, 2)
            qs = q[:nd].view(nd, num_kv_heads, group, head_dim)
            o = attend(qs, ks, vs, mask, scale, softcap, None if sinks is None else sinks.view(num_kv_heads, group, 1))
            out[:nd] = o.reshape(nd, num_heads, head_dim)
        for chunk in meta.prefills:
            start, end = chunk.token_start, chunk.token_start + chunk.query_len
            view = chunk.window_view(window) if window is not None else None
            first, mask = view if view is not None else (0, chunk.mask)
            if chunk.context_len == 0 and not isinstance(kv_cache, QuantizedKVCache):
                # No cached prefix: the chunk's keys are its own k and v, rounded as the cache
                # holds them (the values a read-back would give, without the gather).
                ks = k[start + first:end].to(kv_cache.dtype).to(q.dtype).transpose(0, 1)[None]
                vs = v[start + first:end].to(kv_cache.dtype).to(q.dtype).transpose(0, 1)[None]
            else:
                ks = read(0, chunk.gather_slots[first:]).transpose(0, 1)[None]   # [1, KVH, S, hd]
                vs = read(1, chunk.gather_slots[first:]).transpose(0, 1)[None]
            qs = q[start:end].transpose(0, 1)[None]                              # [1, H, Q, hd]
            if softcap or sinks is not None:
                if mask is None:   # plain causal over the chunk's own keys
                    mask = torch.ones(qs.shape[2], ks.shape[2], dtype=torch.bool, device=qs.device).tril()
                o = attend(qs, ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1), mask, scale,
                           softcap, None if sinks is None else sinks.view(num_heads, 1, 1))
            else:
                o = F.scaled_dot_product_attention(
                    qs, ks, vs,
                    attn_mask=mask,
                    is_causal=mask is None,
                    scale=scale,
                    enable_gqa=group > 1,
                )
            out[start:end] = o[0].transpose(0, 1)
        return out

    def decodes_in_place(self, meta: AttentionMetadata) -> bool:
        """Whether this step's decodes run an in-place kernel (``decode_in_place``)."""
        return False

    def decode_in_place(self, q: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache, meta: AttentionMetadata,
                        scale: float, window: int | None, softcap: float | None,
                        sinks: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        raise NotImplementedError


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with its heads already matched (q [..., Q, hd] against k, v [..., S, hd]);
    with ``softcap``, the scores are capped as transformers caps them, and with ``sinks``
    (shaped to broadcast against the scores' [..., Q, 1]) each softmax takes one more logit
    with no value (SDPA can do neither)."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
    scores = torch.cat((scores.float(), sinks.float().expand(*scores.shape[:-1], 1)), dim=-1)
    return torch.softmax(scores, dim=-1)[..., :-1].to(q.dtype) @ v
