"""What a hybrid model's state layers (pagoda/model/models/lfm2.py) get for a step, beside
the attention layers' KV cache and metadata.

``StateCache`` is one state layer's memory: a state per slot of the scheduler's state pool
(pagoda/core/state_pool.py), and, with prefix caching, the states saved at KV block ends
(one row per entry of the scheduler's ``StateCheckpoints``: written when a chunk's tokens
complete the block, read when a later request's prefix hit ends there). ``StepStates`` is
the step's per-sequence plan (in the attention metadata's order: decodes, then prompt
chunks): each sequence's slot, the saved state it starts from (a prefix hit, on its first
step), and the states its tokens save.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StateCache:
    slots: torch.Tensor                # [slots, *state shape]
    blocks: torch.Tensor | None = None  # [saved states, *state shape]: states at block ends (prefix caching)
    # A layer that is both (Falcon-H1: attention and Mamba-2 side by side): its KV cache.
    kv: torch.Tensor | None = None
    host: torch.Tensor | None = None   # [host slots, *state shape]: swapped-out requests' states


@dataclass
class StepStates:
    slots: list[int]                         # per sequence, its state slot
    restore: list[int]                       # per sequence, the saved state it starts from, or -1
    checkpoints: list[list[tuple[int, int]]]  # per sequence, (block end - chunk start, saved state's row)
    # What the state layers derive from the plan once a step (the kernels' index tensors)
    memo: dict = field(default_factory=dict)
