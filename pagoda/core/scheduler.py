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

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from pagoda.core.host_pool import HostBlockPool
from pagoda.core.kv_cache_manager import KVCacheManager, block_ids_of
from pagoda.core.outputs import EngineCoreOutput, SchedulerStats, TokenLogprobs
from pagoda.core.sched_policy import POLICIES, FairShare, make_policy, queue_key, tenant_of
from pagoda.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagoda.core.request import Request, RequestStatus
from pagoda.core.state_pool import StateCheckpoints, StatePool
from pagoda.tenants import TenantSpec
from pagoda.validation import RequestLimits, admission_check


def needs_prompt_logits(request: Request) -> bool:
    """A request that asked for prompt_logprobs and has not had them: it skips the prefix
    cache, because a cached block's positions would never have their logits computed.
    (Once it has sampled, its prompt logprobs went out; a resumed one may hit the cache.)"""
    return request.sampling_params.prompt_logprobs is not None and not request.output_token_ids


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    max_model_len: int = 8192
    num_speculative_tokens: int = 0       # draft slots per decoding request; 0 = off
    # fcfs | priority | fair (see sched_policy.py).
    policy: str = "fcfs"
    # Long-prefill fairness: at most this many prompts with more than the threshold of
    # tokens to compute are chunk-prefilled at once (None: no bound), and a long
    # prefill's chunk is capped at the threshold while other work wants the budget.
    max_long_partial_prefills: int | None = None
    long_prefill_token_threshold: int | None = None   # None: 4 % of max_model_len if the bound is set
    # Tenants' weights and running limits (fair policy); unknown tenants: weight 1.
    tenants: tuple[TenantSpec, ...] = ()
    # recompute | swap | auto: how a victim gives its blocks back. swap copies its KV to
    # a host pool of num_host_blocks (recompute when that is full); auto swaps victims
    # with at least auto_swap_min_tokens computed and recomputes shorter ones.
    preemption_mode: str = "recompute"
    num_host_blocks: int = 0
    auto_swap_min_tokens: int = 256
    # LoRA: requests of at most this many different adapters run at once (0 = LoRA off).
    max_loras: int = 0
    # The model's vocabulary, for the admission re-check of prompt token ids (None: unchecked).
    vocab_size: int | None = None
    # A hybrid model's state slots (pagoda/core/state_pool.py): one per running request; 0: none.
    num_state_slots: int = 0
    # Swap preemption on a hybrid model: host slots for swapped-out requests' states (a
    # victim without one is recomputed, as when the host KV pool is full).
    num_host_state_slots: int = 0
    # Its prefix cache's saved states (StateCheckpoints; 0: none, prefix hits off for it), and
    # how often a long prompt chunk saves one (every interval-th block end, and its last).
    num_state_checkpoints: int = 0
    state_checkpoint_interval: int = 1
    # A model whose images attend in both directions (Gemma 3): a prompt chunk never ends
    # inside an image's span (its first tokens would miss the later ones).
    whole_images: bool = False
    # An encoder (BERT: every token attends to its whole prompt): a prompt is computed in one
    # step or waits for a step with room for all of it.
    whole_prompts: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"num_speculative_tokens must be a non-negative integer, got {k!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be recompute, swap or auto, got {self.preemption_mode!r}")
        if self.preemption_mode != "recompute" and self.num_host_blocks < 1:
            raise ValueError(f"preemption_mode={self.preemption_mode} needs a host pool (swap space)")
        for name in ("max_long_partial_prefills", "long_prefill_token_threshold"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def long_prefill_threshold(self) -> int | None:
        """Prompts with more tokens than this to compute are long prefills (None: no such notion)."""
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        if self.max_long_partial_prefills is not None:
            return max(1, int(self.max_model_len * 0.04))
        return None


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
        self.policy = make_policy(config.policy)
        # What add_request re-checks (pagoda/validation.py): the front ends validated already.
        self.limits = RequestLimits(config.max_model_len, config.vocab_size, config.policy, config.max_loras > 0)
        self.fair = FairShare(config.tenants)
        self.states = StatePool(config.num_state_slots) if config.num_state_slots else None
        self.host_states = StatePool(config.num_host_state_slots) if config.num_host_state_slots else None
        self.checkpoints = None
        if config.num_state_checkpoints:
            self.checkpoints = StateCheckpoints(config.num_state_checkpoints, config.state_checkpoint_interval)
            kv_manager.hit_filter = self.checkpoints.has   # a hit ends where a state is saved
        self.host = HostBlockPool(config.num_host_blocks)
        self.num_swap_preemptions = 0
        # Host blocks (and host state slots) of requests swapped in by the last step,
        # released at the next one.
        self._host_release: list[int] = []
        self._host_state_release: list[int] = []
        # Prefill-decode disaggregation: finished requests whose blocks are kept for a decode
        # instance (Request.kv_park) until release_parked (pagoda/kv_transfer/engine.py).
        self.parked: dict[str, Request] = {}

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. It gets the admission re-check of pagoda/validation.py (a request
        that bypassed a front end must not break the invariants here or reach the model with
        a token id outside the vocabulary); InvalidRequestError, or ValueError for an id in use."""
        self.check_request(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.fair.on_add(tenant_of(request))
        self.policy.enqueue(self.waiting, request)

    def check_request(self, request: Request) -> None:
        """``add_request``'s checks alone (a request that waits for its KV first checks early)."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        admission_check(request.prompt_token_ids, request.sampling_params, self.limits, request.priority,
                        request.lora_request, pooling=request.pooling_params is not None)  # fmt: skip

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
                self._remove_running(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            ended.append(request)
        return ended

    def release_parked(self, request_id: str) -> bool:
        """Free a parked request's blocks (fetched, released or expired); False if unknown."""
        request = self.parked.pop(request_id, None)
        if request is None:
            return False
        self.kv.free(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def _free(self, request: Request, park: bool = False) -> None:
        """Forget a finished request; ``park``: keep its blocks (in ``parked``) for a decode instance."""
        if park:
            self.parked[request.request_id] = request
        else:
            self.kv.free(request)
        self._free_state(request)
        if request.host_block_ids:
            self.host.free(request.host_block_ids)
            request.host_block_ids = []
            request.host_block_places = []
        if request.host_state >= 0:
            self.host_states.free(request.host_state)
            request.host_state = -1
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]
        self.fair.on_finish(tenant_of(request))

    def _free_state(self, request: Request) -> None:
        if request.state_slot >= 0:
            self.states.free(request.state_slot)
            request.state_slot = -1

    def _remove_running(self, request: Request) -> None:
        self.running.remove(request)
        self.fair.on_stop_running(tenant_of(request))

    def _preempt(self, request: Request, step: _Step) -> None:
        """``request`` has already left ``running``. Swap its KV out to the host pool
        (keeping its progress) or drop it to be recomputed, per the preemption mode."""
        self.fair.on_stop_running(tenant_of(request))
        # The blocks of its computed tokens it still holds (a windowed group gave back
        # those behind its window): (group, table index, block id).
        live = self.kv.live_blocks(request.request_id, -(-request.num_computed_tokens // self.kv.block_size))
        # A request with a token in flight is recomputed: its computed count runs ahead of
        # its tokens, and the pending token is dropped when it arrives.
        host = self._swap_space_for(request, len(live)) if not request.num_pending else None
        request.num_pending = 0
        if host is not None and self.states is not None:
            # A hybrid model's request takes its state along (or, with no host slot, is recomputed).
            request.host_state = self.host_states.allocate() if self.host_states is not None else -1
            if request.host_state < 0:
                self.host.free(host)
                host = None
            else:
                step.state_swap_out.append((request.state_slot, request.host_state))
        if host is not None:
            step.swap_out.extend(zip([b for _, _, b in live], host))
            request.host_block_ids = host
            request.host_block_places = [(g, i) for g, i, _ in live]
            self.host.num_swapped_out += len(host)
            self.num_swap_preemptions += 1
        else:
            request.num_computed_tokens = 0
        self.kv.free(request)
        self._free_state(request)   # recomputed from its first token: its state made afresh
        request.status = RequestStatus.PREEMPTED
        request.long_prefill_end = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.policy.enqueue(self.waiting, request, front=True)

    def _swap_space_for(self, request: Request, num_blocks: int) -> list[int] | None:
        """``num_blocks`` host blocks for the victim's computed KV, or None to recompute it."""
        mode = self.config.preemption_mode
        computed = request.num_computed_tokens
        if mode == "recompute" or computed == 0:
            return None
        if mode == "auto" and computed < self.config.auto_swap_min_tokens:
            return None
        return self.host.allocate(num_blocks)

    def _pick_victim(self) -> Request:
        """The running request to preempt: the most recently admitted one, or under
        the priority policy the lowest-priority one (latest arrival among equals)."""
        return self.policy.victim(self.running)

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
            or request.pooling_params is not None   # its prompt's last token is no decode
        ):
            return 0
        return max(0, min(k, request.max_output_tokens - request.num_output_tokens - 1, budget - 1))

    # ---- one step --------------------------------------------------------------

    def schedule(self, token_budget: int | None = None, overlap: bool = False) -> SchedulerOutput:
        """``token_budget``: at most this many tokens this step (within max_num_batched_tokens);
        pipeline parallelism shares the work out over the micro-batches it keeps in flight.
        ``overlap``: the step may be scheduled while the one before is in flight (the engine
        core's overlapped steps): a request whose token that step samples gets the position
        after it too (``Request.num_pending``), unless that token certainly ends it.

        E.g. a decode with 11 tokens, 10 computed: step N computes position 10 and samples
        the token at 11 (pending 1); step N+1, scheduled while N runs, computes position 11
        (pending 2); N's token arrives (12 tokens, pending 1), and so on."""
        budget = self.config.max_num_batched_tokens
        step = _Step(budget if token_budget is None else max(1, min(token_budget, budget)))
        if self.checkpoints is not None:
            self.checkpoints.begin_step()
        if self._host_release:
            # Swapped in by the last step, whose copies are done.
            self.host.free(self._host_release)
            self._host_release = []
        for slot in self._host_state_release:
            self.host_states.free(slot)
        self._host_state_release = []
        if self.policy.shares_budget:
            # What each tenant could use this step: its running requests' remaining tokens
            # and its waiting requests' prompts (an upper bound; the top-up evens it out).
            demand: dict[str, int] = {}
            for r in itertools.chain(self.running, self.waiting):
                if r.num_tokens > r.num_computed_tokens:
                    t = tenant_of(r)
                    demand[t] = demand.get(t, 0) + r.num_tokens - r.num_computed_tokens
            step.quota = self.fair.quotas(step.budget, demand)

        # A step that has other requests' prompts waiting runs no background work: the step that
        # computes a live prompt (its time to first token) carries none of a batch's rows.
        yield_step = any(not r.background for r in self.waiting)

        # 1. Running requests, oldest first: decodes and unfinished prompt chunks.
        i = 0
        while i < len(self.running) and step.budget > 0:
            request = self.running[i]
            want = request.num_tokens + request.num_pending - request.num_computed_tokens
            if request.num_pending and (request.num_output_tokens + request.num_pending >= request.max_output_tokens
                                        or not overlap):
                want = 0   # the pending token ends it (or steps are not overlapped now)
            if request.background and yield_step:
                i += 1
                continue
            num_new = self._cap(request, min(want, step.budget), step, request.num_computed_tokens)
            if num_new == 0:
                # All scheduled already (its sampled token has not arrived yet), or
                # its tenant's share of this step is used up.
                i += 1
                continue
            # Drafts never take the budget of a running request behind this one.
            spec = (self._num_spec_tokens(request, step.budget - (len(self.running) - i - 1))
                    if num_new == 1 and want == 1 else 0)
            new_blocks = self.kv.allocate_slots(request, num_new + spec)
            if new_blocks is None and spec:
                spec = 0  # no room to speculate: decode plainly before preempting anyone
                new_blocks = self.kv.allocate_slots(request, num_new)
            while new_blocks is None:
                # Out of blocks: evict a victim (possibly this request itself).
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1  # it was scheduled earlier in this step
                self._evict(victim, step)
                if victim is request:
                    break
                new_blocks = self.kv.allocate_slots(request, num_new)
            if new_blocks is None:
                break
            capped = num_new < want
            if spec:
                step.num_spec[request.request_id] = spec
                num_new += spec
            step.num_scheduled[request.request_id] = num_new
            step.cached[request.request_id] = CachedRequestData(
                request.request_id, block_ids_of(new_blocks), request.num_computed_tokens
            )
            step.charge(request, num_new, capped=capped)
            i += 1

        # 2. Waiting requests while budget, seats and blocks last. Nothing new is
        # admitted in a step that had to preempt a running request to continue.
        if not step.preempted:
            if self.policy.shares_budget:
                self._admit_fair(step)
            else:
                self._admit_in_order(step)

        # 3. Budget left over: extend the chunks that a share or the long-prefill cap held back.
        if step.capped and step.budget > 0:
            self._top_up(step)

        # The step will compute these tokens; account for them now so the next
        # schedule() (possibly before this step's output arrives) sees them.
        structured: list[str] = []
        state_writes: dict[str, list[tuple[int, int]]] = {}
        for rid, n in step.num_scheduled.items():
            request = self.requests[rid]
            if self.checkpoints is not None:
                state_writes[rid] = self._state_writes(request, n)
            request.num_computed_tokens += n
            if request.num_computed_tokens >= request.long_prefill_end:
                request.long_prefill_end = 0
            self.fair.charge(tenant_of(request), n)
            if request.matcher is not None and request.num_computed_tokens == request.num_tokens:
                structured.append(rid)
            if overlap and request.num_computed_tokens == request.num_tokens + request.num_pending:
                request.num_pending += 1   # this step samples a token the next may build on

        finished = self._finished_ids
        self._finished_ids = set()
        total = sum(step.num_scheduled.values())
        self._last_batch_size = len(step.num_scheduled)
        self._last_num_tokens = total
        if total:
            self.num_steps += 1
        new_reqs = [step.new[rid] for rid in step.num_scheduled if rid in step.new]
        for data in new_reqs:
            data.block_ids = self.kv.get_block_ids(data.req_id)
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=[step.cached[rid] for rid in step.num_scheduled if rid in step.cached],
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=finished,
            preempted_req_ids=step.preempted,
            structured_req_ids=structured,
            num_spec_tokens=step.num_spec,
            swap_out=step.swap_out,
            swap_in=step.swap_in,
            state_swap_out=step.state_swap_out,
            kv_in=step.kv_in,
            state_writes=state_writes,
        )

    # ---- pieces of a step --------------------------------------------------------

    def _state_writes(self, request: Request, n: int) -> list[tuple[int, int]]:
        """Where a hybrid model's step over n tokens of ``request`` saves its state: (block
        end - the chunk's first position, checkpoint entry) for every interval-th block end
        the chunk completes and its last one; the request's previous last one (of no use
        once a later one is saved) becomes the first entry to reuse."""
        bs, start = self.kv.block_size, request.num_computed_tokens
        first, last = start // bs + 1, min(start + n, request.num_tokens) // bs
        if last < first:
            return []
        hashes = self.kv.block_hashes(request)
        interval = self.checkpoints.interval
        writes = []
        for k in range(first, min(last, len(hashes)) + 1):
            if k % interval == 0 or k == last:
                entry = self.checkpoints.write(hashes[k - 1])
                if entry is not None:
                    writes.append((k * bs - start, entry))
        if last <= len(hashes) and last % interval:
            if request.state_tail is not None and request.state_tail != hashes[last - 1]:
                self.checkpoints.demote(request.state_tail)
            request.state_tail = hashes[last - 1]
        return writes

    def _cap(self, request: Request, num_new: int, step: _Step, start: int) -> int:
        """Hold back a long prefill's chunk at the threshold and a tenant at its share
        (the top-up pass gives back what nobody else used); ``start``: the chunk's first
        position. With ``whole_images``, a chunk that would end inside an image ends before
        it, or, starting in or at one, runs to its end where the budget allows that much; with
        ``whole_prompts``, a prompt runs whole or not at all."""
        allowed = num_new
        threshold = self.config.long_prefill_threshold
        if threshold is not None and request.long_prefill_end and num_new > threshold:
            num_new = threshold
        if step.quota is not None:
            num_new = min(num_new, step.quota.get(tenant_of(request), 0))
        if self.config.whole_images and request.mm_inputs:
            num_new = self._whole_images(request, start, num_new, allowed)
        if self.config.whole_prompts and start + num_new < request.num_tokens:
            # The rest of the prompt past the other caps where the budget holds it, else nothing.
            num_new = request.num_tokens - start if start + allowed >= request.num_tokens else 0
        return num_new

    @staticmethod
    def _whole_images(request: Request, start: int, num_new: int, allowed: int) -> int:
        end = start + num_new
        for image in request.mm_inputs:
            if image.offset < end < image.end:
                if image.offset > start:
                    end = image.offset          # up to the image; it comes whole next time
                elif image.end - start <= allowed:
                    end = image.end             # the rest of the image, past the other caps
                else:
                    end = start                 # not this step
        return end - start

    def _evict(self, victim: Request, step: _Step) -> None:
        """Preempt a running request, undoing whatever this step scheduled for it."""
        self.running.remove(victim)
        n = step.num_scheduled.pop(victim.request_id, 0)
        if n:
            step.budget += n
            step.served[tenant_of(victim)] -= n
            if step.quota is not None:
                step.quota[tenant_of(victim)] = step.quota.get(tenant_of(victim), 0) + n
        step.cached.pop(victim.request_id, None)
        step.new.pop(victim.request_id, None)
        step.capped.pop(victim.request_id, None)
        step.num_spec.pop(victim.request_id, None)
        self._preempt(victim, step)
        step.preempted.add(victim.request_id)

    def _num_long_prefills(self, step: _Step) -> int:
        return sum(
            1 for r in self.running
            if r.long_prefill_end > r.num_computed_tokens + step.num_scheduled.get(r.request_id, 0)
        )

    def _must_wait(self, request: Request, step: _Step) -> bool:
        """A request that others behind it may pass this step: its grammar is still
        compiling, it is a long prefill while enough of them run, or its tenant is at
        its running limit."""
        if request.request_id in step.preempted:
            return True  # preempted in this very step (by a higher priority): not back yet
        if not self._grammar_ready(request):
            return True
        if not self.fair.can_run_more(tenant_of(request)):
            return True
        lora_id = request.lora_int_id
        if lora_id:
            # Its adapter would be one more than max_loras running at once.
            active = {r.lora_int_id for r in self.running if r.lora_int_id}
            if lora_id not in active and len(active) >= self.config.max_loras:
                return True
        cap = self.config.max_long_partial_prefills
        threshold = self.config.long_prefill_threshold
        if cap is not None and threshold is not None and request.kv_received is None:  # (received: one token)
            uncached = request.num_tokens - request.num_computed_tokens
            if uncached > threshold and step.num_long >= cap:
                # (Judged before the prefix lookup; a mostly cached prompt may wait needlessly.)
                return True
        return False

    def _try_admit(self, request: Request, step: _Step) -> bool:
        """Admit ``request`` (just taken off the waiting queue) if a seat, budget and
        blocks allow; under the priority policy, preempting lower-priority running
        requests for them, and under any policy background ones for a request that is not.
        False, changing nothing for it, if it cannot run now."""
        priority = self.policy.preempts_for_waiting or not request.background
        while len(self.running) >= self.config.max_num_seqs:
            if not (priority and self._preempt_lower(request, step)):
                return False
        swapped = bool(request.host_block_ids) or request.host_state >= 0
        received = request.kv_received is not None
        while True:
            if swapped:
                # Its KV comes back from the host pool; no prefix lookup.
                hit_blocks, num_hit_tokens = [], request.num_computed_tokens
            elif received:
                # Its KV came from a prefill instance: every token but the last is computed, in
                # the blocks received and in blocks of this pool's prefix cache that hold the
                # prefix the fetch skipped (allocate_slots adopts those, allocates the rest).
                hit_blocks, num_cached = self.kv.get_computed_blocks(request)
                if num_cached < request.kv_received.skip_blocks * self.kv.block_size:
                    # That cached prefix was evicted meanwhile: recompute, as after a preemption.
                    request.kv_received, received = None, False
                    continue
                num_hit_tokens = request.num_tokens - 1
            elif needs_prompt_logits(request):
                hit_blocks, num_hit_tokens = [], 0
            else:
                hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            want = request.num_tokens - num_hit_tokens
            num_new = min(want, step.budget)
            threshold = self.config.long_prefill_threshold
            is_long = threshold is not None and want > threshold
            if is_long:
                request.long_prefill_end = request.num_tokens
            num_new = self._cap(request, num_new, step, num_hit_tokens)
            if num_new == 0:
                request.long_prefill_end = 0
                return False
            if swapped:
                new_blocks = self.kv.allocate_slots(request, num_new)
            else:
                new_blocks = self.kv.allocate_slots(request, num_new, hit_blocks, num_hit_tokens)
            if new_blocks is not None:
                break
            request.long_prefill_end = 0
            if not (priority and self._preempt_lower(request, step)):
                return False
        if swapped:
            # Back into the blocks its tables hold now: a windowed group may hold fewer
            # than it swapped out (never more: the window has not moved back).
            for host, (g, i) in zip(request.host_block_ids, request.host_block_places):
                device = self.kv.block_at(request.request_id, g, i)
                if device is not None:
                    step.swap_in.append((host, device))
                    self.host.num_swapped_in += 1
            self._host_release.extend(request.host_block_ids)
            request.host_block_ids = []
            request.host_block_places = []
        elif received:
            # The received rows go into the blocks allocated for them, before this step's forward.
            end = -(-num_hit_tokens // self.kv.block_size)
            step.kv_in.append((request.request_id, [
                (g, len(hit_blocks[g]) + j, b.block_id)
                for g, new in enumerate(new_blocks) for j, b in enumerate(new)
                if b is not None and len(hit_blocks[g]) + j < end
            ]))  # fmt: skip
        else:
            self.kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
        restore = -1
        if num_hit_tokens and self.checkpoints is not None and not swapped:
            # The hit ends at a saved state (the KV manager's filter): the request starts from it.
            restore = self.checkpoints.restore(self.kv.block_hashes(request)[num_hit_tokens // self.kv.block_size - 1])
        if self.states is not None:
            # A seat was free, so a slot is (one per seat); a request keeps it while it runs.
            slot = self.states.allocate()
            if slot is None:
                raise AssertionError("no free state slot for a free seat")
            request.state_slot = slot
        state_swap_in = request.host_state
        if state_swap_in >= 0:   # back from the host (its host slot released at the next step)
            self._host_state_release.append(state_swap_in)
            request.host_state = -1
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.running.append(request)
        self.fair.on_start_running(tenant_of(request))
        if is_long:
            step.num_long += 1
        step.num_scheduled[request.request_id] = num_new
        step.new[request.request_id] = NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=[],  # filled in at the end of the step
            num_computed_tokens=num_hit_tokens,
            eos_token_ids=request.eos_token_ids,
            lora_int_id=request.lora_int_id,
            pooling_params=request.pooling_params,
            state_slot=request.state_slot,
            state_restore=restore,
            state_swap_in=state_swap_in,
            mm_inputs=request.mm_inputs,
        )
        step.charge(request, num_new, capped=num_new < want)
        return True

    def _preempt_lower(self, request: Request, step: _Step) -> bool:
        """Preempt the lowest-priority running request if its priority is strictly
        lower than ``request``'s, a background one counting below every other (requests
        admitted in this step are never victims). Policies that do not preempt for waiting
        requests preempt background ones only."""
        candidates = [r for r in self.running if r.request_id not in step.new
                      and (r.background or self.policy.preempts_for_waiting)]
        if not candidates:
            return False
        victim = max(candidates, key=queue_key)
        if (victim.background, victim.priority) <= (request.background, request.priority):
            return False
        self._evict(victim, step)
        return True

    def _admit_in_order(self, step: _Step) -> None:
        """fcfs and priority: the queue's order; requests that must wait are passed."""
        step.num_long = self._num_long_prefills(step)
        passed: list[Request] = []
        while self.waiting and step.budget > 0:
            request = self.waiting.popleft()
            if self._must_wait(request, step):
                passed.append(request)
                continue
            if not self._try_admit(request, step):
                self.waiting.appendleft(request)
                break
        self.waiting.extendleft(reversed(passed))

    def _admit_fair(self, step: _Step) -> None:
        """fair: each tenant's queue in order; the least served tenant (virtual
        time) with share left goes next, then, if budget remains, anyone."""
        step.num_long = self._num_long_prefills(step)
        queues: dict[str, deque[Request]] = {}
        for request in self.waiting:
            queues.setdefault(tenant_of(request), deque()).append(request)
        admitted: set[str] = set()
        stalled: set[str] = set()  # tenants that cannot admit more this step
        while step.budget > 0:
            open_ = [t for t, q in queues.items() if q and t not in stalled]
            if not open_:
                break
            if step.quota is not None:
                with_share = [t for t in open_ if step.quota.get(t, 0) > 0]
                if with_share:
                    open_ = with_share
                else:
                    # Everyone with work used their share: the rest of the budget is free for all.
                    step.quota = None
            tenant = self.fair.order(open_, step.served)[0]
            queue = queues[tenant]
            request = queue[0]
            if self._must_wait(request, step):
                queue.popleft()
                continue
            if not self._try_admit(request, step):
                if step.quota is not None and step.quota.get(tenant, 0) == 0:
                    stalled.add(tenant)
                    continue
                break  # out of seats or blocks: nobody else fits either
            queue.popleft()
            admitted.add(request.request_id)
        if admitted:
            self.waiting = deque(r for r in self.waiting if r.request_id not in admitted)

    def _top_up(self, step: _Step) -> None:
        """Give budget nobody else used to the requests that were held back (long
        prefill chunks, tenants at their share), least served tenants first."""
        tenants = {tenant_of(self.requests[r]) for r in step.capped}
        order = {t: k for k, t in enumerate(self.fair.order(tenants, step.served))}
        for rid in sorted(step.capped, key=lambda r: order[tenant_of(self.requests[r])]):
            if step.budget <= 0:
                break
            request = self.requests[rid]
            done = step.num_scheduled[rid]
            extra = min(step.capped[rid] - done, step.budget)
            if self.config.whole_images and request.mm_inputs:
                start = request.num_computed_tokens
                extra = self._whole_images(request, start, done + extra, done + extra) - done
            if extra <= 0:
                continue
            # Blocks for num_computed + done + extra tokens (num_computed is not advanced yet).
            new_blocks = self.kv.allocate_slots(request, done + extra)
            if new_blocks is None:
                continue
            step.num_scheduled[rid] = done + extra
            step.budget -= extra
            if rid in step.cached:
                for ids, new in zip(step.cached[rid].new_block_ids, block_ids_of(new_blocks)):
                    ids.extend(new)

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, stop finished requests, free their blocks."""
        outputs: list[EngineCoreOutput] = []
        if self._grammar_failures:
            failed = self.finish_requests(self._grammar_failures, RequestStatus.FINISHED_ABORTED)
            self._grammar_failures = []
            outputs.extend(EngineCoreOutput(r.request_id, [], finish_reason="abort") for r in failed)
        if runner_out.pooled:
            outputs.extend(self._finish_pooled(runner_out.pooled))
        for idx, rid in enumerate(runner_out.req_ids):
            request = self.requests.get(rid)
            token_ids = runner_out.sampled_token_ids[idx]
            prompt_lps = runner_out.prompt_logprobs.get(rid)
            if request is None or request.is_finished or request.status != RequestStatus.RUNNING:
                continue  # aborted meanwhile, or preempted after it was scheduled
            if token_ids and request.num_pending:
                request.num_pending -= 1
            if not token_ids:
                if prompt_lps is not None:  # a prompt chunk samples nothing, but scored its tokens
                    outputs.append(EngineCoreOutput(rid, [], prompt_logprobs=prompt_lps[1],
                                                    prompt_logprobs_start=prompt_lps[0]))
                continue
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
                    e if isinstance(e, TokenLogprobs) else TokenLogprobs(*e)
                    for e in runner_out.logprobs[idx][: len(new_ids)]
                ]
            finish_reason = None
            if request.is_finished:
                finish_reason = request.status.finish_reason
                self._remove_running(request)
                self._free(request, park=request.kv_park)
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
                    prompt_logprobs=prompt_lps[1] if prompt_lps is not None else None,
                    prompt_logprobs_start=prompt_lps[0] if prompt_lps is not None else 0,
                )
            )
        return outputs

    def _finish_pooled(self, pooled: dict[str, list[float]]) -> list[EngineCoreOutput]:
        """Embedding requests whose prompt the step finished: each ends now with its vector,
        and its blocks go back (what they hold stays in the prefix cache, as any freed block)."""
        outputs = []
        for rid, vector in pooled.items():
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted meanwhile
            request.status = RequestStatus.FINISHED_STOPPED
            self._remove_running(request)
            self._free(request)
            outputs.append(EngineCoreOutput(
                request_id=rid, new_token_ids=[], finish_reason="stop",
                num_cached_tokens=max(request.num_cached_tokens, 0),
                scheduled_time=request.first_scheduled_time or 0.0,
                num_preemptions=request.num_preemptions, pooled=vector,
            ))
        return outputs

    def _count_spec(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.spec_accepted_per_pos[pos] += 1

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
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_accepted_per_pos=list(self.spec_accepted_per_pos),
            num_swap_preemptions=self.num_swap_preemptions,
            num_swapped_out_blocks=self.host.num_swapped_out,
            num_swapped_in_blocks=self.host.num_swapped_in,
            num_host_blocks=self.host.num_blocks,
            num_free_host_blocks=self.host.num_free_blocks,
            num_state_slots=self.states.num_slots if self.states is not None else 0,
            num_free_state_slots=self.states.num_free if self.states is not None else 0,
            num_saved_states=len(self.checkpoints) if self.checkpoints is not None else 0,
            num_state_restores=self.checkpoints.num_restores if self.checkpoints is not None else 0,
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
        if set(self.kv.req_to_blocks) - {r.request_id for r in self.running} - set(self.parked):
            raise AssertionError("a request that is neither running nor parked holds blocks")
        for request in self.running:
            held = self.kv.num_table_blocks(request.request_id)
            if held * self.kv.block_size < request.num_computed_tokens:
                raise AssertionError(f"{request} holds {held} blocks, too few for its computed tokens")
            if request.host_block_ids:
                raise AssertionError(f"running {request} holds host blocks")
        self.host.check_integrity([r.host_block_ids for r in self.waiting] + [self._host_release])
        if self.states is not None:
            if any(r.state_slot >= 0 for r in self.waiting):
                raise AssertionError("a waiting request holds a state slot")
            self.states.check_integrity([r.state_slot for r in self.running])
        if self.host_states is not None:
            if any(r.host_state >= 0 for r in self.running):
                raise AssertionError("a running request holds a host state slot")
            self.host_states.check_integrity([r.host_state for r in self.waiting if r.host_state >= 0]
                                             + self._host_state_release)
        if self.checkpoints is not None:
            self.checkpoints.check_integrity()


class _Step:
    """What one schedule() call has decided so far."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.num_scheduled: dict[str, int] = {}   # insertion order = batch order
        self.cached: dict[str, CachedRequestData] = {}
        self.new: dict[str, NewRequestData] = {}
        self.preempted: set[str] = set()
        # Requests given fewer tokens than they want: rid -> tokens they want.
        self.capped: dict[str, int] = {}
        # Tenant -> tokens left of its share this step (fair policy only).
        self.quota: dict[str, int] | None = None
        self.num_long = 0   # long prefills in progress (admission phase)
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.state_swap_out: list[tuple[int, int]] = []   # (state slot, host state slot)
        self.kv_in: list[tuple[str, list[tuple[int, int, int]]]] = []
        self.num_spec: dict[str, int] = {}  # rid -> draft slots (in num_scheduled)
        self.served: dict[str, int] = {}   # tenant -> tokens scheduled so far in this step

    def charge(self, request: Request, num_new: int, capped: bool) -> None:
        self.budget -= num_new
        t = tenant_of(request)
        self.served[t] = self.served.get(t, 0) + num_new
        if self.quota is not None:
            t = tenant_of(request)
            self.quota[t] = self.quota.get(t, 0) - num_new
        if capped:
            self.capped[request.request_id] = request.num_tokens - request.num_computed_tokens
