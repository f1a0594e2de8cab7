"""Engine-core side of the metrics: what one step did, and a picture of the KV pool.

Everything here runs inside the engine's busy loop, so it is kept to one pass over
the batch with no allocation beyond the record itself; the front end (which has a
process of its own) does all the aggregation.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pagoda.core.outputs import StepRecord
from pagoda.metrics.cost import step_cost

if TYPE_CHECKING:
    from pagoda.core.block_pool import BlockPool
    from pagoda.core.request import Request
    from pagoda.core.sched_output import SchedulerOutput
    from pagoda.metrics.cost import ArchLike

# At most this many blocks are sampled for the pool picture: exact for small pools,
# evenly strided for big ones, so the cost stays bounded (~0.3 ms) whatever the size.
BLOCK_MAP_MAX_CELLS = 4096
# The pool picture is sent at most this often; it is for eyes, not for counting.
BLOCK_MAP_INTERVAL_S = 1.0


def kv_block_map(pool: BlockPool, max_cells: int = BLOCK_MAP_MAX_CELLS) -> str:
    """One char per sampled block: "u" in use, "c" free with a cached prefix, "." free."""
    blocks = pool.blocks
    stride = max(1, -(-len(blocks) // max_cells))
    return "".join([
        "u" if b.ref_cnt else ("c" if b.block_hash is not None else ".")
        for b in blocks[::stride]
    ])


class StepStatsCollector:
    """Builds a StepRecord for each step and, now and then, the KV pool picture.

    ``arch``: when given, each record carries the step's FLOPs and bytes from
    pagoda/metrics/cost.py, the same model ``pagoda bench roofline`` uses, so the two
    compare directly. ``*_bytes``: bytes per element of weights, activations, KV.
    """

    def __init__(
        self, arch: ArchLike | None = None, weight_bytes: float = 4.0, act_bytes: float = 4.0, kv_bytes: float = 4.0
    ) -> None:
        self.arch = arch
        self._cost_kwargs = {"weight_bytes": weight_bytes, "act_bytes": act_bytes, "kv_bytes": kv_bytes}
        self._next_step_id = 0
        self._last_block_map = float("-inf")

    def record_step(
        self, sched_out: SchedulerOutput, requests: dict[str, Request], start: float
    ) -> StepRecord | None:
        """Call after schedule() and before update_from_output() (which forgets finished
        requests); schedule() has already advanced num_computed_tokens by this step's
        tokens. The caller sets ``duration`` once the step is over."""
        scheduled = sched_out.num_scheduled_tokens
        if not scheduled:
            return None
        batch: list[tuple[str, int, bool]] = []
        contexts: list[int] = []
        num_sampling = 0
        total = 0
        for rid, n in scheduled.items():
            req = requests[rid]
            after = req.num_computed_tokens
            # Speculative draft slots sit past the known tokens.
            spec = sched_out.num_spec_tokens.get(rid, 0)
            samples = after - spec == len(req.all_token_ids)
            num_sampling += samples + spec
            # Decode: exactly the token sampled last step (plus any drafts). Anything else
            # computes prompt tokens: a chunk, a whole prompt, or a recompute after preemption.
            batch.append((rid, n, not (samples and n - spec == 1 and req.output_token_ids)))
            contexts.append(after - n)
            total += n
        flops = nbytes = 0.0
        if self.arch is not None:
            flops, nbytes = step_cost(
                self.arch, total, contexts, list(scheduled.values()), num_logits=num_sampling, **self._cost_kwargs
            )
        step_id = self._next_step_id
        self._next_step_id += 1
        return StepRecord(step_id, start, 0.0, batch, len(sched_out.preempted_req_ids), flops, nbytes)

    def maybe_block_map(self, pool: BlockPool, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        if now - self._last_block_map < BLOCK_MAP_INTERVAL_S:
            return None
        self._last_block_map = now
        return kv_block_map(pool)
