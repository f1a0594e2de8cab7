"""The encoder cache: each image's embeddings, computed once and kept by its content hash.

The model runner asks for an image's embeddings whenever a step computes any of its
placeholder positions; an image whose prompt is chunked across several steps, a second
request with the same image, or a conversation that resends it (past what the prefix
cache holds) reads them from here. Entries are dropped least recently used first once the
cache holds more than ``budget`` embeddings (rows); an image evicted before its request's
prompt is done is encoded again, never wrong. vLLM's ``EncoderCacheManager`` plans this
budget in the scheduler; here the runner, which owns the embeddings, keeps it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

import torch

from pagoda.multimodal.inputs import ImageInput


class EncoderCache:
    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._rows = 0
        self.hits = 0
        self.misses = 0
        self.encoder_seconds = 0.0

    def get(self, image: ImageInput, encode: Callable[[torch.Tensor], torch.Tensor],
            device: torch.device) -> torch.Tensor:  # fmt: skip
        """The image's embeddings [n, hidden]: cached, or ``encode(pixels)`` now."""
        hit = self._entries.get(image.hash)
        if hit is not None:
            self._entries.move_to_end(image.hash)
            self.hits += 1
            return hit
        self.misses += 1
        start = time.perf_counter()
        pixels = torch.from_numpy(image.float_pixels())
        out = encode(pixels.to(device))
        self.encoder_seconds += time.perf_counter() - start
        self._entries[image.hash] = out
        self._rows += out.shape[0]
        # Keep the newest entry even past the budget: the step needs it now.
        while self._rows > self.budget and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._rows -= old.shape[0]
        return out
