"""The JSON behind GET /dashboard: batching timeline, queues, KV pool, latencies.

The page polls ``/dashboard/data?since=<last step id it has>`` so that each poll
carries only the steps it has not seen (a few hundred at most).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from pagoda.metrics.stats import EngineMetrics

if TYPE_CHECKING:
    from pagoda.metrics.prometheus import MetricsSource

LATENCY_WINDOW_S = 60.0


def dashboard_data(engine: MetricsSource, model_name: str, since: int = -1) -> dict[str, Any]:
    stats = engine.latest_stats()
    now = time.monotonic()
    data: dict[str, Any] = {
        "model_name": model_name,
        "now": now,
        "stats": {
            "num_running_reqs": stats.num_running_reqs,
            "num_waiting_reqs": stats.num_waiting_reqs,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_blocks": stats.num_blocks,
            "num_free_blocks": stats.num_free_blocks,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "num_preemptions": stats.num_preemptions,
        },
        "steps": [],
        "series": [],
        "kv_block_map": None,
        "latency": {},
        "totals": {},
    }
    metrics: EngineMetrics | None = engine.metrics
    if metrics is None:
        return data
    data["steps"] = [
        {
            "id": s.step_id,
            "t": s.start,
            "dur": s.duration,
            "batch": [[rid, n, int(prompt)] for rid, n, prompt in s.batch],
            "preempted": s.num_preempted,
            "flops": s.flops,
            "bytes": s.bytes_moved,
        }
        for s in metrics.steps
        if s.step_id > since
    ]
    data["series"] = [list(p) for p in metrics.series]
    data["kv_block_map"] = metrics.kv_block_map
    data["latency"] = {
        "window_s": LATENCY_WINDOW_S,
        "ttft": metrics.recent_ttft.percentiles(now, LATENCY_WINDOW_S),
        "itl": metrics.recent_itl.percentiles(now, LATENCY_WINDOW_S),
        "e2e": metrics.recent_e2e.percentiles(now, LATENCY_WINDOW_S),
    }
    data["totals"] = {
        "prompt_tokens": metrics.prompt_tokens,
        "generation_tokens": metrics.generation_tokens,
        "request_success": dict(metrics.request_success),
        "request_aborted": metrics.request_aborted,
        "engine_steps": metrics.num_steps,
        "engine_step_seconds": metrics.step_seconds,
        "estimated_flops": metrics.step_flops,
        "estimated_bytes": metrics.step_bytes,
    }
    return data
