"""The attention-backend interface: one object per model runner that builds a step's
attention metadata from the scheduler's per-request numbers and runs attention over the
paged KV cache with it.

A model layer calls ``paged_attention`` (``pagoda/attention/__init__.py``); the metadata
it is handed names the backend that built it, so a layer never knows which kernel ran.
The backends (``select_backend`` picks one per device and dtype, and the start-up log
names it):

- ``cpu`` (``cpu.py``): pagoda's C++ kernels, decode attention in place through the
  block tables; prompt chunks through torch.
- ``torch`` (``torch_ref.py``): the reference: gathered contexts and SDPA. Runs anywhere.
- ``triton`` (``triton.py``): Triton kernels reading the cache in place (store, paged
  decode with split-KV, one variable-length launch for every prompt chunk), with device
  inputs filled from persistent pinned buffers. The GPU's default; on the CPU only under
  ``TRITON_INTERPRET=1`` (tests).

A hybrid model's state layers ask the step's backend for their kernels (``state_kernels``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from pagoda.attention.kv_quant import QuantizedKVCache
from pagoda.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: ClassVar[str]
    # Whether the CPU's fused RoPE op may write K/V into a cache this backend reads (the
    # layer then passes kv_written=True); a backend that stores K/V itself says False.
    rope_writes_kv: ClassVar[bool] = True

    @abstractmethod
    def build(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device, group: int = 0) -> AttentionMetadata:  # fmt: skip
        """A step's metadata for one KV group (decodes first: the requests with one query
        token lead the lists). ``group`` tells a backend with persistent buffers which
        group's buffers to fill (each KV group's metadata lives through the whole step)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | QuantizedKVCache, meta: AttentionMetadata, scale: float,
                kv_written: bool = False, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Attention of q [T, H, D] over each request's cached context plus the new k, v
        [T, KVH, D] (stored into their slots first unless ``kv_written``). ``window``: a
        sliding-window layer's; ``softcap``: scores -> softcap * tanh(scores / softcap);
        ``sinks`` [H]: a logit per head in every softmax, with no value (GPT-OSS)."""

    def state_kernels(self, states: torch.Tensor):
        """The kernels a hybrid model's state layers run in this backend's steps over
        ``states`` (one layer's state slots): an object with ``gated_delta_rule`` and
        ``mamba2_scan`` (pagoda/csrc/recurrent.cpp's signatures), or None for the layers'
        own torch path. The CPU backend returns its C++ kernels; a GPU backend with kernels
        of its own (Triton) would return them here."""
        return None

    def describe(self) -> str:
        """The start-up log's words for this backend."""
        return self.name
