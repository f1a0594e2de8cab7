"""Anthropic's Messages API on the same server: POST /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from pagoda.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagoda.entrypoints.anthropic.responses import (
    AnthropicErrorResponse,
    CountTokensResponse,
    MessageOut,
)
from pagoda.entrypoints.anthropic.serving import MessagesServing
from pagoda.entrypoints.openai.serving_chat import ChatServing

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": AnthropicErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503, 504)
}


def add_messages_routes(app: FastAPI, chat: ChatServing) -> None:
    """The Messages routes, over the chat completions serving (its template, parsers and engine)."""
    messages = MessagesServing(chat)

    @app.post("/v1/messages", responses={200: {"model": MessageOut}, **_ERRORS})
    async def create_message(body: MessagesRequest, raw_request: Request) -> Response:
        return await messages.create(body, raw_request)

    @app.post("/v1/messages/count_tokens", response_model=CountTokensResponse, responses=_ERRORS)
    async def count_message_tokens(body: CountTokensRequest) -> CountTokensResponse:
        return await messages.count_tokens(body)


__all__ = ["add_messages_routes"]
