"""OpenTelemetry traces (`pagoda serve --otlp-traces-endpoint URL`): a span per finished request, sent
over OTLP to a collector (Jaeger, Tempo, the OpenTelemetry Collector...).

The span is made when the request ends, from the RequestTrace the metrics hand to their
``on_request_end`` hook (pagoda/metrics/stats.py), beside the request's log line. As in vLLM it is
called ``llm_request``, of kind SERVER, starts at the request's arrival and ends when it finished,
and carries the gen_ai.* attributes vLLM writes (``span_attributes``; the semantic conventions'
current names beside the older ones vLLM uses, so that a dashboard built on either reads them).
An HTTP request carrying a W3C ``traceparent`` header gets its span in the caller's trace, as a
child of the caller's span: the server reads the headers (``trace_headers``), which travel with the
request (GenerateCall.trace_headers, then the metrics' state of the request) to where the span is
made. A request with n > 1 choices runs as n engine requests, and gets a span for each.

Spans are batched (the SDK's BatchSpanProcessor) and exported by its own thread, never on the
event loop; ``shutdown`` (at server shutdown) exports what is still queued.

Which OTLP transport (``otlp_protocol``), in this order:

1. OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL, when set (the
   standard variables): ``grpc`` or ``http/protobuf``;
2. else HTTP/protobuf when the endpoint ends in ``/v1/traces`` (OTLP/HTTP's path for traces);
3. else gRPC.

gRPC takes ``host:port`` (plaintext: a collector's usual OTLP port, where the SDK alone would try
TLS; OTEL_EXPORTER_OTLP_TRACES_INSECURE=false asks for TLS), ``http://host:port`` (plaintext) or
``https://host:port`` (TLS). HTTP/protobuf posts to the endpoint as given when it has a path, else
to its ``/v1/traces`` (``http://`` assumed without a scheme). The other OTEL_EXPORTER_OTLP_*
variables (headers, certificates, timeout, compression) and OTEL_SERVICE_NAME /
OTEL_RESOURCE_ATTRIBUTES work as the SDK documents them; the service is called ``pagoda`` unless
they name it.

The SDK and its exporters are an optional extra (pip install 'pagoda[otel]'), imported only when
a tracer is built: this module's top level imports none of them, so the server's start-up does not
pay for them unless tracing is on.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from pagoda.metrics.stats import RequestTrace

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'pagoda[otel]'"
SPAN_NAME = "llm_request"
GRPC, HTTP_PROTOBUF = "grpc", "http/protobuf"
HTTP_TRACES_PATH = "/v1/traces"
_PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_INSECURE_VARS = ("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE")
# What the extra installs (fastapi alone brings opentelemetry-api, not these).
_SDK_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                "opentelemetry.exporter.otlp.proto.http.trace_exporter")


def trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace context of an incoming request (``traceparent``, and ``tracestate`` with it),
    or None without a traceparent, as for most requests. ``headers``: Starlette's, whose lookups
    ignore case."""
    parent = headers.get("traceparent")
    if not parent:
        return None
    context = {"traceparent": parent}
    state = headers.get("tracestate")
    if state:
        context["tracestate"] = state
    return context


def otlp_protocol(endpoint: str, environ: Mapping[str, str]) -> str:
    """``grpc`` or ``http/protobuf`` for ``endpoint`` (the rule is in the module docstring)."""
    for var in _PROTOCOL_VARS:
        value = environ.get(var, "").strip().lower()
        if value:
            if value not in (GRPC, HTTP_PROTOBUF):
                raise ValueError(f"{var}={value!r}: pagoda exports traces over OTLP {GRPC!r} or {HTTP_PROTOBUF!r}")
            return value
    return HTTP_PROTOBUF if endpoint.rstrip("/").endswith(HTTP_TRACES_PATH) else GRPC


