"""Errors in Anthropic's shape for the Messages routes: ``{"type": "error", "error": {"type", "message"}}``.

Request handling raises the server's one exception type, ``APIError`` (status, message,
headers); only the body differs per dialect, so the error type here follows from the
status as Anthropic assigns them, and the anthropic SDK raises its typed exceptions
(BadRequestError, AuthenticationError, NotFoundError, ...) from the status.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

from pagoda.entrypoints.openai.errors import APIError, register_error_shape

MESSAGES_PATH = "/v1/messages"

_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
    504: "timeout_error", 529: "overloaded_error",
}  # fmt: skip


def is_anthropic_path(path: str) -> bool:
    """/v1/messages and the routes under it (count_tokens) answer in Anthropic's shape."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(err: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}


def error_response(err: APIError) -> Response:
    return Response(json.dumps(error_body(err)), status_code=err.status, headers=err.headers,
                    media_type="application/json")  # fmt: skip


def error_event(err: APIError) -> str:
    """An error after the stream's 200 went out: Anthropic's ``error`` event."""
    return f"event: error\ndata: {json.dumps(error_body(err))}\n\n"


register_error_shape(is_anthropic_path, error_response)
