"""Prefix-aware routing of requests over data-parallel replicas.

The router remembers, for the prompt blocks it dispatched, which replicas got
them (a bounded LRU of chained block hashes, the same SHA-256 keys the KV
cache uses). A new request goes to the live replica that most likely holds
the longest prefix of it in its cache; with no prefix anywhere, or when that
replica is overloaded compared with the others, to the least loaded one.

E.g. block_size=4, replica 0 served [a b c d e f g h i]: it holds blocks
[a b c d] and [e f g h]. A request [a b c d e f g h x y] matches 2 blocks on
replica 0 and none on replica 1 -> replica 0 (unless it has more than
``imbalance_limit`` requests more than the least loaded replica).

The map can go stale (a replica evicts blocks on its own); a stale entry only
costs a missed hit, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from pagoda.core.block_hash import hash_request_blocks

DEFAULT_CAPACITY = 1 << 16          # block hashes remembered (about 100 bytes each)
DEFAULT_IMBALANCE_LIMIT = 8         # in-flight requests more than the least loaded replica


@dataclass(frozen=True)
class Route:
    replica: int
    matched_blocks: int             # prompt blocks the router expects cached there


class PrefixRouter:
    def __init__(self, num_replicas: int, block_size: int, capacity: int = DEFAULT_CAPACITY,
                 imbalance_limit: int = DEFAULT_IMBALANCE_LIMIT) -> None:
        if num_replicas < 1 or block_size < 1 or capacity < 1:
            raise ValueError("num_replicas, block_size and capacity must be positive")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.capacity = capacity
        self.imbalance_limit = imbalance_limit
        self._holders: OrderedDict[bytes, set[int]] = OrderedDict()

    def _keys(self, token_ids: Sequence[int], cache_salt: str | None) -> list[bytes]:
        extra = (cache_salt,) if cache_salt else ()
        return [h.value for h in hash_request_blocks(token_ids, self.block_size, [], extra)]

    @property
    def num_remembered_blocks(self) -> int:
        """Block hashes the router remembers now (never more than ``capacity``)."""
        return len(self._holders)

    def held_blocks(self, token_ids: Sequence[int], replica: int, cache_salt: str | None = None) -> int:
        """Leading blocks of a prompt the router expects ``replica`` to hold (what ``choose``
        would report as matched there), without remembering anything."""
        return self.matched_blocks(self._keys(token_ids, cache_salt), replica)

    def matched_blocks(self, keys: list[bytes], replica: int) -> int:
        n = 0
        for key in keys:
            holders = self._holders.get(key)
            if holders is None or replica not in holders:
                break
            n += 1
        return n

    def choose(self, token_ids: Sequence[int], loads: Sequence[int], alive: Sequence[bool],
               cache_salt: str | None = None) -> Route:
        """Pick a live replica for a prompt and remember that it now holds its blocks.
        ``loads``: in-flight requests per replica."""
        live = [r for r in range(self.num_replicas) if alive[r]]
        if not live:
            raise RuntimeError("no live replica")
        keys = self._keys(token_ids, cache_salt)
        least = min(live, key=lambda r: (loads[r], r))
        matches = {r: self.matched_blocks(keys, r) for r in live}
        best = max(live, key=lambda r: (matches[r], -loads[r], -r))
        if matches[best] == 0 or loads[best] - loads[least] > self.imbalance_limit:
            best = least
        self._remember(keys, best)
        return Route(best, matches[best])

    def forget_replica(self, replica: int) -> None:
        """A replica died: its cache is gone."""
        for key in [k for k, holders in self._holders.items() if replica in holders]:
            holders = self._holders[key]
            holders.discard(replica)
            if not holders:
                del self._holders[key]

    def _remember(self, keys: list[bytes], replica: int) -> None:
        for key in keys:
            holders = self._holders.get(key)
            if holders is None:
                self._holders[key] = {replica}
            else:
                holders.add(replica)
                self._holders.move_to_end(key)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)
