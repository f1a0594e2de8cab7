"""OpenAI-shaped errors: every failure the server reports is ``{"error": {message, type, param, code}}``.

Handlers are routed through one exception type, ``APIError``, so that code deep in
request handling can raise the exact status, param and headers it means, and
FastAPI's own errors (validation, unknown route, wrong method) are rewritten into
the same shape instead of FastAPI's ``{"detail": ...}``.
"""

from __future__ import annotations

from collections.abc import Callable

import json
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

# Pydantic prefixes messages raised from our validators; the prefix tells a client nothing.
_PYDANTIC_PREFIX = re.compile(r"^(Value|Assertion) error, ")


class APIError(Exception):
    """An error response: raise it anywhere while handling a request."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> Response:
        return Response(
            json.dumps(self.body()), status_code=self.status, headers=self.headers, media_type="application/json"
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str = "is not supported") -> APIError:
    return APIError(400, f"'{param}' {what}", param=param, code="unsupported_parameter")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def too_many_requests(message: str, retry_after: float) -> APIError:
    # Retry-After takes whole seconds; round up so a client never retries too early.
    seconds = max(1, int(-(-retry_after // 1)))
    return APIError(
        429, message, type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(seconds)}
    )


def service_unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, type="server_error", code=code)


def internal_error() -> APIError:
    # Never leak a traceback or exception text: that is for the server log.
    return APIError(500, "Internal server error; see the server log.", type="server_error", code="internal_error")


# ---------------------------------------------------------------------- validation errors
def _param_path(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages.[0].content' (OpenAI's spelling)."""
    parts = [f"[{p}]" if isinstance(p, int) else str(p) for p in loc[1:]]
    return ".".join(parts) or None


def validation_error_to_api_error(exc: RequestValidationError) -> APIError:
    """The first problem, in OpenAI's words; one clear message beats a list of pydantic's."""
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request body.")
    err = errors[0]
    kind = err.get("type", "")
    loc = tuple(err.get("loc", ()))
    param = _param_path(loc)
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "invalid JSON")
        return bad_request(f"Could not parse the JSON body of the request: {detail}.", code="invalid_json")
    if loc == ("body",) and isinstance(err.get("input"), (bytes, str)):
        # FastAPI hands over raw bytes when the body is not declared as JSON.
        return bad_request(
            "The request body must be a JSON object sent with 'Content-Type: application/json'.", code="invalid_json"
        )
    if len(loc) <= 1:
        return bad_request(f"The request body must be a JSON object: {err.get('msg', '')}.", code="invalid_json")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    msg = _PYDANTIC_PREFIX.sub("", str(err.get("msg", "invalid value")))
    return bad_request(f"Invalid value for '{param}': {msg}", param=param, code="invalid_value")


# ---------------------------------------------------------------------- handlers
# The other dialects served on the same app (Anthropic's /v1/messages, Ollama's /api/*)
# answer their routes' errors in their own shape: their modules register (path test,
# renderer) here when imported, so this module needs none of them.
_ERROR_SHAPES: list[tuple[Callable[[str], bool], Callable[[APIError], Response]]] = []


def register_error_shape(matches: Callable[[str], bool], render: Callable[[APIError], Response]) -> None:
    _ERROR_SHAPES.append((matches, render))


def error_response(err: APIError, path: str) -> Response:
    """``err`` in the shape of the API that ``path`` belongs to (OpenAI's unless registered)."""
    for matches, render in _ERROR_SHAPES:
        if matches(path):
            return render(err)
    return err.to_response()


async def _api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc, request.url.path)


async def _validation_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(validation_error_to_api_error(exc), request.url.path)


async def _http_exception_handler(request: Request, exc: Exception) -> Response:
    """Routing errors (unknown path, wrong method) and any HTTPException a dependency raises."""
    assert isinstance(exc, StarletteHTTPException)
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        err = APIError(404, f"Invalid URL ({request.method} {request.url.path})", code="not_found")
    elif exc.status_code == 405:
        err = APIError(
            405, f"Method {request.method} is not allowed for {request.url.path}", code="method_not_allowed"
        )
    else:
        err_type = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        err = APIError(exc.status_code, str(exc.detail), type=err_type)
    err.headers.update(headers)
    return error_response(err, request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
