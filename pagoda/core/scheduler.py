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
    # LoRA: requests of at most this many different adapters run at once (0 = LoRA off).
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


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

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the context length "
                f"(max_model_len) is {self.config.max_model_len}"
            )
        if request.lora_int_id and not self.config.max_loras:
            raise ValueError("this scheduler runs without LoRA (max_loras=0); the request names an adapter")
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

    # ---- one step --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()

        # 1. Running requests, oldest first: decodes and unfinished prompt chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:
                # All scheduled already; its sampled token has not arrived yet.
                i += 1
                continue
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
        # whose grammar is still compiling, or whose LoRA adapter would be one
        # more than max_loras running at once, lets the ones behind it go first.
        compiling: list[Request] = []
        active_loras = {r.lora_int_id for r in self.running if r.lora_int_id}
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
            lora_id = request.lora_int_id
            if lora_id and lora_id not in active_loras and len(active_loras) >= self.config.max_loras:
                compiling.append(self.waiting.popleft())
                continue
            hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            new_blocks = self.kv.allocate_slots(request, num_new, hit_blocks, num_hit_tokens)
            if new_blocks is None:
                break
            self.waiting.popleft()
            if lora_id:
                active_loras.add(lora_id)
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
                    lora_int_id=lora_id,
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

    def lora_request_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Requests per adapter name: (running, waiting)."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for queue, counts in ((self.running, running), (self.waiting, waiting)):
            for r in queue:
                if r.lora_request is not None:
                    counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
        return running, waiting

    def make_stats(self) -> SchedulerStats:
        running_loras, waiting_loras = self.lora_request_counts() if self.config.max_loras else ({}, {})
        return SchedulerStats(
            running_lora_adapters=running_loras,
            waiting_lora_adapters=waiting_loras,
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
