"""OpenAI-compatible HTTP API: ``build_app(engine, served_model_name, ...)`` and ``serve(...)``."""

from __future__ import annotations

from pagoda.entrypoints.openai.api_server import DEFAULT_MAX_BODY_BYTES, build_app
from pagoda.entrypoints.openai.server import PagodaServer, create_server, serve

__all__ = ["DEFAULT_MAX_BODY_BYTES", "PagodaServer", "build_app", "create_server", "serve"]
