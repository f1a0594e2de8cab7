"""A batch's input lines, read and checked, and one line run through the server's own routes.

An input line (OpenAI's batch format) is ``{"custom_id": ..., "method": "POST", "url":
"/v1/chat/completions", "body": {...}}``; every line of a file must be such an object, with a
custom_id unique in the file and the batch's URL. A line's result is
``{"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id", "body"},
"error": null}``: a 2xx response goes to the batch's output file, any other to its error file,
and a line that never ran (the batch expired first) has ``response`` null and ``error`` set.

A line runs as a request the server makes to itself: an ASGI call into the app, marked in
its scope (which no socket can set) as background work of the batch's tenant. So it gets the
same validation, defaults, tool and reasoning parsing and errors as the same request over
HTTP, and the engine runs it behind live traffic (pagoda/core/scheduler.py).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

from pagoda.entrypoints.openai.batch.files import new_id
from pagoda.entrypoints.openai.serving_engine import BACKGROUND_SCOPE_KEY, TENANT_SCOPE_KEY

# The routes a batch may target (OpenAI's batch endpoints that this server has).
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_REPORTED_ERRORS = 100   # a failed validation reports at most this many of its lines' problems


@dataclass(frozen=True)
class InputLine:
    number: int          # 1-based, as OpenAI's validation errors count lines
    custom_id: str
    url: str
    body: dict[str, Any]


def read_input(data: bytes, endpoint: str | None, max_lines: int) -> tuple[list[InputLine], list[dict[str, Any]]]:
    """The file's lines, or the problems that fail the batch (OpenAI's ``errors.data``:
    ``{code, message, param, line}``; at most MAX_REPORTED_ERRORS of them). ``endpoint``: the
    URL every line must have (None: any of BATCH_ENDPOINTS, line by line, as `pagoda run-batch` takes)."""
    lines: list[InputLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()

    def fail(number: int | None, code: str, message: str, param: str | None = None) -> None:
        if len(errors) < MAX_REPORTED_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": number})

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return [], [{"code": "invalid_file", "message": f"The file is not UTF-8 text ({e.reason} at byte "
                     f"{e.start}).", "param": None, "line": None}]  # fmt: skip
    raw_lines = text.splitlines()
    count = sum(1 for raw in raw_lines if raw.strip())
    if count > max_lines:
        return [], [{"code": "too_many_lines", "message": f"The file has {count} requests; a batch may have at "
                     f"most {max_lines}.", "param": None, "line": None}]  # fmt: skip
    for number, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError as e:
            fail(number, "invalid_json_line", f"This line is not valid JSON: {e.msg}.")
            continue
        if not isinstance(line, dict):
            fail(number, "invalid_json_line", "Each line must be a JSON object.")
            continue
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            fail(number, "missing_required_parameter", "Each line needs a custom_id, a non-empty string.",
                 "custom_id")
            continue
        if custom_id in seen:
            fail(number, "duplicate_custom_id", f"The custom_id {custom_id!r} is used by an earlier line.",
                 "custom_id")
            continue
        seen.add(custom_id)
        if line.get("method") != "POST":
            fail(number, "invalid_method", "The method must be POST.", "method")
            continue
        url = line.get("url")
        if endpoint is not None and url != endpoint:
            fail(number, "mismatched_url", f"The url {url!r} is not the batch's endpoint {endpoint!r}.", "url")
            continue
        if url not in BATCH_ENDPOINTS:
            fail(number, "invalid_url", f"The url {url!r} is not one of {', '.join(BATCH_ENDPOINTS)}.", "url")
            continue
        body = line.get("body")
        if not isinstance(body, dict):
            fail(number, "missing_required_parameter", "Each line needs a body, a JSON object.", "body")
            continue
        extra = sorted(set(line) - {"custom_id", "method", "url", "body"})
        if extra:
            fail(number, "unknown_parameter", f"Unknown field(s) {', '.join(extra)}.", extra[0])
            continue
        lines.append(InputLine(number, custom_id, url, body))
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "The file has no requests.", "param": None, "line": None})
    return lines, errors


async def call_app(app: ASGIApp, path: str, body: bytes, scope: dict[str, Any]) -> tuple[int, bytes]:
    """POST ``body`` to ``path`` of ``app`` in this process: (status, response body). The
    request never disconnects: to stop it, cancel the call (which aborts its engine requests)."""
    full_scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), **scope,
    }  # fmt: skip
    delivered = False
    status = 500
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()   # (forever: nobody disconnects)
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(full_scope, receive, send)
    return status, b"".join(chunks)


async def run_line(app: ASGIApp, line: InputLine, tenant: str | None, background: bool = True) -> dict[str, Any]:
    """The result line of one input line (a non-2xx status is in it, not raised)."""
    if line.body.get("stream"):
        return result_line(line.custom_id, 400, error_body(
            "Streaming is not supported in a batch; remove 'stream' from the request.", "stream"))
    scope: dict[str, Any] = {BACKGROUND_SCOPE_KEY: background}
    if tenant is not None:
        scope[TENANT_SCOPE_KEY] = tenant
    try:
        status, raw = await call_app(app, line.url, json.dumps(line.body).encode(), scope)
        body = json.loads(raw) if raw else None
    except asyncio.CancelledError:
        raise
    except Exception as e:   # a bug: reported on the line, the batch goes on
        status, body = 500, error_body(f"The request failed: {type(e).__name__}: {e}", None, "server_error")
    return result_line(line.custom_id, status, body)


def result_line(custom_id: str, status: int, body: Any) -> dict[str, Any]:
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
    return {
        "id": new_id("batch_req_"), "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id or new_id("req_"), "body": body},
        "error": None,
    }


def error_body(message: str, param: str | None, type_: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}


def is_success(result: dict[str, Any]) -> bool:
    response = result.get("response")
    return response is not None and 200 <= response["status_code"] < 300
