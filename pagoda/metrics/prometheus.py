"""GET /metrics: the engine's metrics in Prometheus text format.

Names mirror vLLM's (``vllm:X`` -> ``pagoda:X``) so that existing dashboards and
alerts port over by renaming the prefix; every series carries ``model_name``.

The values live in EngineMetrics (front end) and SchedulerStats (engine core, the
latest one received); a custom collector turns them into metric families at scrape
time. Each app gets its own CollectorRegistry, so several servers can run in one
process (the tests do) without clashing on a global registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pagoda.engine.protocol import SchedulerStats
from pagoda.metrics.histogram import Histogram
from pagoda.metrics.stats import FINISH_REASONS, EngineMetrics, LabelledStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (attribute of EngineMetrics, metric name, help)
_HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    ("ttft", "time_to_first_token_seconds", "Time from arrival to the first generated token."),
    ("inter_token", "inter_token_latency_seconds", "Time between two consecutive outputs of a request."),
    ("time_per_output_token", "request_time_per_output_token_seconds",
     "Per request: decode time divided by generated tokens after the first."),
    ("e2e", "e2e_request_latency_seconds", "Time from arrival to the last token, finished requests."),
    ("queue_time", "request_queue_time_seconds", "Time from arrival until first scheduled."),
    ("inference_time", "request_inference_time_seconds", "Time from first scheduled to the last token."),
    ("prefill_time", "request_prefill_time_seconds", "Time from first scheduled to the first token."),
    ("decode_time", "request_decode_time_seconds", "Time from the first token to the last."),
    ("request_prompt_tokens", "request_prompt_tokens", "Prompt length of finished requests."),
    ("request_generation_tokens", "request_generation_tokens", "Generated tokens of finished requests."),
    ("iteration_tokens", "iteration_tokens_total", "Tokens computed per engine step."),
    ("iteration_batch_size", "iteration_batch_size", "Requests scheduled per engine step."),
)


class EngineCollector(Collector):
    """Reads the engine's state at scrape time. ``metrics`` may be None (an engine
    without a recorder, e.g. a test double): then only the gauges are exported."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name"]
        value = [self.model_name]
        metrics: EngineMetrics | None = getattr(self.engine, "metrics", None)
        stats: SchedulerStats = self.engine.latest_stats()

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"pagoda:{name}", doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"pagoda:{name}", doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running_reqs)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting_reqs)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full).",
                    stats.kv_cache_usage)
        yield gauge("kv_cache_num_blocks", "KV blocks in the pool.", stats.num_blocks)
        # Cumulative in the engine core since start; exported as they are.
        yield counter("num_preemptions", "Requests preempted (recompute).", stats.num_preemptions)
        yield counter("num_swap_preemptions", "Preemptions that swapped the KV to host memory.",
                      stats.num_swap_preemptions)
        yield counter("swapped_out_blocks", "KV blocks copied to the host pool.", stats.num_swapped_out_blocks)
        yield counter("swapped_in_blocks", "KV blocks copied back from the host pool.", stats.num_swapped_in_blocks)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
        if metrics is None:
            return
        yield counter("prompt_tokens", "Prompt tokens of requests that produced a token.", metrics.prompt_tokens)
        yield counter("generation_tokens", "Generated tokens.", metrics.generation_tokens)
        success = CounterMetricFamily("pagoda:request_success", "Finished requests, by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason in sorted(set(FINISH_REASONS) | set(metrics.request_success)):
            success.add_metric([self.model_name, reason], metrics.request_success.get(reason, 0))
        yield success
        yield counter("request_aborted", "Requests aborted (client gone, timeout, shutdown).",
                      metrics.request_aborted)
        yield counter("engine_steps", "Engine steps that computed tokens.", metrics.num_steps)
        yield counter("engine_step_seconds", "Time spent in engine steps; divide the estimates by it.",
                      metrics.step_seconds)
        yield counter("estimated_flops", "Estimated FLOPs computed by engine steps (analytic model).",
                      metrics.step_flops)
        yield counter("estimated_bytes", "Estimated bytes moved by engine steps: weights + KV read/written.",
                      metrics.step_bytes)
        yield from _class_families(metrics.by_tenant, "tenant", self.model_name)
        yield from _class_families(metrics.by_priority, "priority", self.model_name)
        for attr, name, doc in _HISTOGRAMS:
            hist: Histogram = getattr(metrics, attr)
            h = HistogramMetricFamily(f"pagoda:{name}", doc, labels=labels)
            h.add_metric(value, hist.cumulative(), hist.sum)
            yield h


def _class_families(stats: LabelledStats, label: str, model_name: str) -> Iterator[Metric]:
    """pagoda:<label>_requests, _prompt_tokens, _generation_tokens, _time_to_first_token_seconds
    and _request_queue_time_seconds, one series per tenant / priority value."""
    labels = ["model_name", label]
    families = {
        "requests": CounterMetricFamily(f"pagoda:{label}_requests", f"Requests received, by {label}.", labels=labels),
        "prompt_tokens": CounterMetricFamily(f"pagoda:{label}_prompt_tokens",
                                             f"Prompt tokens of requests that produced a token, by {label}.",
                                             labels=labels),
        "generation_tokens": CounterMetricFamily(f"pagoda:{label}_generation_tokens",
                                                 f"Generated tokens, by {label}.", labels=labels),
    }  # fmt: skip
    ttft = HistogramMetricFamily(f"pagoda:{label}_time_to_first_token_seconds",
                                 f"Time from arrival to the first generated token, by {label}.", labels=labels)
    queue = HistogramMetricFamily(f"pagoda:{label}_request_queue_time_seconds",
                                  f"Time from arrival until first scheduled, by {label}.", labels=labels)
    for value, cls in sorted(stats.by_label.items()):
        for attr, family in families.items():
            family.add_metric([model_name, value], getattr(cls, attr))
        ttft.add_metric([model_name, value], cls.ttft.cumulative(), cls.ttft.sum)
        queue.add_metric([model_name, value], cls.queue_time.cumulative(), cls.queue_time.sum)
    yield from families.values()
    yield ttft
    yield queue


def make_registry(engine: Any, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
