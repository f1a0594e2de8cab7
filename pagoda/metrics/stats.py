"""Front-end side of the metrics: per-request timings, counters, histograms, history.

AsyncLLM feeds this from the engine core's per-step messages and from the output
processor's results; /metrics (prometheus.py), the periodic log line (log.py) and the
dashboard (dashboard.py) read it. Everything runs on the server's event loop.

Units and clocks. Every timestamp is time.monotonic(): the front end's own (arrival,
when an output arrived) and the engine core's (admission, step end), which share
CLOCK_MONOTONIC. Latencies a client feels (TTFT, inter-token, end-to-end) use the
front end's receive times, so they include the hop from the engine; the phases inside
the engine (queue, prefill, decode, inference) use the engine's own times.

A request here is an engine request: a completion with n > 1 choices counts n times,
once per sample, as each is scheduled, computed and finished on its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from pagoda.core.outputs import EngineCoreOutput, SchedulerStats, StepRecord
from pagoda.metrics.histogram import (
    INTER_TOKEN_BUCKETS,
    LATENCY_BUCKETS,
    Histogram,
    WindowedSamples,
    buckets_1_2_5,
    buckets_pow2,
)
from pagoda.outputs import RequestOutput, child_request_id

if TYPE_CHECKING:
    from pagoda.sampling_params import SamplingParams


class EngineOutputs(Protocol):
    """What the metrics read of one message from the engine core (the engine's
    ``EngineCoreOutputs`` or ``Heartbeat``; the metrics sit below the engine)."""

    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats | None
    timestamp: float
    step: StepRecord | None
    kv_block_map: str | None
    expert_load: list[list[int]] | None


HISTORY_STEPS = 400           # steps kept for the dashboard's timeline
SERIES_INTERVAL_S = 0.25      # queue / KV usage sampled at most this often
SERIES_LEN = 1200             # ... for this many samples (5 minutes)
FINISH_REASONS = ("stop", "length")


@dataclass(slots=True)
class RequestTrace:
    """What the request log line and the request's span (pagoda/metrics/tracing.py) say when a request ends."""

    request_id: str
    finish_reason: str
    arrival_time: float        # monotonic
    queue_time: float | None   # None: never scheduled
    ttft: float | None         # None: no token produced
    e2e: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    # For the span: the phases on the engine's clock (None: no token, or never scheduled),
    # the request's sampling parameters (None: an embedding) and its W3C trace context.
    prefill_time: float | None = None   # scheduled -> first token
    decode_time: float | None = None    # first token -> last token
    sampling_params: SamplingParams | None = None
    trace_headers: Mapping[str, str] | None = None


class ClassStats:
    """Per-class figures (a tenant, or a priority value): requests, tokens, TTFT, queue time."""

    __slots__ = ("requests", "prompt_tokens", "generation_tokens", "ttft", "queue_time")

    def __init__(self) -> None:
        self.requests = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.queue_time = Histogram(LATENCY_BUCKETS)


class LabelledStats:
    """ClassStats by label value, for at most ``max_labels`` values: the label comes from
    clients (an X-Tenant header, a priority), so later values share one ``other`` series
    rather than grow the scrape without bound."""

    OTHER = "other"

    def __init__(self, max_labels: int = 32) -> None:
        self.max_labels = max_labels
        self.by_label: dict[str, ClassStats] = {}

    def get(self, label: str) -> ClassStats:
        stats = self.by_label.get(label)
        if stats is None:
            if len(self.by_label) >= self.max_labels:
                label = self.OTHER
            stats = self.by_label.setdefault(label, ClassStats())
        return stats


@dataclass(slots=True)
class _RequestState:
    arrival: float
    num_prompt_tokens: int
    tenant: ClassStats | None = None
    priority: ClassStats | None = None
    scheduled: float = 0.0        # engine clock
    first_engine: float = 0.0     # engine clock, step that produced the first token
    last_engine: float = 0.0
    first_token: float = 0.0      # front-end clock
    last_token: float = 0.0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    sampling_params: SamplingParams | None = None      # what tracing reports of the request
    trace_headers: Mapping[str, str] | None = None


