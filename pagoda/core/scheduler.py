"""Continuous batching under one token budget.

There is no prefill phase and no decode phase. Each step the scheduler gives
every request it runs some number of new tokens to compute, so that
``num_computed_tokens`` catches up with ``num_tokens``: a whole prompt, a
chunk of one (chunked prefill), or the one token sampled last step (decode).
All of it fits in ``max_num_batched_tokens``. Running requests go first, so a
long prompt can never starve decodes; waiting requests fill what is left.

When the KV pool runs out, the most recently admitted running request is
preempted by recompute: its blocks are freed, it goes back to the front of
the waiting queue with its generated tokens kept, and later its prompt plus
those tokens are computed again (often mostly from the prefix cache).

Speculative decoding is one more case of the same loop: a decoding request that
may speculate gets 1 + k tokens (its last sampled token and k draft slots, which
the runner's proposer fills) within the same budget, with KV slots for all of
them. After verification ``num_computed_tokens`` is reset to what the target
accepted and blocks holding only rejected drafts go back to the pool.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagoda.engine.protocol import EngineCoreOutput, SchedulerStats, TokenLogprobs
from pagoda.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    max_model_len: int = 8192
    num_speculative_tokens: int = 0       # draft slots per decoding request; 0 = off

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"num_speculative_tokens must be a non-negative integer, got {k!r}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Forgotten since the last schedule(); the runner drops their state.
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        self._grammar_failures: list[str] = []
        self.num_steps = 0
        self._last_batch_size = 0
        self._last_num_tokens = 0
        # Speculative decoding counters (cumulative), vLLM's spec_decode_* metrics.
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * config.num_speculative_tokens

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the context length "
                f"(max_model_len) is {self.config.max_model_len}"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step loop (abort, stop string)."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        ended = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            ended.append(request)
        return ended

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def _free(self, request: Request) -> None:
        self.kv.free(request)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _grammar_ready(self, request: Request) -> bool:
        """True once the request's grammar (if any) is compiled. A failed
        compile ends the request (aborted) at the next update."""
        future = request.grammar
        if future is None:
            return True
        if not future.done():
            return False
        request.grammar = None
        try:
            request.matcher = future.result()
        except Exception:  # the front end validated it; a failure here is rare
            self._grammar_failures.append(request.request_id)
            return False
        return True

    def _num_spec_tokens(self, request: Request, budget: int) -> int:
        """Draft slots for a decoding request: none under a grammar (the matcher
        cannot roll back) or with logprobs asked; never more than the tokens it may
        still emit after this step's own, nor than the budget left."""
        k = self.config.num_speculative_tokens
        params = request.sampling_params
        if (
            k == 0
            or request.matcher is not None
            or params.structured_outputs is not None
            or params.logprobs is not None
        ):
            return 0
        return max(0, min(k, request.max_output_tokens - request.num_output_tokens - 1, budget - 1))

    # ---- one step --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        num_spec: dict[str, int] = {}

        # 1. Running requests, oldest first: decodes and unfinished prompt chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:
                # All scheduled already; its sampled token has not arrived yet.
                i += 1
                continue
            # Drafts never take the budget of a running request behind this one.
            spec = self._num_spec_tokens(request, budget - (len(self.running) - i - 1)) if num_new == 1 else 0
            new_blocks = self.kv.allocate_slots(request, num_new + spec)
            if new_blocks is None and spec:
                spec = 0  # no room to speculate: decode plainly before preempting anyone
                new_blocks = self.kv.allocate_slots(request, num_new)
            while new_blocks is None:
                # Out of blocks: evict the most recently admitted request.
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
                new_blocks = self.kv.allocate_slots(request, num_new)
            if new_blocks is None:
                break
            if spec:
                num_spec[request.request_id] = spec
                num_new += spec
            num_scheduled[request.request_id] = num_new
            cached_reqs.append(
                CachedRequestData(
                    request.request_id,
                    [b.block_id for b in new_blocks],
                    request.num_computed_tokens,
                )
            )
            budget -= num_new
            i += 1

        # 2. Waiting requests, in order, while budget, seats and blocks last.
        # Nothing new is admitted in a step that had to preempt. A request
        # whose grammar is still compiling lets the ones behind it go first.
        compiling: list[Request] = []
        while (
            self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if not self._grammar_ready(request):
                compiling.append(self.waiting.popleft())
                continue
            hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            new_blocks = self.kv.allocate_slots(request, num_new, hit_blocks, num_hit_tokens)
            if new_blocks is None:
                break
            self.waiting.popleft()
            self.kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit_tokens,
                    eos_token_ids=request.eos_token_ids,
                )
            )
            budget -= num_new

        self.waiting.extendleft(reversed(compiling))

        # The step will compute these tokens; account for them now so the next
        # schedule() (possibly before this step's output arrives) sees them.
        structured: list[str] = []
        for rid, n in num_scheduled.items():
            request = self.requests[rid]
            request.num_computed_tokens += n
            if request.matcher is not None and request.num_computed_tokens == request.num_tokens:
                structured.append(rid)

        finished = self._finished_ids
        self._finished_ids = set()
        total = sum(num_scheduled.values())
        self._last_batch_size = len(num_scheduled)
        self._last_num_tokens = total
        if total:
            self.num_steps += 1
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
            structured_req_ids=structured,
            num_spec_tokens=num_spec,
        )

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, stop finished requests, free their blocks."""
        outputs: list[EngineCoreOutput] = []
        if self._grammar_failures:
            failed = self.finish_requests(self._grammar_failures, RequestStatus.FINISHED_ABORTED)
            self._grammar_failures = []
            outputs.extend(EngineCoreOutput(r.request_id, [], finish_reason="abort") for r in failed)
        for idx, rid in enumerate(runner_out.req_ids):
            request = self.requests.get(rid)
            token_ids = runner_out.sampled_token_ids[idx]
            if request is None or request.is_finished or not token_ids:
                continue  # aborted meanwhile, or a prompt chunk that samples nothing
            if request.status != RequestStatus.RUNNING:
                continue  # preempted after it was scheduled
            num_drafts = runner_out.num_draft_tokens.get(rid, 0)
            if num_drafts:
                self._count_spec(num_drafts, len(token_ids) - 1)
            new_ids: list[int] = []
            for token_id in token_ids:
                request.append_output_token(token_id)
                new_ids.append(token_id)
                if request.check_stop():
                    break
                if request.matcher is not None:
                    # The mask only offered tokens the grammar accepts; it
                    # ends the request once nothing more may follow.
                    request.matcher.accept_token(token_id)
                    if request.matcher.is_terminated():
                        request.status = RequestStatus.FINISHED_STOPPED
                        break
            new_logprobs = None
            if runner_out.logprobs is not None and runner_out.logprobs[idx] is not None:
                new_logprobs = [
                    TokenLogprobs(lp, ids, lps)
                    for lp, ids, lps in runner_out.logprobs[idx][: len(new_ids)]
                ]
            finish_reason = None
            if request.is_finished:
                finish_reason = request.status.finish_reason
                self.running.remove(request)
                self._free(request)
            elif rid in sched_out.num_spec_tokens:
                # Roll back to what was verified: every emitted token but the last
                # is computed now; slots of rejected (or never proposed) drafts are not.
                request.num_computed_tokens = request.num_tokens - 1
                self.kv.trim(request)
            # Metrics: the admission time rides on the first output, preemptions on the last.
            first = request.num_output_tokens == len(new_ids)
            outputs.append(
                EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=new_ids,
                    new_logprobs=new_logprobs,
                    finish_reason=finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    scheduled_time=(request.first_scheduled_time or 0.0) if first else 0.0,
                    num_preemptions=request.num_preemptions if finish_reason is not None else 0,
                )
            )
        return outputs

    def _count_spec(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.spec_accepted_per_pos[pos] += 1

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            step_batch_size=self._last_batch_size,
            step_num_tokens=self._last_num_tokens,
            num_steps=self.num_steps,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_accepted_per_pos=list(self.spec_accepted_per_pos),
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for request in self.running:
            if request.status != RequestStatus.RUNNING:
                raise AssertionError(f"{request} in running with status {request.status.name}")
        for request in self.waiting:
            if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise AssertionError(f"{request} in waiting with status {request.status.name}")
            if request.request_id in self.kv.req_to_blocks:
                raise AssertionError(f"waiting {request} holds blocks")
        known = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        if known != set(self.requests):
            raise AssertionError("request map out of sync with the queues")
        if set(self.kv.req_to_blocks) - {r.request_id for r in self.running}:
            raise AssertionError("a request that is not running holds blocks")
        for request in self.running:
            held = len(self.kv.req_to_blocks.get(request.request_id, []))
            if held * self.kv.block_size < request.num_computed_tokens:
                raise AssertionError(f"{request} holds {held} blocks, too few for its computed tokens")
