"""GET /metrics: the engine's metrics in Prometheus text format.

Names mirror vLLM's (``vllm:X`` -> ``pagoda:X``) so that existing dashboards and
alerts port over by renaming the prefix; every series carries ``model_name``.

The values live in EngineMetrics (front end) and SchedulerStats (engine core, the
latest one received); a custom collector turns them into metric families at scrape
time. Each app gets its own CollectorRegistry, so several servers can run in one
process (the tests do) without clashing on a global registry.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pagoda.engine.protocol import SchedulerStats
from pagoda.metrics.histogram import Histogram
from pagoda.metrics.stats import FINISH_REASONS, EngineMetrics

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
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
        yield from self._lora_metrics(stats)
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
        for attr, name, doc in _HISTOGRAMS:
            hist: Histogram = getattr(metrics, attr)
            h = HistogramMetricFamily(f"pagoda:{name}", doc, labels=labels)
            h.add_metric(value, hist.cumulative(), hist.sum)
            yield h

    def _lora_metrics(self, stats: SchedulerStats) -> Iterator[Metric]:
        """Like vLLM: one series whose labels list the adapters with running and waiting
        requests (comma-separated names) and max_lora; its value is the scrape time.
        And prompt / generated tokens per adapter."""
        config = getattr(self.engine, "config", None)
        if config is None or not getattr(config, "enable_lora", False):
            return
        info = GaugeMetricFamily(
            "pagoda:lora_requests_info", "Running and waiting LoRA adapters (labels); value: scrape time.",
            labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        info.add_metric([self.model_name, ",".join(sorted(stats.running_lora_adapters)),
                         ",".join(sorted(stats.waiting_lora_adapters)), str(config.max_loras)], time.time())
        yield info
        counts: dict[str, list[int]] = getattr(self.engine, "lora_token_counts", {})
        labels = ["model_name", "lora_name"]
        prompt = CounterMetricFamily("pagoda:lora_prompt_tokens", "Prompt tokens per LoRA adapter.", labels=labels)
        generated = CounterMetricFamily("pagoda:lora_generation_tokens", "Generated tokens per LoRA adapter.",
                                        labels=labels)
        for name in sorted(counts):
            prompt.add_metric([self.model_name, name], counts[name][0])
            generated.add_metric([self.model_name, name], counts[name][1])
        yield prompt
        yield generated


def make_registry(engine: Any, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
