"""Stored responses (``store: true``, OpenAI's default), kept in this server's memory.

What ``previous_response_id`` continues from, and what ``GET`` / ``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` read. Each entry keeps the
Response object, the request's own input items, and the conversation before them
(flattened: the previous response's history, inputs and outputs), so a continuation never
depends on an older entry that may have been evicted.

Bounded by entry count and by bytes (the JSON size of what an entry keeps). Eviction is
least recently used: storing or reading an entry (retrieve, input_items, or continuing from
it) makes it the newest; when a bound is passed, the oldest entries go first. An entry
larger than the whole byte bound is not kept at all. Entries belong to a tenant (the API
key's, see ``tenants.py``): another tenant's id is a 404, as if it did not exist. Nothing
survives a restart.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 << 20


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the Response object as sent
    input_items: list[dict[str, Any]]  # this request's input items, with ids
    history: list[dict[str, Any]]  # the items before them, oldest first
    tenant: str | None = None
    size: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.size = len(json.dumps([self.response, self.input_items, self.history]))

    @property
    def id(self) -> str:
        return str(self.response["id"])

    def conversation(self) -> list[dict[str, Any]]:
        """What a response continuing from this one comes after."""
        return self.history + self.input_items + list(self.response["output"])


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(f"the response store's bounds must be >= 0, got {max_entries} entries, {max_bytes} bytes")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> bool:
        """Keep ``entry`` (evicting the least recently used as needed); False if it is too large."""
        if entry.size > self.max_bytes or not self.enabled:
            logger.warning("response %s (%d bytes) not stored: the store holds at most %d bytes",
                           entry.id, entry.size, self.max_bytes)  # fmt: skip
            return False
        self._pop(entry.id)
        self._entries[entry.id] = entry
        self.num_bytes += entry.size
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            self._pop(next(iter(self._entries)))
        return True

    def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None or entry.tenant != tenant:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, tenant: str | None) -> bool:
        if self.get(response_id, tenant) is None:
            return False
        self._pop(response_id)
        return True

    def _pop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.size
