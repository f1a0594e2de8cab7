"""OpenTelemetry traces (pagoda/metrics/tracing.py): which OTLP transport an endpoint gets, the
trace context read from HTTP headers, what the metrics hand on when a request ends, the span
made of it (an in-memory exporter stands for the collector; tests/e2e/test_tracing.py has the
real ones), and `pagoda serve --otlp-traces-endpoint` refused, with the install hint, without
the SDK."""

from __future__ import annotations

import sys
import time

import pytest

from pagoda.core.outputs import EngineCoreOutput, SchedulerStats
from pagoda.engine.messages import EngineCoreOutputs
from pagoda.engine.output_processor import OutputProcessor
from pagoda.metrics.stats import EngineMetrics, RequestTrace
from pagoda.metrics.tracing import (
    GRPC,
    HTTP_PROTOBUF,
    INSTALL_HINT,
    http_traces_url,
    otlp_protocol,
    span_attributes,
    trace_headers,
)
from pagoda.sampling_params import SamplingParams

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


@pytest.mark.parametrize("endpoint, environ, expected", [
    ("127.0.0.1:4317", {}, GRPC),
    ("http://collector:4317", {}, GRPC),
    ("https://collector:4317/", {}, GRPC),
    ("http://collector:4318/v1/traces", {}, HTTP_PROTOBUF),
    ("collector:4318/v1/traces/", {}, HTTP_PROTOBUF),
    # The standard variables win over the endpoint's path, the traces' one over the general one.
    ("http://collector:4318", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, HTTP_PROTOBUF),
    ("http://collector:4318/v1/traces", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, GRPC),
    ("c:1", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": " HTTP/protobuf"},
     HTTP_PROTOBUF),
])  # fmt: skip
def test_the_transport_follows_the_variables_then_the_path(endpoint, environ, expected):
    assert otlp_protocol(endpoint, environ) == expected


def test_an_unsupported_protocol_is_refused_by_name():
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'"):
        otlp_protocol("c:4318", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})


@pytest.mark.parametrize("endpoint, url", [
    ("collector:4318", "http://collector:4318/v1/traces"),
    ("http://collector:4318/", "http://collector:4318/v1/traces"),
    ("https://collector:4318", "https://collector:4318/v1/traces"),
    ("http://collector:4318/v1/traces", "http://collector:4318/v1/traces"),
    ("https://gateway/custom/otlp", "https://gateway/custom/otlp"),   # a path given is kept
])  # fmt: skip
def test_http_posts_to_the_traces_path_unless_one_is_given(endpoint, url):
    assert http_traces_url(endpoint) == url


def test_trace_headers_are_the_w3c_ones_and_only_with_a_traceparent():
    from starlette.datastructures import Headers

    headers = Headers({"TraceParent": TRACEPARENT, "tracestate": "vendor=1", "x-other": "no"})
    assert trace_headers(headers) == {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}
    assert trace_headers(Headers({"traceparent": TRACEPARENT})) == {"traceparent": TRACEPARENT}
    assert trace_headers(Headers({"tracestate": "vendor=1"})) is None
    assert trace_headers(Headers({})) is None


def _finished_request(params: SamplingParams | None, headers: dict[str, str] | None) -> RequestTrace:
    """Request r: arrives at 10.0, scheduled at 10.5 (engine clock), tokens at engine 11.0 and
    12.0 (received 0.1 later), ends by length; the metrics' request-end hook gives its trace."""
    traces: list[RequestTrace] = []
    metrics = EngineMetrics(64, 8, 32, on_request_end=traces.append)
    processor = OutputProcessor(None)
    processor.add_request("r", None, [1, 2, 3, 4, 5], params or SamplingParams(max_tokens=2))
    metrics.add_request("r", 10.0, 5, sampling_params=params, trace_headers=headers)
    for ts, out in ((11.0, EngineCoreOutput("r", [7], scheduled_time=10.5, num_cached_tokens=4)),
                    (12.0, EngineCoreOutput("r", [8], finish_reason="length"))):
        msg = EngineCoreOutputs(outputs=[out], scheduler_stats=SchedulerStats(), timestamp=ts)
        metrics.on_engine_outputs(msg, ts + 0.1)
        metrics.on_request_outputs(processor.process_outputs(msg.outputs)[0], ts + 0.1)
    (trace,) = traces
    return trace


