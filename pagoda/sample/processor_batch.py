"""The batch as logits processors see it (pagoda/sample/logits_processor.py).

pagoda's model runner keeps no persistent batch: each step it lists the requests that sample
in its own order (decodes first). Plug-ins written for vLLM expect one, whose row indices
stay put while a request stays and change only through ``BatchUpdate``s. ``ProcessorBatch``
keeps that view: one row per request, stable, dense (0 .. batch_size - 1), and each step

- removes the rows of requests that do not sample this step (finished, aborted, preempted,
  or not scheduled: they come back as added when they sample again), and of a request
  whose state the runner rebuilt (preempted and resumed: a new output list);
- puts new requests in the lowest free rows, then at the end;
- fills the holes left from the end (UNIDIRECTIONAL moves: the batch stays dense);
- gives the sampler the permutation between its rows and the processors' rows.

E.g. rows [a, b, c, d] and a step sampling (d, a, e, c) (b finished): removed [1], added
[(1, e)], no moves; rows [a, e, c, d]; the sampler's row order (d, a, e, c) is processors'
rows (3, 0, 1, 2), so ``order`` = [1, 2, 3, 0] (processors' row p is the sampler's row order[p]).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagoda.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality, load_processor_class
from pagoda.sample.sampler import device_tensor

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ProcessorRow:
    """One request that samples this step, as the model runner knows it."""

    req_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]   # the runner's own list, extended in place as the request generates


@dataclass
class ProcessorStep:
    """What the sampler needs for one step: the processors in their two groups and the
    permutation between its rows and theirs."""

    non_argmax_invariant: list[LogitsProcessor]
    argmax_invariant: list[LogitsProcessor]
    # order[p]: the sampler's row that is processors' row p. None: the same order.
    order: torch.Tensor | None = None

    def run(self, processors: list[LogitsProcessor], logits: torch.Tensor) -> torch.Tensor:
        """``processors`` applied in turn to a copy of ``logits`` [B, V], in their row order;
        returned in the sampler's."""
        rows = logits[self.order] if self.order is not None else logits.clone()
        for p in processors:
            out = p.apply(rows)
            if not isinstance(out, torch.Tensor) or out.shape != rows.shape:
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise RuntimeError(f"logits processor {type(p).__name__}.apply returned {shape}, not the "
                                   f"[batch, vocab] logits {tuple(rows.shape)} it was given")
            rows = out.float() if out.dtype != torch.float32 else out
        if self.order is None:
            return rows
        back = torch.empty_like(rows)
        back[self.order] = rows
        return back


class ProcessorBatch:
    """The loaded processors and their stable view of the batch (see the module docstring)."""

    def __init__(self, processors: list[LogitsProcessor], device: torch.device) -> None:
        self.processors = processors
        self.device = device
        # Grouped once, as vLLM does: is_argmax_invariant is the instance's answer at start.
        self.non_argmax_invariant = [p for p in processors if not p.is_argmax_invariant()]
        self.argmax_invariant = [p for p in processors if p.is_argmax_invariant()]
        self.rows: list[ProcessorRow | None] = []   # processors' row index -> its request

    @classmethod
    def build(cls, config: EngineConfig, device: torch.device) -> ProcessorBatch | None:
        """One instance of each class ``config.logits_processors`` names (None without any),
        built with (config, device, whether pinned host memory is available)."""
        names = config.logits_processors or ()
        if not names:
            return None
        processors = []
        for name in names:
            processor_cls = load_processor_class(name)
            try:
                processors.append(processor_cls(config, device, device.type == "cuda"))
            except Exception as e:
                raise ValueError(f"logits_processors: {name!r} failed to start: {type(e).__name__}: {e}") from e
        built = cls(processors, device)
        logger.info("logits processors: %s", ", ".join(
            f"{name} ({'argmax-invariant' if p.is_argmax_invariant() else 'may change the argmax'})"
            for name, p in zip(names, processors)))
        return built

    def step(self, rows: list[ProcessorRow]) -> ProcessorStep:
        """Bring every processor's state up to this step's rows (``update_state``), and the
        permutation the sampler applies its logits through."""
        update, order = self.update(rows)
        for p in self.processors:
            p.update_state(update)
        identity = order == list(range(len(order)))
        return ProcessorStep(self.non_argmax_invariant, self.argmax_invariant,
                             None if identity else device_tensor(order, torch.int64, self.device))

    def update(self, rows: list[ProcessorRow]) -> tuple[BatchUpdate | None, list[int]]:
        """The BatchUpdate that takes the kept rows to ``rows`` (None: no change), and
        ``order`` (processors' row p is ``rows[order[p]]``)."""
        wanted = {r.req_id: r for r in rows}
        slots = self.rows
        # A request stays in its row while it samples with the same state (output list).
        removed = [i for i, r in enumerate(slots)
                   if r is not None and (wanted.get(r.req_id) is None
                                         or wanted[r.req_id].output_token_ids is not r.output_token_ids)]
        for i in removed:
            slots[i] = None
        kept = {r.req_id for r in slots if r is not None}
        holes = sorted(removed)
        added = []
        for r in rows:
            if r.req_id in kept:
                continue
            if holes:
                i = holes.pop(0)
                slots[i] = r
            else:
                i = len(slots)
                slots.append(r)
            added.append((i, r.params, r.prompt_token_ids, r.output_token_ids))
        # Holes left (more left than came): the last rows move into them.
        moved = []
        while holes:
            while slots and slots[-1] is None:
                slots.pop()
            holes = [h for h in holes if h < len(slots)]
            if not holes:
                break
            hole = holes.pop(0)
            moved.append((len(slots) - 1, hole, MoveDirectionality.UNIDIRECTIONAL))
            slots[hole] = slots.pop()
        while slots and slots[-1] is None:
            slots.pop()
        position = {r.req_id: j for j, r in enumerate(rows)}
        order = [position[r.req_id] for r in slots]
        if len(order) != len(rows):
            raise RuntimeError(f"logits processors' batch has {len(order)} rows for {len(rows)} sampling requests "
                               "(a request id twice in one step?)")
        if not (removed or added or moved):
            return None, order
        return BatchUpdate(len(slots), removed, added, moved), order
