"""Log lines: a periodic throughput line while busy, and one line per finished request."""

from __future__ import annotations

import datetime
import logging
import time

from pagoda.metrics.stats import EngineMetrics, RequestTrace

logger = logging.getLogger("pagoda.metrics")


def _wall_clock(monotonic_ts: float) -> str:
    wall = time.time() - (time.monotonic() - monotonic_ts)
    return datetime.datetime.fromtimestamp(wall).isoformat(sep=" ", timespec="milliseconds")


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}s"


def log_request(trace: RequestTrace) -> None:
    logger.info(
        "request %s finished: reason=%s arrival=%s queue=%s ttft=%s e2e=%s "
        "prompt_tokens=%d cached_tokens=%d generation_tokens=%d preemptions=%d",
        trace.request_id, trace.finish_reason, _wall_clock(trace.arrival_time), _secs(trace.queue_time),
        _secs(trace.ttft), _secs(trace.e2e), trace.num_prompt_tokens, trace.num_cached_tokens,
        trace.num_generation_tokens, trace.num_preemptions,
    )  # fmt: skip


class StatLogger:
    """Every ``interval`` seconds while the engine is busy (and once more when it goes
    idle), logs throughput over the interval, queue sizes, KV usage and the prefix
    cache hit rate over the interval. Driven by ``maybe_log`` on every engine message
    (at least one every half second, the engine's heartbeat), so it needs no task."""

    def __init__(self, metrics: EngineMetrics, interval: float = 10.0) -> None:
        if interval <= 0:
            raise ValueError(f"the stats log interval must be > 0, got {interval}")
        self.metrics = metrics
        self.interval = interval
        self._last_time: float | None = None
        self._last = (0, 0, 0, 0, 0, 0, 0)
        self._was_busy = False

    def _counters(self) -> tuple[int, ...]:
        m, s = self.metrics, self.metrics.stats
        return (m.prompt_tokens, m.generation_tokens, s.prefix_cache_queries, s.prefix_cache_hits,
                s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens)

    def maybe_log(self, now: float) -> str | None:
        """Returns the line logged, if any."""
        if self._last_time is None:
            self._last_time, self._last = now, self._counters()
            return None
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return None
        counters = self._counters()
        d_prompt, d_gen, d_queries, d_hits, d_drafts, d_draft_tokens, d_accepted = (
            a - b for a, b in zip(counters, self._last)
        )
        self._last_time, self._last = now, counters
        stats = self.metrics.stats
        busy = bool(d_prompt or d_gen or stats.num_running_reqs or stats.num_waiting_reqs)
        if not busy and not self._was_busy:
            return None
        self._was_busy = busy
        line = (
            f"Avg prompt throughput: {d_prompt / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {d_gen / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
            f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {(d_hits / d_queries * 100) if d_queries else 0.0:.1f}%"
        )
        if d_draft_tokens:
            line += (
                f", Spec decode acceptance: {d_accepted / d_draft_tokens * 100:.1f}% "
                f"({1 + d_accepted / d_drafts:.2f} tokens per verification)"
            )
        logger.info("%s", line)
        return line
