"""Front-end metrics: histograms, windows, the recorder, the Prometheus collector, log lines."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.config import EngineConfig
from pagoda.core.outputs import EngineCoreOutput, SchedulerStats, StepRecord
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.messages import EngineCoreOutputs
from pagoda.metrics.dashboard import dashboard_data
from pagoda.metrics.histogram import (
    VLLM_INTER_TOKEN_BUCKETS,
    VLLM_REQUEST_LATENCY_BUCKETS,
    VLLM_TTFT_BUCKETS,
    Histogram,
    WindowedSamples,
    buckets_1_2_5,
    buckets_pow2,
)
from pagoda.metrics.log import StatLogger, log_request
from pagoda.metrics.prometheus import make_registry, render
from pagoda.metrics.stats import EngineMetrics, RequestTrace
from pagoda.sampling_params import SamplingParams


def test_histogram_buckets_follow_prometheus_semantics() -> None:
    h = Histogram([0.1, 1.0, 10.0])
    for v in (0.05, 0.1, 0.5, 1.0, 20.0):
        h.observe(v)
    assert h.count == 5 and h.sum == pytest.approx(21.65)
    # "le" is inclusive; the last bucket is +Inf and equals the count.
    assert h.cumulative() == [("0.1", 2), ("1.0", 4), ("10.0", 4), ("+Inf", 5)]


def test_bucket_helpers() -> None:
    assert buckets_1_2_5(150) == (1, 2, 5, 10, 20, 50, 100, 200)
    assert buckets_1_2_5(1) == (1,)
    assert buckets_pow2(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert buckets_pow2(300)[-1] == 512


def test_windowed_percentiles_use_only_the_window() -> None:
    w = WindowedSamples(maxlen=1000)
    w.add(0.0, 100.0)                  # outside the window below
    for i in range(1, 101):
        w.add(100.0 + i * 0.1, float(i))
    q = w.percentiles(now=111.0, window_s=60.0)
    assert q["n"] == 100
    assert (q["p50"], q["p90"], q["p99"]) == (50.0, 90.0, 99.0)
    assert WindowedSamples().percentiles(0.0, 60.0) == {"n": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}


def _msg(ts: float, outputs: list[EngineCoreOutput], step: StepRecord | None = None, **stats) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=outputs, scheduler_stats=SchedulerStats(**stats), timestamp=ts, step=step)


def _run_two_requests(metrics: EngineMetrics, traces: list[RequestTrace]) -> OutputProcessor:
    """a: prompt 5, three tokens, ends by length. b: prompt 3, aborted after one token."""
    proc = OutputProcessor(None)
    for rid, plen in (("a", 5), ("b", 3)):
        proc.add_request(rid, None, list(range(plen)), SamplingParams(max_tokens=3))
        metrics.add_request(rid, arrival=10.0, num_prompt_tokens=plen)
    steps = [
        (11.0, [EngineCoreOutput("a", [7], scheduled_time=10.5)]),
        (12.0, [EngineCoreOutput("a", [8]), EngineCoreOutput("b", [9], scheduled_time=11.5)]),
        (13.5, [EngineCoreOutput("a", [9], finish_reason="length", num_preemptions=2)]),
    ]
    for i, (t, outs) in enumerate(steps):
        step = StepRecord(i, t - 0.5, 0.5, [(o.request_id, 1, False) for o in outs], flops=10.0, bytes_moved=20.0)
        # Engine clock = front-end clock + 0.1 (the hop).
        msg = _msg(t, outs, step, num_running_reqs=2, prefix_cache_queries=8, prefix_cache_hits=4)
        metrics.on_engine_outputs(msg, t + 0.1)
        results, _ = proc.process_outputs(msg.outputs)
        metrics.on_request_outputs(results, t + 0.1)
    metrics.on_abort(proc.child_ids("b"), 14.0)
    proc.abort_request("b")
    # A late output for an ended request changes nothing.
    metrics.on_engine_outputs(_msg(15.0, [EngineCoreOutput("b", [1])]), 15.0)
    return proc


def test_recorder_counts_and_timings() -> None:
    traces: list[RequestTrace] = []
    m = EngineMetrics(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32, on_request_end=traces.append)
    _run_two_requests(m, traces)
    assert (m.prompt_tokens, m.generation_tokens) == (8, 4)
    assert m.request_success == {"stop": 0, "length": 1} and m.request_aborted == 1
    assert m.num_tracked_requests == 0
    assert m.ttft.count == 2 and m.ttft.sum == pytest.approx((11.1 - 10) + (12.1 - 10))
    assert m.inter_token.count == 2 and m.inter_token.sum == pytest.approx(1.0 + 1.5)
    # Completed requests only in the per-request histograms: a, not the aborted b.
    assert m.e2e.count == 1 and m.e2e.sum == pytest.approx(3.6)
    assert m.queue_time.sum == pytest.approx(0.5)        # scheduled 10.5 - arrival 10
    assert m.prefill_time.sum == pytest.approx(0.5)      # first token (engine 11.0) - scheduled
    assert m.decode_time.sum == pytest.approx(2.5)       # 13.5 - 11.0
    assert m.inference_time.sum == pytest.approx(3.0)
    assert m.time_per_output_token.sum == pytest.approx(1.25)
    assert m.request_prompt_tokens.sum == 5 and m.request_generation_tokens.sum == 3
    assert (m.num_steps, m.step_flops, m.step_bytes, m.step_seconds) == (3, 30.0, 60.0, 1.5)
    assert m.iteration_tokens.count == 3 and m.iteration_batch_size.sum == 4
    a, b = traces
    assert (a.request_id, a.finish_reason, a.num_generation_tokens, a.num_preemptions) == ("a", "length", 3, 2)
    assert a.queue_time == pytest.approx(0.5) and a.ttft == pytest.approx(1.1)
    assert (b.request_id, b.finish_reason, b.num_generation_tokens) == ("b", "abort", 1)


def test_stop_string_finish_comes_from_the_processor() -> None:
    m = EngineMetrics(64, 8, 32)
    m.add_request("1_r", 0.0, 2)
    m.add_request("0_r", 0.0, 2)
    proc = OutputProcessor(None)
    proc.add_request("r", None, [1, 2], SamplingParams(max_tokens=5, n=2))
    out = proc.process_outputs([EngineCoreOutput("1_r", [3], finish_reason="stop")])[0]
    m.on_request_outputs(out, 1.0)
    assert m.request_success["stop"] == 1 and m.num_tracked_requests == 1


class _FakeEngine:
    """A MetricsSource (pagoda/metrics/prometheus.py) with given stats."""

    def __init__(self, metrics: EngineMetrics | None, stats: SchedulerStats) -> None:
        self.metrics = metrics
        self._stats = stats
        self.config = EngineConfig()
        self.replicas = ()
        self.lora_token_counts: dict[str, list[int]] = {}

    def latest_stats(self) -> SchedulerStats:
        return self._stats


def _families(text: str) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out.setdefault(s.name, {})[labels] = s.value
    return out


def test_prometheus_exposition_parses_and_mirrors_vllm_names() -> None:
    m = EngineMetrics(64, 8, 32)
    _run_two_requests(m, [])
    stats = SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.5, num_preemptions=4,
                           prefix_cache_queries=40, prefix_cache_hits=16)
    text = render(make_registry(_FakeEngine(m, stats), "my-model")).decode()
    assert 'model_name="my-model"' in text
    f = _families(text)
    assert f["pagoda:num_requests_running"][()] == 3 and f["pagoda:num_requests_waiting"][()] == 2
    assert f["pagoda:kv_cache_usage_perc"][()] == 0.5
    assert f["pagoda:num_preemptions_total"][()] == 4
    assert f["pagoda:prefix_cache_queries_total"][()] == 40 and f["pagoda:prefix_cache_hits_total"][()] == 16
    assert f["pagoda:prompt_tokens_total"][()] == 8 and f["pagoda:generation_tokens_total"][()] == 4
    assert f["pagoda:request_success_total"] == {(("finished_reason", "length"),): 1, (("finished_reason", "stop"),): 0}
    assert f["pagoda:request_aborted_total"][()] == 1
    assert f["pagoda:time_to_first_token_seconds_count"][()] == 2
    assert f["pagoda:e2e_request_latency_seconds_bucket"][(("le", "+Inf"),)] == 1
    for name in ("inter_token_latency_seconds", "request_time_per_output_token_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "iteration_tokens_total", "iteration_batch_size"):
        assert f"pagoda:{name}_count" in f, name
    assert f["pagoda:estimated_flops_total"][()] == 30 and f["pagoda:engine_step_seconds_total"][()] == 1.5


def test_spec_decode_counters_are_exported() -> None:
    stats = SchedulerStats(spec_num_drafts=5, spec_num_draft_tokens=15, spec_num_accepted_tokens=9,
                           spec_accepted_per_pos=[5, 3, 1])
    f = _families(render(make_registry(_FakeEngine(None, stats), "m")).decode())
    assert f["pagoda:spec_decode_num_drafts_total"][()] == 5
    assert f["pagoda:spec_decode_num_draft_tokens_total"][()] == 15
    assert f["pagoda:spec_decode_num_accepted_tokens_total"][()] == 9
    assert f["pagoda:spec_decode_num_accepted_tokens_per_pos_total"] == {
        (("position", "0"),): 5, (("position", "1"),): 3, (("position", "2"),): 1,
    }


def test_vllm_names_count_what_vllms_count() -> None:
    """The vllm: aliases: the same values under vLLM's names, every bucket bound of vLLM's
    histograms among ours (a dashboard's le="0.25" selector finds its series), and none for
    iteration_tokens_total, which counts other tokens than vLLM's under that name."""
    m = EngineMetrics(64, 8, 32)
    _run_two_requests(m, [])
    f = _families(render(make_registry(_FakeEngine(m, SchedulerStats()), "m")).decode())
    for name in ("prompt_tokens_total", "generation_tokens_total", "request_success_total",
                 "time_to_first_token_seconds_count", "e2e_request_latency_seconds_sum"):  # fmt: skip
        assert f[f"vllm:{name}"] == f[f"pagoda:{name}"], name
    assert f["vllm:request_success_total"] == {(("finished_reason", "length"),): 1, (("finished_reason", "stop"),): 0}
    assert "pagoda:iteration_tokens_total_count" in f and "vllm:iteration_tokens_total_count" not in f

    def bounds(name: str) -> set[float]:
        return {float(dict(labels)["le"]) for labels in f[f"vllm:{name}_bucket"]}

    phases = ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_inference_time_seconds")  # fmt: skip
    for name, theirs in (("time_to_first_token_seconds", VLLM_TTFT_BUCKETS),
                         *((n, VLLM_REQUEST_LATENCY_BUCKETS) for n in phases),
                         ("inter_token_latency_seconds", VLLM_INTER_TOKEN_BUCKETS),
                         ("request_time_per_output_token_seconds", VLLM_INTER_TOKEN_BUCKETS)):  # fmt: skip
        assert set(theirs) <= bounds(name), name


def test_registries_are_per_app_and_work_without_a_recorder() -> None:
    stats = SchedulerStats(num_running_reqs=1)
    a = render(make_registry(_FakeEngine(None, stats), "a")).decode()
    b = render(make_registry(_FakeEngine(EngineMetrics(64, 8, 32), stats), "b")).decode()
    assert 'model_name="a"' in a and 'model_name="b"' not in a
    assert "pagoda:prompt_tokens_total" not in a and "pagoda:prompt_tokens_total" in b
    assert _families(a)["pagoda:num_requests_running"][()] == 1


def test_dashboard_data_sends_only_new_steps() -> None:
    m = EngineMetrics(64, 8, 32)
    _run_two_requests(m, [])
    engine = _FakeEngine(m, SchedulerStats(num_blocks=8))
    data = dashboard_data(engine, "m")
    assert [s["id"] for s in data["steps"]] == [0, 1, 2]
    assert data["steps"][1]["batch"] == [["a", 1, 0], ["b", 1, 0]]
    assert [s["id"] for s in dashboard_data(engine, "m", since=1)["steps"]] == [2]
    assert data["latency"]["ttft"]["n"] == 0     # observed at t=11..12, long before "now"
    assert data["totals"]["request_aborted"] == 1
    assert dashboard_data(_FakeEngine(None, SchedulerStats()), "m")["steps"] == []


def test_stat_logger_logs_while_busy_and_once_when_idle(caplog: pytest.LogCaptureFixture) -> None:
    m = EngineMetrics(64, 8, 32)
    log = StatLogger(m, interval=10.0)
    caplog.set_level(logging.INFO, logger="pagoda.metrics")
    assert log.maybe_log(0.0) is None            # first call sets the baseline
    m.prompt_tokens, m.generation_tokens = 100, 50
    m.stats = SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25,
                             prefix_cache_queries=100, prefix_cache_hits=25)
    assert log.maybe_log(5.0) is None            # not yet
    line = log.maybe_log(10.0)
    assert line is not None
    assert "Avg prompt throughput: 10.0 tokens/s" in line and "Avg generation throughput: 5.0 tokens/s" in line
    assert "Running: 2 reqs, Waiting: 1 reqs" in line and "KV cache usage: 25.0%" in line
    assert "Prefix cache hit rate: 25.0%" in line
    m.stats = SchedulerStats()
    assert log.maybe_log(20.0) is not None       # the idle line after a busy interval
    assert log.maybe_log(30.0) is None           # then quiet
    assert len([r for r in caplog.records if r.name == "pagoda.metrics"]) == 2
    with pytest.raises(ValueError):
        StatLogger(m, interval=0)