def http_traces_url(endpoint: str) -> str:
    """Where OTLP/HTTP posts: the endpoint as given when it has a path, else its /v1/traces.
    E.g. ``collector:4318`` -> ``http://collector:4318/v1/traces``."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    scheme, _, rest = url.partition("://")
    if "/" not in rest.rstrip("/"):
        return f"{scheme}://{rest.rstrip('/')}{HTTP_TRACES_PATH}"
    return url


def span_attributes(trace: RequestTrace, model: str) -> dict[str, Any]:
    """A finished request's span attributes (gen_ai.*, seconds for latencies). Latencies and
    sampling parameters the request does not have (an aborted request's first token, an
    embedding's sampling) are left out rather than written as zeros."""
    prompt, generated = trace.num_prompt_tokens, trace.num_generation_tokens
    attributes: dict[str, Any] = {
        "gen_ai.request.id": trace.request_id,
        "gen_ai.request.model": model,
        "gen_ai.response.model": model,
        "gen_ai.response.finish_reasons": [trace.finish_reason],
        # The semantic conventions' names, then the older ones vLLM writes.
        "gen_ai.usage.input_tokens": prompt,
        "gen_ai.usage.output_tokens": generated,
        "gen_ai.usage.prompt_tokens": prompt,
        "gen_ai.usage.completion_tokens": generated,
        "gen_ai.usage.cache_read.input_tokens": trace.num_cached_tokens,
        "gen_ai.latency.e2e": trace.e2e,
    }
    latencies = {
        "gen_ai.latency.time_in_queue": trace.queue_time,
        "gen_ai.latency.time_to_first_token": trace.ttft,
        "gen_ai.latency.time_in_model_prefill": trace.prefill_time,
        "gen_ai.latency.time_in_model_decode": trace.decode_time,
    }
    if trace.prefill_time is not None and trace.decode_time is not None:
        latencies["gen_ai.latency.time_in_model_inference"] = trace.prefill_time + trace.decode_time
    attributes.update((k, v) for k, v in latencies.items() if v is not None)
    params = trace.sampling_params
    if params is not None:
        attributes["gen_ai.request.temperature"] = params.temperature
        attributes["gen_ai.request.top_p"] = params.top_p
        attributes["gen_ai.request.n"] = params.n
        if params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if params.top_k > 0:
            attributes["gen_ai.request.top_k"] = params.top_k
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
    return attributes


def _import_sdk() -> None:
    """Raise ValueError, with the install hint, when the SDK or an OTLP exporter is missing."""
    try:
        for module in _SDK_MODULES:
            importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP exporters, which are "
                         f"not installed ({e}): {INSTALL_HINT}") from None


def _exporter(endpoint: str, protocol: str, environ: Mapping[str, str]) -> SpanExporter:
    if protocol == HTTP_PROTOBUF:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

        return HTTPExporter(endpoint=http_traces_url(endpoint))
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GRPCExporter

    # The SDK reads a scheme-less host:port as TLS unless an INSECURE variable says otherwise;
    # pagoda reads it as the plaintext port most collectors open (vLLM's users set INSECURE for it).
    plaintext = "://" not in endpoint and not any(environ.get(var) for var in _INSECURE_VARS)
    return GRPCExporter(endpoint=endpoint, insecure=True if plaintext else None)


class RequestTracer:
    """Makes each finished request's span (``record``, the metrics' request-end hook) and exports
    the spans in batches to ``endpoint``. One tracer serves every data-parallel replica."""

    def __init__(self, endpoint: str, served_model_name: str, *, environ: Mapping[str, str] | None = None,
                 exporter: SpanExporter | None = None) -> None:
        """``environ``: where the OTEL_* variables are read (default: the process's);
        ``exporter``: export there instead of over OTLP (tests)."""
        if not endpoint:
            raise ValueError("--otlp-traces-endpoint needs a collector's address (host:port or a URL)")
        _import_sdk()
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        environ = os.environ if environ is None else environ
        self.endpoint = endpoint
        self.protocol = otlp_protocol(endpoint, environ)
        self.model = served_model_name
        if exporter is None:
            exporter = _exporter(endpoint, self.protocol, environ)
        # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; without either
        # the SDK says "unknown_service".
        resource = Resource.create()
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "pagoda"}))
        # A provider of our own, not the process-wide one: nothing else in the process is traced
        # through it, and two servers in one process (tests) keep their spans apart.
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("pagoda")
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind = SpanKind.SERVER
        self._failed = False
        logger.info("tracing: a span per finished request to %s over OTLP %s", endpoint, self.protocol)

    def record(self, trace: RequestTrace) -> None:
        """The span of one finished request, queued for export. Runs on the event loop as the
        request ends: it only builds the span; a failure is logged (once) and never reaches the
        request."""
        try:
            # RequestTrace's times are time.monotonic(); spans take wall-clock nanoseconds.
            offset_ns = time.time_ns() - time.monotonic_ns()
            start = round(trace.arrival_time * 1e9) + offset_ns
            # Always an explicit context, empty without a traceparent: this runs in the engine's
            # output task, whose ambient context (the request that started it) is no parent.
            context = self._propagator.extract(trace.trace_headers or {})
            span = self._tracer.start_span(SPAN_NAME, context=context, kind=self._server_kind, start_time=start,
                                           attributes=span_attributes(trace, self.model))  # fmt: skip
            span.end(end_time=start + round(trace.e2e * 1e9))
        except Exception:  # noqa: BLE001 - tracing must not fail the request loop
            if not self._failed:
                self._failed = True
                logger.exception("tracing: could not make the span of request %s (later failures not logged)",
                                 trace.request_id)

    def shutdown(self) -> None:
        """Export the spans still queued, then stop the exporter (bounded by the SDK's 30 s)."""
        self._provider.shutdown()
