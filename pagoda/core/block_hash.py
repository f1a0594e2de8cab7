"""Chained block hashes for prefix caching.

A full block's key is hash(parent key, the block's token ids, extra keys).
Chaining makes a block's key identify the whole prefix up to and including
it, so two requests share block i only if all tokens before it match too.
Extra keys isolate caches that must not be shared: a LoRA adapter id, a
tenant's cache salt (mixed into one block, the first unless an operator-declared
shared prefix comes before it; the chain carries it on).

Keys are SHA-256 based, so they are the same in every process (a router can
compute them) and cannot be forged to collide by a tenant.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import NamedTuple, Sequence

_ROOT = b"pagoda-prefix-root"


class BlockHash(NamedTuple):
    """The hash value plus the exact token ids, so that equality of two keys
    also compares the tokens (a guard against hash collisions)."""

    value: bytes
    token_ids: tuple[int, ...]

    def __repr__(self) -> str:
        return f"BlockHash({self.value[:6].hex()}, {len(self.token_ids)} tokens)"


def request_extra_keys(cache_salt: str | None = None, lora_int_id: int = 0) -> tuple[object, ...]:
    """The extra keys of a request's first block: its cache salt and its LoRA
    adapter, so that KV computed under one adapter (or tenant) is never
    reused for another. E.g. (None, 0) -> (); ("t1", 3) -> ("t1", ("lora", 3))."""
    keys: tuple[object, ...] = (cache_salt,) if cache_salt else ()
    if lora_int_id:
        keys += (("lora", lora_int_id),)
    return keys


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] = (),
) -> BlockHash:
    h = hashlib.sha256(parent.value if parent is not None else _ROOT)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return BlockHash(h.digest(), tuple(token_ids))


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    existing: list[BlockHash],
    extra_keys: tuple[object, ...] = (),
    extra_keys_at: int = 0,
    image_spans: Sequence[tuple[int, int, str]] = (),
) -> list[BlockHash]:
    """Extend ``existing`` with the hashes of the full blocks of ``token_ids``
    not hashed yet, and return it. ``extra_keys`` go into block ``extra_keys_at``
    (0: the first; later for a salt after a shared prefix), and the chain carries
    them on to every block after it. ``image_spans``: (start, end, image hash) of the
    prompt's images; a block holding any of an image's placeholder tokens has that
    image's hash among its extra keys (the same placeholders of another image never hit).

    E.g. block_size=4, 10 tokens, 1 existing hash -> appends the hash of
    tokens[4:8]; tokens[8:10] is not full and gets no hash.
    """
    num_full = len(token_ids) // block_size
    for i in range(len(existing), num_full):
        parent = existing[i - 1] if i > 0 else None
        extra = extra_keys if i == extra_keys_at else ()
        if image_spans:
            lo, hi = i * block_size, (i + 1) * block_size
            extra += tuple(("image", h) for start, end, h in image_spans if start < hi and end > lo)
        existing.append(
            hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        )
    return existing
