"""OpenAI-compatible HTTP API: ``build_app(engine, ServerConfig(...))`` and ``serve(engine, config)``."""

from __future__ import annotations

from pagoda.lazy import lazy_exports

__all__ = ["DEFAULT_MAX_BODY_BYTES", "PagodaServer", "ServerConfig", "build_app", "create_server", "serve"]

# The CLI reads the tool parsers' names from this package before it starts the engine core.
__getattr__ = lazy_exports(__name__, {
    "DEFAULT_MAX_BODY_BYTES": "api_server", "ServerConfig": "api_server", "build_app": "api_server",
    "PagodaServer": "server", "create_server": "server", "serve": "server",
})
