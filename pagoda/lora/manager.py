"""The engine core's adapters: the loaded ones (CPU) and the resident slots.

``LoRAManager`` reads adapters once (``add``), keeps them until ``remove``,
and before each forward makes the step's adapters resident in the model's
``max_loras`` slots (``prepare``). A slot is reused least recently used first,
and never while a running request's adapter sits in it: the scheduler admits
requests of at most ``max_loras`` different adapters at once, so the
adapters of running requests always fit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch
from torch import nn

from pagoda.lora.adapter import LoRAAdapter, load_adapter
from pagoda.lora.layers import LoRABatch, apply_lora, write_adapter
from pagoda.lora.request import LoRARequest
from pagoda.model.arch import ModelArchConfig


class LoRAManager:
    def __init__(self, model: nn.Module, arch: ModelArchConfig, max_loras: int, max_rank: int) -> None:
        if not getattr(type(model), "lora", True):
            raise ValueError(f"LoRA adapters are not supported for {arch.architecture}")
        self.arch = arch
        self.max_loras = max_loras
        self.max_rank = max_rank
        param = next(model.parameters())
        self.dtype = param.dtype
        self.batch = LoRABatch(param.device)
        self.wrapped = apply_lora(model, max_loras, max_rank, self.batch)
        self.adapters: dict[int, LoRAAdapter] = {}
        # Resident adapters: lora_int_id -> slot, least recently used first.
        self.slots: OrderedDict[int, int] = OrderedDict()
        self.num_loads = 0   # adapters written into a slot (for tests and metrics)

    # ---- the loaded set ------------------------------------------------------------

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Load the adapter unless this id is loaded already (then it must be the same adapter)."""
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if (known.request.lora_name, known.request.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} is already used by adapter "
                    f"{known.request.lora_name!r} ({known.request.lora_path}); give each adapter its own id"
                )
            return known
        adapter = load_adapter(request, self.arch, self.max_rank, self.dtype)
        self.adapters[request.lora_int_id] = adapter
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (the caller checked no request uses it). False if unknown."""
        if self.adapters.pop(lora_int_id, None) is None:
            return False
        self.slots.pop(lora_int_id, None)
        return True

    def list(self) -> list[LoRARequest]:
        return [a.request for a in self.adapters.values()]

    # ---- resident slots ------------------------------------------------------------

    def prepare(self, token_lora_ids: list[int], pinned: Iterable[int] = ()) -> None:
        """Make the step's adapters resident and map each token to its slot.

        ``token_lora_ids``: the adapter id per token (0 = base model).
        ``pinned``: adapters of running requests; never evicted for another.
        """
        needed = sorted({i for i in token_lora_ids if i})
        if not needed:
            self.batch.clear()
            return
        keep = set(needed) | set(pinned)
        for lora_id in needed:
            if lora_id in self.slots:
                self.slots.move_to_end(lora_id)
                continue
            self._load(lora_id, keep)
        slot_of = {i: self.slots[i] for i in needed}
        self.batch.set_token_slots([slot_of[i] if i else -1 for i in token_lora_ids])

    def _load(self, lora_id: int, keep: set[int]) -> None:
        adapter = self.adapters.get(lora_id)
        if adapter is None:
            raise RuntimeError(f"LoRA adapter id {lora_id} is scheduled but not loaded")
        used = set(self.slots.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next((i for i in self.slots if i not in keep), None)
            if victim is None:
                raise RuntimeError(
                    f"all {self.max_loras} LoRA slots hold adapters of running requests; "
                    f"the scheduler must not admit a request of another adapter"
                )
            slot = self.slots.pop(victim)
        with torch.no_grad():
            write_adapter(self.wrapped, slot, self.adapters[lora_id])
        self.slots[lora_id] = slot
        self.num_loads += 1

    def resident_ids(self) -> list[int]:
        return list(self.slots)
