"""The state slots of a hybrid model's requests (#48): a request running on a model with
recurrent state layers (LFM2's short convolutions, pagoda/model/models/lfm2.py) holds one
slot of a fixed number, each slot one fixed-size state per state layer in the runner
(pagoda/worker/model_runner.py). The scheduler takes a slot when it admits a request and
gives it back when the request finishes, is aborted or is preempted (recomputed from its
first token, so its state is made afresh); ``check_integrity`` asserts that the running
requests and the free list account for every slot once."""

from __future__ import annotations

from collections import OrderedDict


class StatePool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))   # the lowest slot first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A free slot, or None when every slot is held."""
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise AssertionError(f"state slot {slot} freed twice or out of range")
        self._free.append(slot)

    def check_integrity(self, held: list[int]) -> None:
        """Every slot is either free or held by exactly one running request."""
        if sorted(held + self._free) != list(range(self.num_slots)):
            raise AssertionError(f"state slots out of sync: held {sorted(held)}, free {sorted(self._free)} "
                                 f"of {self.num_slots}")


class StateCheckpoints:
    """Saved states of a hybrid model's prefix cache: a fixed number of entries, each
    the state (every state layer's) after a cached prefix that ends at a KV block's end,
    keyed by that block's hash (the hash of the whole prefix, salt and adapter included).
    A prefix hit can only end where an entry is (``has``: the KV manager's hit filter),
    and starts from it. Entries are reused least recently used first; an entry read or
    written by the step being scheduled is never reused in that step (``begin_step``
    clears the marks). The runner holds the states themselves (``StateCache.blocks``:
    one row per entry)."""

    def __init__(self, capacity: int, interval: int = 1) -> None:
        if capacity < 1 or interval < 1:
            raise ValueError(f"state checkpoints need capacity >= 1 and interval >= 1, got {capacity}, {interval}")
        self.capacity = capacity
        # Within a long prompt chunk, every interval-th block end is kept (and the chunk's last).
        self.interval = interval
        self._entries: OrderedDict[object, int] = OrderedDict()   # key -> entry, least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self._busy: set[int] = set()   # entries this step reads or writes
        self.num_writes = 0
        self.num_restores = 0

    def __len__(self) -> int:
        return len(self._entries)

    def has(self, key) -> bool:
        return key in self._entries

    def begin_step(self) -> None:
        self._busy.clear()

    def restore(self, key) -> int:
        """The entry a prefix hit ending at ``key`` starts from (it must exist)."""
        entry = self._entries[key]
        self._entries.move_to_end(key)
        self._busy.add(entry)
        self.num_restores += 1
        return entry

    def write(self, key) -> int | None:
        """An entry to save the state at ``key`` into: its own, a free one, or the least
        recently used one not busy this step; None if every entry is busy (the state is
        then not saved: a later hit ends at an earlier block)."""
        entry = self._entries.get(key)
        if entry is None:
            if self._free:
                entry = self._free.pop()
            else:
                old = next((k for k, e in self._entries.items() if e not in self._busy), None)
                if old is None:
                    return None
                entry = self._entries.pop(old)
            self._entries[key] = entry
        self._entries.move_to_end(key)
        self._busy.add(entry)
        self.num_writes += 1
        return entry

    def demote(self, key) -> None:
        """Make ``key``'s entry the first to be reused (a request's previous chunk end, of
        no use once a later one is saved)."""
        if key in self._entries:
            self._entries.move_to_end(key, last=False)

    def reset(self) -> None:
        self._entries.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    def check_integrity(self) -> None:
        held = sorted(self._entries.values())
        if sorted(held + self._free) != list(range(self.capacity)) or len(set(held)) != len(held):
            raise AssertionError(f"state checkpoints out of sync: {len(held)} held, {len(self._free)} free "
                                 f"of {self.capacity}")
