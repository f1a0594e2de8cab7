"""Batched decode attention pads shorter contexts; padding must never read garbage."""

from __future__ import annotations

import torch

from pagoda.attention import AttentionMetadata, paged_attention


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


def test_prompt_without_cached_prefix_attends_to_the_values_the_cache_holds():
    """A prompt chunk with no cached prefix attends to its own k and v, rounded to the
    cache's dtype, instead of reading them back: the same result, bit for bit, as the
    read-back (forced here by marking the chunk as having a context)."""
    torch.manual_seed(1)
    block_size, heads, kv_heads, dim = 4, 4, 2, 8
    for dtype in (torch.float32, torch.float16):
        cache = torch.zeros(2, 8, block_size, kv_heads, dim, dtype=dtype)
        meta = AttentionMetadata.build([5, 7], [0, 0], [[0, 1], [2, 3]], block_size, torch.device("cpu"))
        q = torch.randn(12, heads, dim)
        k = torch.randn(12, kv_heads, dim) * 3
        v = torch.randn(12, kv_heads, dim)
        direct = paged_attention(q, k, v, cache, meta, dim ** -0.5)
        for chunk in meta.prefills:
            assert chunk.context_len == 0
            chunk.context_len = -1     # not 0: gathers from the cache (written by the call above)
        read_back = paged_attention(q, k, v, cache, meta, dim ** -0.5, kv_written=True)
        assert torch.equal(direct, read_back)
        if dtype == torch.float16:   # the rounding matters: unrounded k/v give other numbers
            exact = paged_attention(q, k, v, torch.zeros_like(cache, dtype=torch.float32), meta, dim ** -0.5)
            assert not torch.equal(direct, exact)
