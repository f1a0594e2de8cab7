"""Compiles grammars off the step loop and builds each step's token bitmask.

Compiles run in a small thread pool (llguidance drops the GIL while it
builds a grammar), with an LRU cache of compiled grammars keyed by the
request's specification. A request whose grammar is not ready stays waiting;
the scheduler skips it and serves everyone else.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import (
    GrammarError,
    Matcher,
    StructuredOutputBackend,
    allocate_bitmask,
)

CACHE_SIZE = 256


class StructuredOutputManager:
    def __init__(self, backend_factory: Callable[[], StructuredOutputBackend], max_workers: int = 2) -> None:
        self._factory = backend_factory
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pagoda-grammar")
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._cache_lock = threading.Lock()

    @property
    def backend(self) -> StructuredOutputBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._factory()
            return self._backend

    def submit(self, params: StructuredOutputsParams) -> Future:
        """Start building a matcher for a request; the future yields a Matcher
        or raises GrammarError."""
        return self._pool.submit(self._build, params)

    def _build(self, params: StructuredOutputsParams) -> Matcher:
        key = params.key
        with self._cache_lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
        if grammar is None:
            grammar = self.backend.compile(params)
            with self._cache_lock:
                self._cache[key] = grammar
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return self.backend.matcher(grammar)

    def validate(self, params: StructuredOutputsParams) -> None:
        """Compile now (caching the result); raise GrammarError if invalid."""
        self._build(params)

    def bitmask_for(self, matchers: list[Matcher | None], vocab_size: int) -> torch.Tensor | None:
        """A [rows, vocab] bool mask (True = allowed) for the rows that have a
        matcher; rows without one are all True. None if no row is constrained."""
        if not any(m is not None for m in matchers):
            return None
        bits = allocate_bitmask(len(matchers), vocab_size)
        for row, matcher in enumerate(matchers):
            if matcher is not None:
                matcher.fill_bitmask(bits, row)
        return unpack_bitmask(bits, vocab_size)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bits: np.ndarray, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V/32)] int32 words -> [rows, V] bool; bit j of word i is token 32*i + j."""
    words = torch.from_numpy(bits)
    mask = (words[:, :, None] >> _SHIFTS) & 1
    return mask.reshape(bits.shape[0], -1)[:, :vocab_size].bool()


__all__ = ["GrammarError", "StructuredOutputManager", "unpack_bitmask"]
