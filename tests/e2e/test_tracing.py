"""OpenTelemetry traces end to end (#51): `pagoda serve --otlp-traces-endpoint` sends a span per
finished request to a local OTLP receiver, over gRPC (grpcio serving opentelemetry-proto's
TraceService) and over HTTP/protobuf (http.server decoding ExportTraceServiceRequest). One request
carries a W3C traceparent and gets its span in that trace; the other, streamed, gets a root span.
The batch processor is set to wait a minute, so the spans reach the receiver only through the
flush at shutdown (SIGTERM): none is lost when the server stops."""

from __future__ import annotations

import gzip
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra (pip install 'pagoda[otel]') is not installed")
grpc = pytest.importorskip("grpc")

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402
from opentelemetry.proto.common.v1.common_pb2 import AnyValue  # noqa: E402
from opentelemetry.proto.trace.v1.trace_pb2 import Span  # noqa: E402

from tests.e2e.server_utils import serve_process  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


class _Received:
    """The spans a receiver got, with their resource's attributes."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], Span]] = []
        self.lock = threading.Lock()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((resource, span) for span in scope_spans.spans)


class _GRPCReceiver(_Received):
    def __enter__(self) -> str:
        received = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the service's method name
                received.add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        return f"127.0.0.1:{port}"   # a plain host:port: gRPC, plaintext

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0)


class _HTTPReceiver(_Received):
    def __enter__(self) -> str:
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(404)
                    return
                received.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"   # the path: HTTP/protobuf

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("receiver, extra_args", [
    pytest.param(_GRPCReceiver, [], id="grpc"),
    pytest.param(_HTTPReceiver, [], id="http"),
    # One tracer for both replicas (slow: a second engine process; CI time).
    pytest.param(_HTTPReceiver, ["--data-parallel-size", "2"], id="http-dp2", marks=pytest.mark.slow),
])  # fmt: skip
def test_a_span_per_request_reaches_the_collector(receiver, extra_args):
    import openai

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PAGODA_"))}
    env.update(PYTHONPATH=str(REPO), OTEL_BSP_SCHEDULE_DELAY="60000")   # exported only at shutdown
    collector = receiver()
    with collector as endpoint:
        args = ["--num-kv-blocks", "32", "--max-model-len", "512", "--otlp-traces-endpoint", endpoint, *extra_args]
        with serve_process(args, env, timeout=120) as (_, base), \
                openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60) as client:
            started = time.time_ns()
            chat = client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Name a color."}],
                max_tokens=5, temperature=0.7, top_p=0.9, seed=1,
                extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01", "tracestate": "shop=1"},
            )  # fmt: skip
            chunks = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time",
                                                    max_tokens=3, temperature=0, stream=True,
                                                    stream_options={"include_usage": True}))  # fmt: skip
            ended = time.time_ns()
            assert not collector.spans   # still batched: the batch processor waits a minute
        # SIGTERM: the server drained, shut the engine down, and flushed the batch on the way out.
    spans = {_value(next(a.value for a in s.attributes if a.key == "gen_ai.request.id")): (res, s)
             for res, s in collector.spans}  # fmt: skip
    completion_usage = chunks[-1].usage
    assert set(spans) == {chat.id, chunks[0].id}
    for response_id, usage, finish, params in (
        (chat.id, chat.usage, chat.choices[0].finish_reason, {"max_tokens": 5, "temperature": 0.7, "top_p": 0.9}),
        (chunks[0].id, completion_usage, next(c.choices[0].finish_reason for c in chunks
                                              if c.choices and c.choices[0].finish_reason),
         {"max_tokens": 3, "temperature": 0.0, "top_p": 1.0}),
    ):  # fmt: skip
        resource, span = spans[response_id]
        attrs = {a.key: _value(a.value) for a in span.attributes}
        assert span.name == "llm_request" and span.kind == Span.SpanKind.SPAN_KIND_SERVER
        assert resource["service.name"] == "pagoda"
        assert attrs["gen_ai.response.model"] == attrs["gen_ai.request.model"] == "SmolLM2-135M-Instruct"
        assert attrs["gen_ai.usage.prompt_tokens"] == attrs["gen_ai.usage.input_tokens"] == usage.prompt_tokens
        assert attrs["gen_ai.usage.completion_tokens"] == attrs["gen_ai.usage.output_tokens"] \
            == usage.completion_tokens
        assert attrs["gen_ai.response.finish_reasons"] == [finish]
        assert attrs["gen_ai.request.n"] == 1
        assert {k: attrs[f"gen_ai.request.{k}"] for k in params} == pytest.approx(params)
        queue, ttft, e2e = (attrs[f"gen_ai.latency.{k}"] for k in ("time_in_queue", "time_to_first_token", "e2e"))
        assert 0 <= queue <= ttft <= e2e
        prefill, decode = attrs["gen_ai.latency.time_in_model_prefill"], attrs["gen_ai.latency.time_in_model_decode"]
        assert prefill >= 0 and decode >= 0 and prefill + decode <= e2e
        # From the request's arrival to its finish, on the wall clock.
        assert started <= span.start_time_unix_nano <= span.end_time_unix_nano <= ended
        assert span.end_time_unix_nano - span.start_time_unix_nano == pytest.approx(e2e * 1e9, abs=1e4)
    traced, plain = spans[chat.id][1], spans[chunks[0].id][1]
    assert traced.trace_id.hex() == TRACE_ID and traced.parent_span_id.hex() == PARENT_SPAN_ID
    assert traced.trace_state == "shop=1"
    assert plain.parent_span_id == b"" and plain.trace_id.hex() != TRACE_ID