def test_the_request_end_hands_on_the_phases_the_params_and_the_trace_context():
    params = SamplingParams(max_tokens=2, temperature=0.5, top_p=0.9, top_k=40, n=1, seed=3)
    trace = _finished_request(params, {"traceparent": TRACEPARENT})
    assert trace.sampling_params is params and trace.trace_headers == {"traceparent": TRACEPARENT}
    assert trace.queue_time == pytest.approx(0.5) and trace.ttft == pytest.approx(1.1)
    assert trace.prefill_time == pytest.approx(0.5) and trace.decode_time == pytest.approx(1.0)
    assert trace.e2e == pytest.approx(2.1)
    attrs = span_attributes(trace, "m")
    assert attrs.pop("gen_ai.response.finish_reasons") == ["length"]
    assert attrs == pytest.approx({
        "gen_ai.request.id": "r", "gen_ai.request.model": "m", "gen_ai.response.model": "m",
        "gen_ai.usage.input_tokens": 5, "gen_ai.usage.prompt_tokens": 5,
        "gen_ai.usage.output_tokens": 2, "gen_ai.usage.completion_tokens": 2,
        "gen_ai.usage.cache_read.input_tokens": 4,
        "gen_ai.latency.e2e": 2.1, "gen_ai.latency.time_in_queue": 0.5, "gen_ai.latency.time_to_first_token": 1.1,
        "gen_ai.latency.time_in_model_prefill": 0.5, "gen_ai.latency.time_in_model_decode": 1.0,
        "gen_ai.latency.time_in_model_inference": 1.5,
        "gen_ai.request.max_tokens": 2, "gen_ai.request.temperature": 0.5, "gen_ai.request.top_p": 0.9,
        "gen_ai.request.top_k": 40, "gen_ai.request.n": 1, "gen_ai.request.seed": 3,
    })  # fmt: skip


def test_what_a_request_never_had_is_left_out():
    traces: list[RequestTrace] = []
    metrics = EngineMetrics(64, 8, 32, on_request_end=traces.append)
    metrics.add_request("q", 1.0, 3)             # no params (an embedding), aborted while queued
    metrics.on_abort(["q"], 2.0)
    attrs = span_attributes(traces[0], "m")
    assert not [k for k in attrs if k.startswith(("gen_ai.request.", "gen_ai.latency.time"))
                and k not in ("gen_ai.request.id", "gen_ai.request.model")]  # fmt: skip
    assert attrs["gen_ai.usage.output_tokens"] == 0 and attrs["gen_ai.latency.e2e"] == pytest.approx(1.0)


# ---- the span, through the SDK ------------------------------------------------------------------------

def _tracer(exporter, **environ):
    from pagoda.metrics.tracing import RequestTracer

    return RequestTracer("127.0.0.1:4317", "served-model", environ=environ, exporter=exporter)


def test_a_span_per_request_in_the_callers_trace_from_arrival_to_finish():
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    exporter = InMemorySpanExporter()
    tracer = _tracer(exporter)
    now = time.monotonic()
    child = RequestTrace("a", "stop", now - 2.0, 0.25, 0.5, 1.5, 5, 0, 3, 0,
                         trace_headers={"traceparent": TRACEPARENT, "tracestate": "k=v"})  # fmt: skip
    root = RequestTrace("b", "length", now - 1.0, None, None, 0.5, 2, 0, 0, 0)
    wall_before = time.time_ns()
    tracer.record(child)
    tracer.record(root)
    tracer.shutdown()          # exports the batch
    spans = {s.attributes["gen_ai.request.id"]: s for s in exporter.get_finished_spans()}
    a, b = spans["a"], spans["b"]
    assert a.name == b.name == "llm_request" and a.kind == b.kind == SpanKind.SERVER
    assert format(a.context.trace_id, "032x") == TRACE_ID and format(a.parent.span_id, "016x") == PARENT_SPAN_ID
    assert a.parent.is_remote and a.context.trace_state.to_header() == "k=v"
    assert b.parent is None and b.context.trace_id != a.context.trace_id
    # Wall-clock times: arrival 2 s before now, e2e 1.5 s.
    assert abs(a.start_time - (wall_before - 2_000_000_000)) < 50_000_000
    assert a.end_time - a.start_time == pytest.approx(1_500_000_000, abs=1000)
    assert a.attributes["gen_ai.response.model"] == "served-model"
    assert tuple(a.attributes["gen_ai.response.finish_reasons"]) == ("stop",)
    assert a.resource.attributes["service.name"] == "pagoda"