class EngineMetrics:
    def __init__(
        self,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        on_request_end: Callable[[RequestTrace], None] | None = None,
    ) -> None:
        self.on_request_end = on_request_end
        self._requests: dict[str, _RequestState] = {}
        self.stats = SchedulerStats()
        # Counters (front end).
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        self.request_aborted = 0
        # Counters summed from step records.
        self.num_steps = 0
        self.step_seconds = 0.0
        self.step_flops = 0.0
        self.step_bytes = 0.0
        # Histograms.
        token_buckets = buckets_1_2_5(max_model_len)
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.inter_token = Histogram(INTER_TOKEN_BUCKETS)
        self.time_per_output_token = Histogram(INTER_TOKEN_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue_time = Histogram(LATENCY_BUCKETS)
        self.inference_time = Histogram(LATENCY_BUCKETS)
        self.prefill_time = Histogram(LATENCY_BUCKETS)
        self.decode_time = Histogram(LATENCY_BUCKETS)
        self.request_prompt_tokens = Histogram(token_buckets)
        self.request_generation_tokens = Histogram(token_buckets)
        self.iteration_tokens = Histogram(buckets_pow2(max_num_batched_tokens))
        self.iteration_batch_size = Histogram(buckets_pow2(max_num_seqs))
        # Dashboard history.
        self.steps: deque[StepRecord] = deque(maxlen=HISTORY_STEPS)
        self.series: deque[tuple[float, int, int, float]] = deque(maxlen=SERIES_LEN)
        self.kv_block_map: str | None = None
        self.expert_load: list[list[int]] | None = None   # MoE models: the latest the core sent
        self.recent_ttft = WindowedSamples()
        self.recent_itl = WindowedSamples()
        self.recent_e2e = WindowedSamples()
        # By tenant (from the API key or X-Tenant) and by priority value.
        self.by_tenant = LabelledStats()
        self.by_priority = LabelledStats()

    @property
    def num_tracked_requests(self) -> int:
        return len(self._requests)

    # ---- inputs ---------------------------------------------------------------------

    def add_request(self, request_id: str, arrival: float, num_prompt_tokens: int,
                    tenant: str | None = None, priority: int = 0, sampling_params: SamplingParams | None = None,
                    trace_headers: Mapping[str, str] | None = None) -> None:  # fmt: skip
        """``sampling_params`` and ``trace_headers`` (the request's W3C trace context) are only
        handed on to ``on_request_end``, for the request's span."""
        from pagoda.tenants import DEFAULT_TENANT

        by_tenant = self.by_tenant.get(tenant or DEFAULT_TENANT)
        by_priority = self.by_priority.get(str(priority))
        by_tenant.requests += 1
        by_priority.requests += 1
        self._requests[request_id] = _RequestState(arrival, num_prompt_tokens, by_tenant, by_priority,
                                                   sampling_params=sampling_params, trace_headers=trace_headers)

    def on_engine_outputs(self, msg: EngineOutputs, now: float) -> None:
        """One message from the engine core: a step's outputs, a heartbeat, or aborts."""
        if msg.scheduler_stats is not None:
            self.stats = stats = msg.scheduler_stats
            if not self.series or now - self.series[-1][0] >= SERIES_INTERVAL_S:
                self.series.append((now, stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage))
        if msg.kv_block_map is not None:
            self.kv_block_map = msg.kv_block_map
        if msg.expert_load is not None:
            self.expert_load = msg.expert_load
        step = msg.step
        if step is not None:
            self.steps.append(step)
            self.num_steps += 1
            self.step_seconds += step.duration
            self.step_flops += step.flops
            self.step_bytes += step.bytes_moved
            self.iteration_tokens.observe(sum(n for _, n, _ in step.batch))
            self.iteration_batch_size.observe(len(step.batch))
        engine_ts = msg.timestamp
        requests = self._requests
        for out in msg.outputs:
            state = requests.get(out.request_id)
            if state is None:
                continue  # not ours, or already ended (e.g. by a stop string)
            if out.scheduled_time:
                state.scheduled = out.scheduled_time
            if out.pooled is not None:
                # An embedding request: its prompt computed and pooled, it is done.
                state.first_engine = state.last_engine = engine_ts
                self.prompt_tokens += state.num_prompt_tokens
                for cls in (state.tenant, state.priority):
                    if cls is not None:
                        cls.prompt_tokens += state.num_prompt_tokens
                self._finish(out.request_id, out.finish_reason or "stop", now)
                continue
            n = len(out.new_token_ids)
            if n:
                if state.num_generation_tokens == 0:
                    state.first_token = now
                    state.first_engine = engine_ts
                    state.num_cached_tokens = out.num_cached_tokens
                    self.prompt_tokens += state.num_prompt_tokens
                    ttft = now - state.arrival
                    self.ttft.observe(ttft)
                    self.recent_ttft.add(now, ttft)
                    for cls in (state.tenant, state.priority):
                        if cls is not None:
                            cls.ttft.observe(ttft)
                            cls.prompt_tokens += state.num_prompt_tokens
                else:
                    itl = now - state.last_token
                    self.inter_token.observe(itl)
                    self.recent_itl.add(now, itl)
                state.last_token = now
                state.last_engine = engine_ts
                state.num_generation_tokens += n
                self.generation_tokens += n
                for cls in (state.tenant, state.priority):
                    if cls is not None:
                        cls.generation_tokens += n
            if out.num_preemptions:
                state.num_preemptions = out.num_preemptions

    def on_request_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        """The output processor's results for the same message: it decides when a
        request ends (it also matches stop strings, which the engine cannot see)."""
        for out in outputs:
            n = len(out.outputs)
            for choice in out.outputs:
                if choice.just_finished and choice.finish_reason is not None:
                    self._finish(child_request_id(out.request_id, choice.index, n), choice.finish_reason, now)

    def on_abort(self, request_ids: list[str], now: float) -> None:
        for rid in request_ids:
            self._finish(rid, "abort", now)

    # ---- a request ends -------------------------------------------------------------

    def _finish(self, request_id: str, reason: str, now: float) -> None:
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        e2e = now - state.arrival
        if reason == "abort":
            self.request_aborted += 1
        else:
            # Latency histograms count completed requests only; an abort's timings
            # say more about the client than about the engine.
            self.request_success[reason] = self.request_success.get(reason, 0) + 1
            self.e2e.observe(e2e)
            self.recent_e2e.add(now, e2e)
            self.request_prompt_tokens.observe(state.num_prompt_tokens)
            self.request_generation_tokens.observe(state.num_generation_tokens)
            scheduled = state.scheduled or state.first_engine
            queued = max(0.0, scheduled - state.arrival)
            self.queue_time.observe(queued)
            for cls in (state.tenant, state.priority):
                if cls is not None:
                    cls.queue_time.observe(queued)
            self.prefill_time.observe(max(0.0, state.first_engine - scheduled))
            decode = max(0.0, state.last_engine - state.first_engine)
            self.decode_time.observe(decode)
            self.inference_time.observe(max(0.0, state.last_engine - scheduled))
            tokens_after_first = state.num_generation_tokens - 1
            self.time_per_output_token.observe(decode / tokens_after_first if tokens_after_first > 0 else 0.0)
        if self.on_request_end is not None:
            # As the histograms above measure them, for a request that produced a token.
            scheduled = state.scheduled or state.first_engine
            produced = state.first_engine > 0.0
            self.on_request_end(RequestTrace(
                request_id=request_id,
                finish_reason=reason,
                arrival_time=state.arrival,
                queue_time=max(0.0, state.scheduled - state.arrival) if state.scheduled else None,
                ttft=state.first_token - state.arrival if state.num_generation_tokens else None,
                e2e=e2e,
                num_prompt_tokens=state.num_prompt_tokens,
                num_cached_tokens=state.num_cached_tokens,
                num_generation_tokens=state.num_generation_tokens,
                num_preemptions=state.num_preemptions,
                prefill_time=max(0.0, state.first_engine - scheduled) if produced else None,
                decode_time=max(0.0, state.last_engine - state.first_engine) if produced else None,
                sampling_params=state.sampling_params,
                trace_headers=state.trace_headers,
            ))
