"""A step's token ids and positions on the device without a blocking copy, through
persistent staging buffers (pagoda/ops/staging.py)."""

from __future__ import annotations

import numpy as np
import torch

from pagoda.ops.staging import StagingBuffers


class StepInputs:
    def __init__(self, device: torch.device) -> None:
        self.buffers = StagingBuffers(device, {"ids_positions": torch.long})

    def fill(self, input_ids: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, positions) [T] int64 on the device: views of the persistent buffers, valid
        until the step after next fills them again."""
        n = len(input_ids)
        host, dev = self.buffers.next({"ids_positions": (2, n)})["ids_positions"]
        staged = host.numpy()
        staged[0, :n] = np.asarray(input_ids, dtype=np.int64)
        staged[1, :n] = np.asarray(positions, dtype=np.int64)
        dev[:, :n].copy_(host[:, :n], non_blocking=True)
        return dev[0, :n], dev[1, :n]
