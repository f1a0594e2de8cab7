"""Paged attention over the KV cache, in plain torch.

The model runner puts the batch in order: all decode requests (one new token
each) first, then requests computing a chunk of prompt. Per layer, the new
K/V of every token are written into their cache slots first, then
attention reads each request's whole context from the cache. Writing first is
what lets a request reuse prefix blocks that another request in the same
step is computing.

- Decodes, on CPU with pagoda's C++ kernels (``pagoda/csrc``): one kernel call
  reads every decode's K/V in place through its block table (no copy, no
  padding to the longest context). Elsewhere: one batched SDPA over gathered,
  padded contexts; grouped-query attention is folded into the query-length
  axis (the G query heads sharing a KV head act as G queries of length 1), so
  no K/V repeat is needed.
- Prompt chunks: one SDPA per request over its gathered context, with a
  causal mask offset by the tokens already computed.
- Sliding-window layers (``window``): a query at position i sees keys j with
  i - window < j <= i. Prompt chunks read only the keys some query of theirs sees;
  the decode kernel starts each sequence at its window.

The gather index (slot of every context position) and masks are built once
per step by ``AttentionMetadata`` and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagoda.ops import cpu_kernels
from pagoda.model.kv_quant import QuantizedKVCache


@dataclass
class PrefillChunk:
    token_start: int            # offset of this request's tokens in the flat batch
    query_len: int
    context_len: int            # tokens before this chunk (prefix hit + earlier chunks)
    gather_slots: torch.Tensor  # [context_len + query_len] slot of every position
    mask: torch.Tensor | None   # [query_len, seq_len] bool, None = plain causal
    # window -> (first key position read, mask over keys from there), built on first use
    windows: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)

    def window_view(self, window: int) -> tuple[int, torch.Tensor] | None:
        """For a windowed layer: (first key position any query sees, [query_len, keys]
        mask), or None when the window covers the whole context."""
        seq = self.context_len + self.query_len
        if seq <= window:
            return None
        if window not in self.windows:
            start = max(0, self.context_len - window + 1)
            keys = torch.arange(start, seq)[None, :]
            queries = torch.arange(self.context_len, seq)[:, None]
            mask = (keys <= queries) & (keys > queries - window)
            self.windows[window] = (start, mask.to(self.gather_slots.device))
        return self.windows[window]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor             # [T] slot each new token's K/V goes to
    num_decodes: int                       # the first num_decodes tokens are decodes
    decode_gather_slots: torch.Tensor | None  # [D, L] slots of each decode's context, padded
    decode_mask: torch.Tensor | None       # [D, 1, 1, L] True where a position is valid
    prefills: list[PrefillChunk]
    # For the in-place decode kernel (None when the gather path is used):
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] int32
    decode_seq_lens: torch.Tensor | None = None      # [D] int32, context + 1
    decode_windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def decode_view(self, window: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The gather path's decode (slots, mask), narrowed to a window: positions before
        it re-read the last position (a written slot, as padding does: their blocks may
        have been released and reused) and are masked out."""
        if window is None or self.decode_mask is None:
            return self.decode_gather_slots, self.decode_mask
        if window not in self.decode_windows:
            slots = self.decode_gather_slots
            seq = self.decode_mask[:, 0, 0, :].sum(-1, keepdim=True)
            p = torch.arange(slots.shape[1], device=slots.device)[None, :]
            inside = p >= seq - window
            last = slots.gather(1, seq - 1)
            self.decode_windows[window] = (torch.where(inside, slots, last),
                                           self.decode_mask & inside[:, None, None, :])
        return self.decode_windows[window]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
        decode_kernel: bool = False,
    ) -> AttentionMetadata:
        """Per request (decodes first): tokens this step, tokens already in
        the cache, and its block table. Vectorised: Python work is per
        request, never per token.

        E.g. block_size=4, block table [7, 2], context 5, query 1: the new token
        sits at position 5 -> slot 2*4 + 1 = 9; its context positions 0..5 map
        to slots [28, 29, 30, 31, 8, 9].
        """
        n = len(query_lens)
        num_decodes = 0
        while num_decodes < n and query_lens[num_decodes] == 1:
            num_decodes += 1
        max_blocks = max(len(t) for t in block_tables)
        if num_decodes == n and decode_kernel:
            # A decode-only step for the kernel (the common one): a few integers per request,
            # without the tensor arithmetic below (the same values).
            slots = [t[c // block_size] * block_size + c % block_size for t, c in zip(block_tables, context_lens)]
            return cls(
                slot_mapping=torch.tensor(slots, dtype=torch.long).to(device),
                num_decodes=n, decode_gather_slots=None, decode_mask=None, prefills=[],
                decode_block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables],
                                                 dtype=torch.int32),
                decode_seq_lens=torch.tensor([c + 1 for c in context_lens], dtype=torch.int32),
            )
        table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.long)
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        ctx = torch.tensor(context_lens, dtype=torch.long)
        # Each new token's request and position: [2, 1] with ctx [5, 0] -> positions [5, 6, 0].
        owner = torch.repeat_interleave(torch.arange(n), q_lens)
        first = torch.cumsum(q_lens, 0) - q_lens
        pos = torch.arange(int(q_lens.sum())) - first[owner] + ctx[owner]
        slot_mapping = table[owner, pos // block_size] * block_size + pos % block_size

        decode_gather = decode_mask = decode_tables = decode_lens = None
        if num_decodes and decode_kernel:
            decode_tables = table[:num_decodes].to(torch.int32)
            decode_lens = (ctx[:num_decodes] + 1).to(torch.int32)
        elif num_decodes:
            seq = ctx[:num_decodes] + 1
            p = torch.arange(int(seq.max()))
            # Padded positions re-read the request's own last position and are masked
            # out. They must read a written slot: the tail of a block (or the cache's
            # uninitialised memory) may hold NaN, and a masked NaN still poisons SDPA
            # (its weight is 0, but 0 * NaN = NaN).
            padded = torch.minimum(p[None, :], seq[:, None] - 1)
            rows = torch.arange(num_decodes)[:, None]
            decode_gather = table[rows, padded // block_size] * block_size + padded % block_size
            decode_mask = (p[None, :] < seq[:, None])[:, None, None, :].to(device)
            decode_gather = decode_gather.to(device)
        prefills: list[PrefillChunk] = []
        for i in range(num_decodes, n):
            q_len, ctx_len = query_lens[i], context_lens[i]
            seq_len = ctx_len + q_len
            p = torch.arange(seq_len)
            slots = table[i, p // block_size] * block_size + p % block_size
            mask = None
            if ctx_len > 0:
                # Query j sits at position ctx_len + j and sees keys 0..ctx_len + j.
                mask = (p[None, :] <= p[ctx_len:, None]).to(device)
            prefills.append(PrefillChunk(int(first[i]), q_len, ctx_len, slots.to(device), mask))
        return cls(
            slot_mapping=slot_mapping.to(device),
            num_decodes=num_decodes,
            decode_gather_slots=decode_gather,
            decode_mask=decode_mask,
            prefills=prefills,
            decode_block_tables=decode_tables,
            decode_seq_lens=decode_lens,
        )


def kernel_cache(kv_cache: torch.Tensor | QuantizedKVCache) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """What pagoda's CPU kernels read and write in place: (cache tensor, None) for a float32
    or float16 cache, (int8 values, scales) for an int8 QuantizedKVCache; None for the others
    (fp8, bfloat16), which go through torch."""
    if isinstance(kv_cache, QuantizedKVCache):
        return (kv_cache.data, kv_cache.scales) if kv_cache.dtype == torch.int8 else None
    return (kv_cache, None) if kv_cache.dtype in (torch.float32, torch.float16) else None


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

    def decode_kernel(queries: torch.Tensor) -> torch.Tensor:
        cache, scales = kernel_cache(kv_cache)
        return cpu_kernels.kernels().paged_decode_attention(
            queries, cache, meta.decode_block_tables, meta.decode_seq_lens, scale, scales, window or 0, softcap or 0.0,
            None if sinks is None else sinks.float()
        )

    if nd == num_tokens and meta.decode_block_tables is not None:
        return decode_kernel(q)   # a decode-only step (the common one): the kernel's output is the result
    out = torch.empty_like(q)
    if nd and meta.decode_block_tables is not None:
        out[:nd] = decode_kernel(q[:nd])
    elif nd:
        # [D, L, KVH, hd] -> [D, KVH, L, hd]; queries [D, KVH, G, hd].
        slots, mask = meta.decode_view(window)
        ks = read(0, slots).transpose(1, 2)
        vs = read(1, slots).transpose(1, 2)
        qs = q[:nd].view(nd, num_kv_heads, group, head_dim)
        o = _attend(qs, ks, vs, mask, scale, softcap, None if sinks is None else sinks.view(num_kv_heads, group, 1))
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
            o = _attend(qs, ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1), mask, scale,
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


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
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
