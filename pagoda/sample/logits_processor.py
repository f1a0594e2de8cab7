"""Logits processors as plug-ins, in vLLM V1's shape.

A plug-in is a class deriving from ``LogitsProcessor``. The engine builds one instance of
each class named by ``--logits-processors`` (``LLM(logits_processors=[...])``) where it
samples, and at every step that samples:

1. ``update_state(batch_update)``: what changed in the batch since the last call
   (``BatchUpdate``; None when nothing did). A row of the batch is one request that
   samples; its index is stable while the request stays in the batch.
2. ``apply(logits)``: the batch's logits, [batch_size, vocab] float32, row ``i`` the request
   the updates put at index ``i``; returns them (changed in place or a new tensor).

Per-request arguments come in ``SamplingParams.extra_args`` (``vllm_xargs`` on the OpenAI
routes), which ``validate_params`` may check when a request arrives (a ValueError is the
request's 400). A class written for vLLM works once its import reads
``from pagoda.sample.logits_processor import ...``; the first constructor argument is
pagoda's ``EngineConfig`` (pagoda/config/engine.py) where vLLM passes its ``VllmConfig``.

``AdapterLogitsProcessor`` wraps a per-request callable ``(output_ids, logits_row)`` or
``(prompt_ids, output_ids, logits_row)`` (vLLM V0's processors) in that interface.

Where they run among the built-in steps, what logprobs show and what does not combine with
them: pagoda/sample/sampler.py's docstring and docs/serving.md. This module imports no
torch (the engine's options load plug-in classes while they are checked).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from functools import partial
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

    from pagoda.config import EngineConfig
    from pagoda.sampling_params import SamplingParams


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()   # the request at i1 moves to i2 (i1 is empty afterwards)
    SWAP = auto()             # the requests at i1 and i2 change places (pagoda's batch makes none)


# A removed request's index.
RemovedRequest = int
# (index, params, prompt token ids, output token ids): the output list is the request's own
# and grows in place as it generates, so a processor that keeps it always sees the tokens so far.
AddedRequest = tuple[int, "SamplingParams", "list[int] | None", "list[int]"]
# (index 1, index 2, directionality).
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """The batch's changes since the last ``update_state``, applied in this order: removed,
    then added (an added request may take a removed one's index), then moved. pagoda lists
    every row a request left in ``removed``, those a new request then takes included (vLLM
    may leave those out: a processor that applies the three in order sees the same batch).

    E.g. rows [a, b, c, d]; b and d finish as e arrives: removed [1, 3], added [(1, e...)], no
    moves: [a, e, c]. Had only b finished: removed [1], moved [(3, 1, UNIDIRECTIONAL)]:
    [a, d, c] (pagoda fills holes from the end, so indices stay dense)."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """A batch-level logits processor (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Check a request's parameters (its ``extra_args``) when it arrives; raise
        ValueError for ones this processor cannot take."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: EngineConfig, device: torch.device, is_pin_memory: bool) -> None:
        """``vllm_config``: pagoda's EngineConfig (the name is vLLM's, so a vLLM class keeps
        its signature); ``device``: where the logits are; ``is_pin_memory``: whether pinned
        host memory is available for copies to it."""
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's [batch_size, vocab] float32 logits, processed (in place or not)."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes a row's argmax (it only truncates or reshapes
        the distribution, as min-p does): it then runs after temperature, and not at all in
        a step whose rows are all greedy."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called once before each ``apply``, with the batch's changes (None: no change)."""
        raise NotImplementedError


T = TypeVar("T")


def process_dict_updates(state: dict[int, T], batch_update: BatchUpdate | None,
                         new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None]) -> bool:
    """Keep ``state`` (batch index -> what a processor holds for the request there) in step
    with a BatchUpdate: removed indices dropped, ``new_state(params, prompt_ids, output_ids)``
    stored for each added request (nothing where it returns None), moves applied. Returns
    whether ``state`` changed."""
    if batch_update is None:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= state.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        value = new_state(params, prompt_ids, output_ids)
        if value is not None:
            state[index] = value
            changed = True
        elif state.pop(index, None) is not None:   # (a request whose index it took)
            changed = True
    for a, b, direction in batch_update.moved:
        at_a, at_b = state.pop(a, None), state.pop(b, None)
        if at_a is not None:
            state[b] = at_a
            changed = True
        if direction is MoveDirectionality.SWAP and at_b is not None:
            state[a] = at_b
            changed = True
    return changed


# A per-request processor: (output_ids, logits_row) or (prompt_ids, output_ids, logits_row)
# -> logits_row, the row a [vocab] view of the batch's logits.
RequestLogitsProcessor = Callable[..., "torch.Tensor"]


class AdapterLogitsProcessor(LogitsProcessor):
    """A per-request callable as a batch-level processor. A subclass implements
    ``is_argmax_invariant`` and ``new_req_logits_processor(params)`` (the request's callable,
    or None where it does not apply); one that overrides ``__init__`` calls this one."""

    def __init__(self, vllm_config: EngineConfig, device: torch.device, is_pin_memory: bool) -> None:
        # Batch index -> the request's callable with its token lists bound (references, so
        # it sees the output as it grows).
        self.req_info: dict[int, partial] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        raise NotImplementedError

    def _new_state(self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> partial | None:
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        arity = len(inspect.signature(fn).parameters)
        if arity == 3:
            return partial(fn, prompt_ids, output_ids)
        if arity == 2:
            return partial(fn, output_ids)
        raise TypeError(f"{type(self).__name__}.new_req_logits_processor returned a callable of {arity} "
                        "parameters: a per-request processor takes (output_ids, logits_row) or "
                        "(prompt_ids, output_ids, logits_row)")

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, fn in self.req_info.items():
            row = logits[index]
            new = fn(row)
            if new is not row:
                logits[index] = new
        return logits


# Loading by name lives with the options (pagoda/config/plugins.py), which check them.
from pagoda.config.plugins import (  # noqa: E402
    load_processor_class,
    processor_name,
    resolve_processor_names,
)

__all__ = [
    "AdapterLogitsProcessor", "BatchUpdate", "LogitsProcessor", "MoveDirectionality", "load_processor_class",
    "process_dict_updates", "processor_name", "resolve_processor_names",
]
