"""GET /metrics: the engine's metrics in Prometheus text format.

Names mirror vLLM's (``vllm:X`` -> ``pagoda:X``), and the metrics vLLM V1 exports are
exported under their ``vllm:`` names too (``VLLM_ALIASES``), so that dashboards, alerts and
autoscalers written for vLLM read pagoda unchanged; every series carries ``model_name``.

The values live in EngineMetrics (front end) and SchedulerStats (engine core, the
latest one received); a custom collector turns them into metric families at scrape
time. Each app gets its own CollectorRegistry, so several servers can run in one
process (the tests do) without clashing on a global registry.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pagoda.core.outputs import SchedulerStats
from pagoda.metrics.histogram import Histogram
from pagoda.metrics.stats import FINISH_REASONS, EngineMetrics, LabelledStats

if TYPE_CHECKING:
    from pagoda.config import EngineConfig


class MetricsSource(Protocol):
    """What /metrics and the dashboard read of an engine (every EngineClient has it)."""

    config: EngineConfig
    metrics: EngineMetrics | None            # None: an engine without a recorder (only gauges)
    replicas: Sequence[MetricsSource]        # data-parallel replicas (one series each), else empty
    lora_token_counts: Mapping[str, list[int]]  # adapter -> [prompt tokens, generated tokens]

    def latest_stats(self) -> SchedulerStats: ...

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


# pagoda:X exported again as vllm:X: the vLLM V1 metrics a vLLM dashboard reads, where pagoda
# has the same quantity with the same meaning and labels (vllm/v1/metrics/loggers.py and
# stats.py): prompt_tokens counts a request's whole prompt, cached part included, once, when
# its first token comes out (each of n samples: each is an engine request, as in vLLM);
# generation_tokens every generated token; request_success finished requests by
# finished_reason (stop, length; aborted requests are pagoda:request_aborted, not a third
# reason); the histograms' buckets include every bound of vLLM's (histogram.py).
VLLM_ALIASES: frozenset[str] = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions",
    "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens", "request_success",
    "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos", "lora_requests_info",
    # Every histogram but iteration_batch_size, which vLLM has not, and iteration_tokens_total:
    # vLLM's observes per step the whole prompts of the requests whose first token came out plus
    # the tokens generated, pagoda's the tokens the step computed (a chunk of a prompt, no cached
    # tokens), another quantity under the same name.
    *(name for _, name, _ in _HISTOGRAMS if name not in ("iteration_batch_size", "iteration_tokens_total")),
})  # fmt: skip


def _vllm_alias(family: Metric) -> Metric | None:
    """The same family under vLLM's name (its samples renamed with it), if vLLM has it."""
    name = family.name.removeprefix("pagoda:")
    if name == family.name or name not in VLLM_ALIASES:
        return None
    alias = Metric(f"vllm:{name}", family.documentation, family.type, family.unit)
    alias.samples = [s._replace(name="vllm:" + s.name.removeprefix("pagoda:")) for s in family.samples]
    return alias


