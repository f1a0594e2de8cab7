"""Batched decode attention pads shorter contexts; padding must never read garbage."""

from __future__ import annotations

import torch

from pagoda.model.attention import AttentionMetadata, paged_attention


def test_padded_decode_positions_ignore_nan_in_unwritten_slots():
    torch.manual_seed(0)
    block_size, heads, kv_heads, dim = 4, 2, 1, 8
    cache = torch.full((2, 6, block_size, kv_heads, dim), float("nan"))
    # Request 0: 7 tokens of context in blocks [0, 1]; request 1: 1 token in block [2],
    # whose other slots (and block 0 reused as padding before the fix) hold NaN.
    ctx = [6, 0]
    tables = [[0, 1], [2]]
    for rid, (c, table) in enumerate(zip(ctx, tables)):
        for pos in range(c):
            slot = table[pos // block_size] * block_size + pos % block_size
            cache[:, slot // block_size, slot % block_size] = torch.randn(2, kv_heads, dim)
    meta = AttentionMetadata.build([1, 1], ctx, tables, block_size, torch.device("cpu"))
    q = torch.randn(2, heads, dim)
    k = torch.randn(2, kv_heads, dim)
    v = torch.randn(2, kv_heads, dim)
    out = paged_attention(q, k, v, cache, meta, dim ** -0.5)
    assert torch.isfinite(out).all()
    # Request 1 sees only its own new token: attention returns its value.
    torch.testing.assert_close(out[1], v[1].expand(heads, dim))