def test_stat_logger_reports_spec_decode_acceptance() -> None:
    m = EngineMetrics(64, 8, 32)
    log = StatLogger(m, interval=10.0)
    log.maybe_log(0.0)
    m.generation_tokens = 50
    m.stats = SchedulerStats(num_running_reqs=1, spec_num_drafts=10, spec_num_draft_tokens=40,
                             spec_num_accepted_tokens=30)
    line = log.maybe_log(10.0)
    assert line is not None and "Spec decode acceptance: 75.0% (4.00 tokens per verification)" in line
    m.generation_tokens = 60
    line = log.maybe_log(20.0)    # no drafts in this interval: no spec part
    assert line is not None and "Spec decode" not in line


def test_request_log_line(caplog: pytest.LogCaptureFixture) -> None:
    import time

    caplog.set_level(logging.INFO, logger="pagoda.metrics")
    log_request(RequestTrace("req-1", "stop", time.monotonic(), 0.01, 0.2, 1.5, 12, 8, 30, 1))
    (rec,) = caplog.records
    msg = rec.getMessage()
    assert msg.startswith("request req-1 finished: reason=stop arrival=")
    assert "queue=0.010s ttft=0.200s e2e=1.500s" in msg
    assert "prompt_tokens=12 cached_tokens=8 generation_tokens=30 preemptions=1" in msg
    log_request(RequestTrace("req-2", "abort", time.monotonic(), None, None, 0.5, 3, 0, 0, 0))
    assert "queue=- ttft=- e2e=0.500s" in caplog.records[-1].getMessage()


def test_moe_expert_load_is_exported_per_layer_and_expert() -> None:
    m = EngineMetrics(64, 8, 32)
    f = _families(render(make_registry(_FakeEngine(m, SchedulerStats()), "m")).decode())
    assert "pagoda:moe_expert_tokens_total" not in f          # a dense model: no such series
    m.on_engine_outputs(EngineCoreOutputs(expert_load=[[3, 1, 0], [0, 2, 2]]), 0.0)
    m.on_engine_outputs(EngineCoreOutputs(), 0.1)             # a message without it keeps the last
    f = _families(render(make_registry(_FakeEngine(m, SchedulerStats()), "m")).decode())
    load = f["pagoda:moe_expert_tokens_total"]
    assert load[(("expert", "0"), ("layer", "0"))] == 3 and load[(("expert", "2"), ("layer", "1"))] == 2
    assert len(load) == 6