class EngineCollector(Collector):
    """Reads the engine's state at scrape time. ``metrics`` may be None (an engine
    without a recorder, e.g. a test double): then only the gauges are exported."""

    def __init__(self, engine: MetricsSource, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        # Data-parallel replicas (engine.replicas): one series per replica, label engine="i".
        replicas = self.engine.replicas
        if replicas:
            labels = ["model_name", "engine"]
            parts = [([self.model_name, str(i)], r.metrics, r.latest_stats()) for i, r in enumerate(replicas)]
        else:
            labels = ["model_name"]
            parts = [([self.model_name], self.engine.metrics, self.engine.latest_stats())]
        families = list(_families(labels, parts))
        if len(parts) == 1:  # LoRA runs without data parallelism (EngineConfig checks)
            families.extend(self._lora_metrics(parts[0][2]))
        yield from families
        for family in families:
            alias = _vllm_alias(family)
            if alias is not None:
                yield alias

    def _lora_metrics(self, stats: SchedulerStats) -> Iterator[Metric]:
        """Like vLLM: one series whose labels list the adapters with running and waiting
        requests (comma-separated names) and max_lora; its value is the scrape time.
        And prompt / generated tokens per adapter."""
        config = self.engine.config
        if not config.enable_lora:
            return
        info = GaugeMetricFamily(
            "pagoda:lora_requests_info", "Running and waiting LoRA adapters (labels); value: scrape time.",
            labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        info.add_metric([self.model_name, ",".join(sorted(stats.running_lora_adapters)),
                         ",".join(sorted(stats.waiting_lora_adapters)), str(config.max_loras)], time.time())
        yield info
        counts = self.engine.lora_token_counts
        labels = ["model_name", "lora_name"]
        prompt = CounterMetricFamily("pagoda:lora_prompt_tokens", "Prompt tokens per LoRA adapter.", labels=labels)
        generated = CounterMetricFamily("pagoda:lora_generation_tokens", "Generated tokens per LoRA adapter.",
                                        labels=labels)
        for name in sorted(counts):
            prompt.add_metric([self.model_name, name], counts[name][0])
            generated.add_metric([self.model_name, name], counts[name][1])
        yield prompt
        yield generated


def _families(labels: list[str], parts: list[tuple[list[str], EngineMetrics | None, SchedulerStats]]
              ) -> Iterator[Metric]:
    def gauge(name: str, doc: str, get) -> GaugeMetricFamily:
        g = GaugeMetricFamily(f"pagoda:{name}", doc, labels=labels)
        for value, metrics, stats in parts:
            g.add_metric(value, get(stats))
        return g

    def counter(name: str, doc: str, get, source: str = "stats") -> CounterMetricFamily:
        c = CounterMetricFamily(f"pagoda:{name}", doc, labels=labels)
        for value, metrics, stats in parts:
            c.add_metric(value, get(stats if source == "stats" else metrics))
        return c

    yield gauge("num_requests_running", "Requests in the running batch.", lambda s: s.num_running_reqs)
    yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting_reqs)
    yield gauge("kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full).",
                lambda s: s.kv_cache_usage)
    yield gauge("kv_cache_num_blocks", "KV blocks in the pool.", lambda s: s.num_blocks)
    # Cumulative in the engine core since start; exported as they are.
    yield counter("num_preemptions", "Requests preempted (recompute).", lambda s: s.num_preemptions)
    yield counter("num_swap_preemptions", "Preemptions that swapped the KV to host memory.",
                  lambda s: s.num_swap_preemptions)
    yield counter("swapped_out_blocks", "KV blocks copied to the host pool.", lambda s: s.num_swapped_out_blocks)
    yield counter("swapped_in_blocks", "KV blocks copied back from the host pool.", lambda s: s.num_swapped_in_blocks)
    yield gauge("state_slots", "A hybrid model's state slots (one per running request; 0: not a hybrid).",
                lambda s: s.num_state_slots)
    yield gauge("state_slots_used", "State slots held by running requests.",
                lambda s: s.num_state_slots - s.num_free_state_slots)
    yield gauge("saved_states", "States the prefix cache keeps at block ends (hybrid models).",
                lambda s: s.num_saved_states)
    yield counter("state_restores", "Prefix-cache hits that started from a saved state (hybrid models).",
                  lambda s: s.num_state_restores)
    yield counter("encoder_cache_hits", "Image embeddings read from the encoder cache (a step that needed them).",
                  lambda s: s.encoder_cache_hits)
    yield counter("encoder_runs", "Images encoded (encoder cache misses).", lambda s: s.encoder_cache_misses)
    yield counter("encoder_seconds", "Seconds spent in the vision encoder.", lambda s: s.encoder_seconds)
    yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                  lambda s: s.prefix_cache_queries)
    yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", lambda s: s.prefix_cache_hits)
    yield counter("spec_decode_num_drafts", "Speculative verification rounds with at least one draft.",
                  lambda s: s.spec_num_drafts)
    yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                  lambda s: s.spec_num_draft_tokens)
    yield counter("spec_decode_num_accepted_tokens", "Draft tokens the target accepted.",
                  lambda s: s.spec_num_accepted_tokens)
    per_pos = CounterMetricFamily("pagoda:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted draft tokens by position in the draft (0 = first).",
                                  labels=labels + ["position"])
    for value, _, stats in parts:
        for pos, n in enumerate(stats.spec_accepted_per_pos):
            per_pos.add_metric(value + [str(pos)], n)
    yield per_pos
    if any(metrics is None for _, metrics, _ in parts):
        return
    yield counter("prompt_tokens", "Prompt tokens of requests that produced a token.",
                  lambda m: m.prompt_tokens, "metrics")
    yield counter("generation_tokens", "Generated tokens.", lambda m: m.generation_tokens, "metrics")
    success = CounterMetricFamily("pagoda:request_success", "Finished requests, by finish reason.",
                                  labels=labels + ["finished_reason"])
    for value, metrics, _ in parts:
        for reason in sorted(set(FINISH_REASONS) | set(metrics.request_success)):
            success.add_metric(value + [reason], metrics.request_success.get(reason, 0))
    yield success
    yield counter("request_aborted", "Requests aborted (client gone, timeout, shutdown).",
                  lambda m: m.request_aborted, "metrics")
    if any(metrics.expert_load for _, metrics, _ in parts):
        load = CounterMetricFamily("pagoda:moe_expert_tokens",
                                   "MoE models: tokens routed to each expert (top-k picks), by MoE layer.",
                                   labels=labels + ["layer", "expert"])
        for value, metrics, _ in parts:
            for layer, counts in enumerate(metrics.expert_load or ()):
                for expert, n in enumerate(counts):
                    load.add_metric(value + [str(layer), str(expert)], n)
        yield load
    yield counter("engine_steps", "Engine steps that computed tokens.", lambda m: m.num_steps, "metrics")
    yield counter("engine_step_seconds", "Time spent in engine steps; divide the estimates by it.",
                  lambda m: m.step_seconds, "metrics")
    yield counter("estimated_flops", "Estimated FLOPs computed by engine steps (analytic model).",
                  lambda m: m.step_flops, "metrics")
    yield counter("estimated_bytes", "Estimated bytes moved by engine steps: weights + KV read/written.",
                  lambda m: m.step_bytes, "metrics")
    yield from _class_families(labels, parts, "by_tenant", "tenant")
    yield from _class_families(labels, parts, "by_priority", "priority")
    for attr, name, doc in _HISTOGRAMS:
        h = HistogramMetricFamily(f"pagoda:{name}", doc, labels=labels)
        for value, metrics, _ in parts:
            hist: Histogram = getattr(metrics, attr)
            h.add_metric(value, hist.cumulative(), hist.sum)
        yield h


def _class_families(labels: list[str], parts: list[tuple[list[str], EngineMetrics | None, SchedulerStats]],
                    attr_name: str, label: str) -> Iterator[Metric]:
    """pagoda:<label>_requests, _prompt_tokens, _generation_tokens, _time_to_first_token_seconds
    and _request_queue_time_seconds, one series per tenant / priority value (and replica)."""
    labels = labels + [label]
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
    for prefix, metrics, _ in parts:
        stats: LabelledStats = getattr(metrics, attr_name)
        for value, cls in sorted(stats.by_label.items()):
            for attr, family in families.items():
                family.add_metric(prefix + [value], getattr(cls, attr))
            ttft.add_metric(prefix + [value], cls.ttft.cumulative(), cls.ttft.sum)
            queue.add_metric(prefix + [value], cls.queue_time.cumulative(), cls.queue_time.sum)
    yield from families.values()
    yield ttft
    yield queue


def make_registry(engine: MetricsSource, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
