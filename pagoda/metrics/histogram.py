"""Plain-Python histograms and sliding windows, cheap enough to update per token.

The front end observes into these; pagoda/metrics/prometheus.py reads them at
scrape time. Keeping the state here (not in prometheus_client objects) means no
global registry, no locks (all updates and scrapes run on the server's event
loop), and a scrape that sees one consistent snapshot.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable

# vLLM V1's bounds (vllm/v1/metrics/loggers.py), all of them among ours below, so that a vLLM
# dashboard's or alert's le="..." selector finds its bucket: time to first token; the request
# phases (end to end, queue, prefill, decode, inference); inter-token and per-request
# time per output token.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
VLLM_INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                            10.0, 20.0, 40.0, 80.0)  # fmt: skip

# Latencies from 1 ms (a GPU decode step) to ~2 hours (a long CPU generation), vLLM's bounds included.
LATENCY_BUCKETS: tuple[float, ...] = tuple(sorted({
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0,
    *VLLM_TTFT_BUCKETS, *VLLM_REQUEST_LATENCY_BUCKETS,
}))
# Gaps between tokens: finer at the fast end, up to a minute (a long stall or preemption).
INTER_TOKEN_BUCKETS: tuple[float, ...] = tuple(sorted({
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
    *VLLM_INTER_TOKEN_BUCKETS,
}))


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to and including the first value >= limit."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            out.append(float(m * scale))
            if m * scale >= limit:
                return tuple(out)
        scale *= 10


def buckets_pow2(limit: int) -> tuple[float, ...]:
    """1, 2, 4, ... up to and including the first power of two >= limit."""
    out = [1.0]
    while out[-1] < limit:
        out.append(out[-1] * 2)
    return tuple(out)


class Histogram:
    """Prometheus semantics: bucket i counts observations <= bounds[i]; one +Inf bucket."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """[(le, cumulative count)], ending with ("+Inf", count)."""
        out = []
        total = 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            out.append((repr(float(bound)), total))
        out.append(("+Inf", self.count))
        return out


class WindowedSamples:
    """The most recent samples (at most ``maxlen``) with their times, for percentiles
    over the last minute. Under very heavy load the cap, not the window, decides
    which samples count: they are still the newest ones."""

    __slots__ = ("_samples",)

    def __init__(self, maxlen: int = 20000) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=maxlen)

    def add(self, t: float, value: float) -> None:
        self._samples.append((t, value))

    def percentiles(self, now: float, window_s: float, qs: Iterable[float] = (0.5, 0.9, 0.99)) -> dict[str, float]:
        cutoff = now - window_s
        values = sorted(v for t, v in self._samples if t >= cutoff)
        out: dict[str, float] = {"n": float(len(values))}
        for q in qs:
            key = f"p{q * 100:g}"
            if not values:
                out[key] = 0.0
                continue
            # Nearest rank: the smallest value with at least q of the samples at or below it.
            rank = max(1, math.ceil(q * len(values) - 1e-9))
            out[key] = values[min(rank, len(values)) - 1]
        return out
