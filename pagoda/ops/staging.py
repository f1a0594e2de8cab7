"""Persistent host-to-device input buffers: what a step's inputs (token ids, positions,
attention metadata) are copied through without a blocking copy or an allocation per step.

Each named input is a pair: a host staging tensor (pinned on CUDA, so the copy does not
wait for the device) and a device tensor, copied with ``non_blocking=True``. Two sets are
used in turn, so a step's host writes never race the copy of the step before (still in
flight when steps overlap). A pair grows (to a power of two, never shrinking) when a step
needs more than any before; steps that fit keep the same device addresses.
"""

from __future__ import annotations

import torch


def _grown(n: int, have: int) -> int:
    return max(have, 1 << max(0, n - 1).bit_length())


class StagingBuffers:
    def __init__(self, device: torch.device | str, dtypes: dict[str, torch.dtype]) -> None:
        self.device = torch.device(device)
        self.dtypes = dtypes
        self._sets: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{}, {}]
        self._turn = 1

    def next(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The other set's (host, device) pair of every named input, each at least ``shapes``."""
        self._turn ^= 1
        pairs = self._sets[self._turn]
        pin = self.device.type == "cuda"
        for name, shape in shapes.items():
            have = pairs.get(name)
            if have is None or any(h < n for h, n in zip(have[0].shape, shape)):
                size = tuple(_grown(n, h) for n, h in zip(shape, have[0].shape if have else (0,) * len(shape)))
                dtype = self.dtypes[name]
                pairs[name] = (torch.zeros(size, dtype=dtype, pin_memory=pin),
                               torch.zeros(size, dtype=dtype, device=self.device))
        return pairs
