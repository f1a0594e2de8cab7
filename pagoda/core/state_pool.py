"""The state slots of a hybrid model's requests (#48): a request running on a model with
recurrent state layers (LFM2's short convolutions, pagoda/model/models/lfm2.py) holds one
slot of a fixed number, each slot one fixed-size state per state layer in the runner
(pagoda/worker/model_runner.py). The scheduler takes a slot when it admits a request and
gives it back when the request finishes, is aborted or is preempted (recomputed from its
first token, so its state is made afresh); ``check_integrity`` asserts that the running
requests and the free list account for every slot once."""

from __future__ import annotations


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