def test_a_bad_traceparent_makes_a_root_span_and_a_failure_never_reaches_the_request(caplog):
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracer = _tracer(exporter)
    tracer.record(RequestTrace("a", "stop", time.monotonic(), 0.0, 0.1, 0.2, 1, 0, 1, 0,
                               trace_headers={"traceparent": "00-not-a-trace-id-01"}))  # fmt: skip
    bad = RequestTrace("b", "stop", time.monotonic(), 0.0, 0.1, 0.2, 1, 0, 1, 0)
    bad.e2e = "not a number"  # type: ignore[assignment]
    tracer.record(bad)         # logged, not raised
    tracer.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.parent is None
    assert "could not make the span of request b" in caplog.text


def test_a_request_without_traceparent_is_a_root_whatever_span_is_current():
    """The span is made in the engine's output task, whose context may hold another request's span."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry import trace as otel_trace
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracer = _tracer(exporter)
    ambient = otel_trace.NonRecordingSpan(otel_trace.SpanContext(trace_id=1, span_id=2, is_remote=False))
    with otel_trace.use_span(ambient):
        tracer.record(RequestTrace("a", "stop", time.monotonic(), 0.0, 0.1, 0.2, 1, 0, 1, 0))
    tracer.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and span.context.trace_id != 1


def test_the_service_name_from_the_environment_wins(monkeypatch):
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-gateway")
    exporter = InMemorySpanExporter()
    tracer = _tracer(exporter)
    tracer.record(RequestTrace("a", "stop", time.monotonic(), 0.0, 0.1, 0.2, 1, 0, 1, 0))
    tracer.shutdown()
    assert exporter.get_finished_spans()[0].resource.attributes["service.name"] == "llm-gateway"


def test_the_exporters_follow_the_rule():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GRPCExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

    from pagoda.metrics.tracing import _exporter

    plain = _exporter("127.0.0.1:4317", GRPC, {})
    assert isinstance(plain, GRPCExporter) and plain._insecure   # host:port: plaintext
    assert not _exporter("127.0.0.1:4317", GRPC, {"OTEL_EXPORTER_OTLP_TRACES_INSECURE": "false"})._insecure
    assert not _exporter("https://collector:4317", GRPC, {})._insecure
    http = _exporter("127.0.0.1:4318", HTTP_PROTOBUF, {})
    assert isinstance(http, HTTPExporter) and http._endpoint == "http://127.0.0.1:4318/v1/traces"
    for exporter in (plain, http):
        exporter.shutdown()


# ---- without the extra ---------------------------------------------------------------------------------

@pytest.fixture
def without_the_sdk(monkeypatch):
    """As if `pip install 'pagoda[otel]'` had not run: importing the SDK fails."""
    for name in list(sys.modules):
        if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk", None)   # None: ImportError on import


def test_without_the_sdk_the_tracer_is_refused_with_the_install_hint(without_the_sdk):
    from pagoda.metrics.tracing import RequestTracer

    with pytest.raises(ValueError, match=r"OpenTelemetry SDK.*pip install 'pagoda\[otel\]'"):
        RequestTracer("127.0.0.1:4317", "m")


def test_without_the_sdk_pagoda_serve_refuses_the_flag_before_starting(without_the_sdk, monkeypatch, capsys):
    from pagoda.engine import core_proc
    from pagoda.entrypoints.cli import main

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine core was started")

    monkeypatch.setattr(core_proc, "start_core_process", no_engine)
    assert main(["serve", "--otlp-traces-endpoint", "127.0.0.1:4317"]) == 2
    err = capsys.readouterr().err
    assert "--otlp-traces-endpoint" in err and INSTALL_HINT in err


def test_several_models_refuse_tracing():
    from pagoda.config import EngineConfig
    from pagoda.entrypoints.cli import build_parser
    from pagoda.entrypoints.openai.launch import _check_multi_model

    args = build_parser(with_bench_commands=False).parse_args(
        ["serve", "--models-dir", "/tmp", "--otlp-traces-endpoint", "127.0.0.1:4317"])
    with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
        _check_multi_model(args, EngineConfig())
