"""A step's token ids and positions on the device without a blocking copy: persistent
host staging buffers (pinned on CUDA) and device buffers, filled once per step with
non-blocking copies. Two sets used in turn, so a step's host writes never race the copy
of the step before (still in flight when steps overlap). Grown (never shrunk) when a step
is larger than any before."""

from __future__ import annotations

import numpy as np
import torch


class StepInputs:
    def __init__(self, device: torch.device, max_tokens: int = 256) -> None:
        self.device = device
        self._sets: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._turn = 0
        self._allocate(max_tokens)

    def _allocate(self, max_tokens: int) -> None:
        pin = self.device.type == "cuda"
        self.max_tokens = max_tokens
        self._sets = [(torch.zeros(2, max_tokens, dtype=torch.long, pin_memory=pin),
                       torch.zeros(2, max_tokens, dtype=torch.long, device=self.device)) for _ in range(2)]

    def fill(self, input_ids: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, positions) [T] int64 on the device: views of the persistent buffers, valid
        until the step after next fills them again."""
        n = len(input_ids)
        if n > self.max_tokens:
            self._allocate(1 << (n - 1).bit_length())
        self._turn ^= 1
        host, dev = self._sets[self._turn]
        staged = host.numpy()
        staged[0, :n] = np.asarray(input_ids, dtype=np.int64)
        staged[1, :n] = np.asarray(positions, dtype=np.int64)
        dev[:, :n].copy_(host[:, :n], non_blocking=True)
        return dev[0, :n], dev[1, :n]
