"""The OpenAI-compatible HTTP server: ``build_app`` (routes) and ``serve`` (uvicorn, graceful shutdown)."""

from __future__ import annotations

from dataclasses import dataclass

import hmac
import re
import logging
import time
from importlib import resources
from collections.abc import Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import pagoda
from pagoda.engine.client import EngineClient, LoRAExistsError, LoRANotFoundError
from pagoda.entrypoints.anthropic import add_messages_routes
from pagoda.entrypoints.ollama import add_ollama_routes
from pagoda.entrypoints.ollama.responses import is_ollama_path
from pagoda.entrypoints.openai.errors import (
    APIError,
    bad_request,
    error_response,
    install_error_handlers,
    internal_error,
    service_unavailable,
)
from pagoda.entrypoints.openai.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from pagoda.entrypoints.openai.request_group import ServerState
from pagoda.entrypoints.openai.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ServerLoadResponse,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from pagoda.entrypoints.openai.embedding_protocol import EmbeddingRequest, EmbeddingResponse
from pagoda.entrypoints.openai.responses_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, ResponseStore
from pagoda.entrypoints.openai.serving_chat import ChatServing
from pagoda.entrypoints.openai.serving_chat_batch import create_batch
from pagoda.entrypoints.openai.serving_completion import CompletionServing
from pagoda.entrypoints.openai.serving_classify import ClassificationResponse, ClassifyRequest
from pagoda.entrypoints.openai.serving_embedding import EmbeddingServing
from pagoda.entrypoints.openai.serving_score import (
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    ScoreServing,
)
from pagoda.entrypoints.openai.batch import (
    DEFAULT_BATCH_MAX_CONCURRENCY,
    DEFAULT_BATCH_MAX_LINES,
    DEFAULT_FILE_MAX_BYTES,
)
from pagoda.entrypoints.openai.batch.files import FileStore
from pagoda.entrypoints.openai.batch.routes import add_batch_routes
from pagoda.entrypoints.openai.batch.service import BatchService
from pagoda.entrypoints.openai.serving_engine import BACKGROUND_SCOPE_KEY, TENANT_SCOPE_KEY
from pagoda.entrypoints.openai.serving_responses import ResponsesServing, add_responses_routes
from pagoda.entrypoints.openai.tools import plan_tools
from pagoda.hub.stores import NO_DEFAULTS, ModelDefaults
from pagoda.reasoning import get_reasoning_parser
from pagoda.entrypoints.openai.vllm_compat import (
    LORA_PATH_REFUSED,
    LoRAPathPolicy,
    engine_load,
    load_metrics_format,
    model_root,
    orca_load_header,
    parse_body,
    tokenizer_config,
)
from pagoda.tenants import TenantSpec, tenants_of
from pagoda.metrics.dashboard import dashboard_data
from pagoda.metrics.prometheus import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pagoda.metrics.prometheus import make_registry
from pagoda.metrics.prometheus import render as render_metrics

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 << 20
_UPLOAD_OVERHEAD = 1 << 20   # room for a multipart body's other fields around an upload

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 429, 500, 503)
}


# ---------------------------------------------------------------------- middleware
class ServerMiddleware:
    """Everything checked before routing, as plain ASGI so it also covers streaming responses:

    - while draining for shutdown, new requests get 503;
    - auth on /v1/*, /invocations and Ollama's /api/* when an API key is set (/health and
      friends stay open to probes): the key as a Bearer token, or in ``x-api-key`` as the
      anthropic SDK sends it; errors in the shape of the route's dialect (``error_response``);
    - the body limit, from Content-Length and again while reading (chunked bodies have none).
      The body is buffered here (it is small) and replayed to the app, after which the app's
      receive() yields only the disconnect, which is how handlers notice a client leaving;
    - a 500 in OpenAI's shape for an unexpected exception (logged with its traceback);
    - counting requests in progress, which graceful shutdown waits on;
    - ORCA's load report: a request with ``endpoint-load-metrics-format: text|json`` gets the
      engine's load in an ``endpoint-load-metrics`` response header.
    """

    def __init__(self, app: ASGIApp, state: ServerState, api_key: str | None, max_body_bytes: int,
                 protect_internal: bool = False, api_keys: dict[str, TenantSpec] | None = None,
                 load_report: Callable[[], dict[str, float]] | None = None, max_upload_bytes: int | None = None) -> None:
        self.app = app
        # POST /v1/files takes bodies up to this size instead (the Files API's uploads; None: off).
        self.max_upload_bytes = max_upload_bytes
        # The engine's load, for ORCA's endpoint-load-metrics response header.
        self.load_report = load_report
        # Tenants' keys (--api-keys-file); with them, a key is required and names the tenant.
        self.api_keys = api_keys or None
        self.state = state
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        # Also require the key on the operator endpoints (/metrics, /dashboard, /debug).
        self.protect_internal = protect_internal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get(BACKGROUND_SCOPE_KEY):
            # (A batch's line: a request the server makes to itself, never one from a socket.)
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if self.state.draining:
            draining = service_unavailable("The server is shutting down.", "server_shutting_down")
            draining.headers["Connection"] = "close"
            await error_response(draining, scope["path"])(scope, receive, send)
            return
        auth = self.api_key is not None or self.api_keys is not None
        # /invocations generates as /v1/* does, so it needs the key too (vLLM leaves it open).
        if auth and (path == "/v1" or path.startswith("/v1/") or path == "/invocations" or is_ollama_path(path) or (
            self.protect_internal and path.startswith(_INTERNAL_PREFIXES)
        )):
            denied = self._check_auth(scope, self.api_key, self.api_keys)
            if denied is not None:
                await error_response(denied, scope["path"])(scope, receive, send)
                return
        tenant_or_error = self._tenant(scope)
        if isinstance(tenant_or_error, APIError):
            await error_response(tenant_or_error, scope["path"])(scope, receive, send)
            return
        if tenant_or_error is not None:
            scope[TENANT_SCOPE_KEY] = tenant_or_error
        body_or_error = await self._read_body(scope, receive)
        if isinstance(body_or_error, APIError):
            await error_response(body_or_error, scope["path"])(scope, receive, send)
            return
        if body_or_error is None:
            return  # the client left while sending the body

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body_or_error, "more_body": False}
            return await receive()

        started = False
        load_format = load_metrics_format(dict(scope["headers"]))

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if load_format is not None and self.load_report is not None:
                    header = orca_load_header(load_format, self.load_report())
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"endpoint-load-metrics", header.encode("latin-1"))]}
            await send(message)

        self.state.num_active_http += 1
        try:
            await self.app(scope, replay, tracking_send)
        except Exception:
            if started:
                raise  # too late for an error response; uvicorn drops the connection
            logger.exception("unhandled error in %s %s", scope.get("method"), path)
            await error_response(internal_error(), scope["path"])(scope, receive, send)
        finally:
            self.state.num_active_http -= 1

    def _tenant(self, scope: Scope) -> str | APIError | None:
        """With --api-keys-file, the key's tenant; else the X-Tenant header, if any (the
        header is trusted: without per-tenant keys, whoever may call the API may name one)."""
        headers = dict(scope["headers"])
        if self.api_keys is not None:
            spec = self.api_keys.get(_presented_key(headers))
            return spec.name if spec is not None else None
        raw = headers.get(b"x-tenant")
        if raw is None:
            return None
        name = raw.decode("latin-1").strip()
        if not _TENANT_NAME.fullmatch(name):
            return bad_request("Invalid X-Tenant header: 1-64 characters of letters, digits and . _ - @ :",
                               param="X-Tenant")  # fmt: skip
        return name

    @staticmethod
    def _check_auth(scope: Scope, api_key: str | None,
                    api_keys: dict[str, TenantSpec] | None = None) -> APIError | None:  # fmt: skip
        headers = dict(scope["headers"])
        header = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if not header and b"x-api-key" in headers:
            header, scheme, token = "x-api-key", "bearer", _presented_key(headers)
        if not header:
            message = "No API key provided; send it as 'Authorization: Bearer <key>' (or in 'x-api-key')."
        elif scheme.lower() != "bearer":
            message = "Incorrect API key provided."
        elif api_key is not None and hmac.compare_digest(token.encode(), api_key.encode()):
            return None
        elif api_keys is not None and any(hmac.compare_digest(token.encode(), k.encode()) for k in api_keys):
            return None
        else:
            message = "Incorrect API key provided."
        return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | APIError | None:
        limit = self.max_body_bytes
        if self.max_upload_bytes is not None and scope["path"] == "/v1/files" and scope["method"] == "POST":
            limit = max(limit, self.max_upload_bytes)
        too_large = APIError(
            413, f"The request body is larger than the limit of {limit} bytes.",
            code="request_too_large", headers={"Connection": "close"},
        )  # fmt: skip
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return bad_request("Invalid Content-Length header.")
            if declared > limit:
                return too_large
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


_INTERNAL_PREFIXES = ("/metrics", "/dashboard", "/debug")
_TENANT_NAME = re.compile(r"[A-Za-z0-9._@:-]{1,64}")


def _presented_key(headers: dict[bytes, bytes]) -> str:
    """The API key of a request: the Bearer token, else the ``x-api-key`` header (Anthropic's)."""
    if b"authorization" not in headers:
        return headers.get(b"x-api-key", b"").decode("latin-1").strip()
    scheme, _, token = headers[b"authorization"].decode("latin-1").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


# ---------------------------------------------------------------------- the app
@dataclass(frozen=True)
class ServerConfig:
    """What `pagoda serve` sets for the HTTP server (build_app, create_server, serve).

    ``api_key``: required as a Bearer token on /v1/* and on Ollama's /api/*.
    ``max_num_queued_requests``: at most this many requests may wait for their first token (the rest get 429). ``request_timeout``: seconds after
    which a generation request is aborted (504). ``max_body_bytes``: larger bodies get 413.
    ``tool_call_parser``: the format tool calls are read in (tool_parsers.TOOL_PARSERS).
    ``reasoning_parser``: how reasoning is told apart from the answer (pagoda.reasoning.REASONING_PARSERS);
    None: the output is all content.
    ``enable_debug_endpoints``: add POST /debug/check_integrity (internal; off by default).
    ``api_key_on_internal_endpoints``: require the API key on /metrics, /dashboard and /debug too.
    ``api_keys``: API key -> tenant (--api-keys-file); any of them is accepted, and names the
    request's tenant (fair scheduling, per-tenant max_queued and metrics). ``shutdown_timeout``:
    seconds a SIGTERM drain waits for running requests. ``responses_store_max_entries`` /
    ``responses_store_max_bytes``: bounds of the in-memory store of /v1/responses (``store: true``;
    least recently used evicted first; 0 entries: nothing is stored). ``enable_force_include_usage``: every
    stream ends with a usage chunk, asked for or not. ``enable_per_request_metrics``: chat, completions and
    responses of one sequence carry vLLM's per-request ``metrics`` (timings). ``allow_runtime_lora``: POST
    /v1/load_lora_adapter and /v1/unload_lora_adapter work (off: adapters are only those of
    --lora-modules); ``lora_roots``: the only folders runtime adapters may be loaded from. ``model_defaults``: the model's own
    sampling defaults and system prompt (an Ollama model's layers, pagoda/hub/stores.py).
    ``file_storage_path``: the folder of the Files and Batch APIs (None: those APIs are off);
    ``file_max_bytes``: the largest upload; ``batch_max_lines``: the most requests in a batch;
    ``batch_max_concurrency``: a batch's lines running at once (pagoda/entrypoints/openai/batch).
    """

    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_num_queued_requests: int | None = None
    request_timeout: float | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout: float = 30.0
    uvicorn_log_level: str = "info"
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None
    enable_debug_endpoints: bool = False
    api_key_on_internal_endpoints: bool = False
    api_keys: dict[str, TenantSpec] | None = None
    responses_store_max_entries: int = DEFAULT_MAX_ENTRIES
    responses_store_max_bytes: int = DEFAULT_MAX_BYTES
    enable_force_include_usage: bool = False
    enable_per_request_metrics: bool = False
    allow_runtime_lora: bool = False
    lora_roots: tuple[str, ...] = ()
    model_defaults: ModelDefaults = NO_DEFAULTS
    file_storage_path: str | None = None
    file_max_bytes: int = DEFAULT_FILE_MAX_BYTES
    batch_max_lines: int = DEFAULT_BATCH_MAX_LINES
    batch_max_concurrency: int = DEFAULT_BATCH_MAX_CONCURRENCY

    def __post_init__(self) -> None:
        if self.allow_runtime_lora and not self.lora_roots:
            raise ValueError("--allow-runtime-lora needs at least one --lora-root DIR: the folders adapters "
                             "may be loaded from")  # fmt: skip
        if self.max_num_queued_requests is not None and self.max_num_queued_requests < 1:
            raise ValueError(f"max_num_queued_requests must be >= 1, got {self.max_num_queued_requests}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0, got {self.request_timeout}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        get_reasoning_parser(self.reasoning_parser)  # an unknown name fails at startup, not per request
        if self.responses_store_max_entries < 0 or self.responses_store_max_bytes < 0:
            raise ValueError("responses_store_max_entries and responses_store_max_bytes must be >= 0")
        for name in ("file_max_bytes", "batch_max_lines", "batch_max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


def build_app(engine: EngineClient, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``engine`` under the model id ``config.served_model_name``."""
    served_model_name, api_keys, request_timeout = config.served_model_name, config.api_keys, config.request_timeout
    state = ServerState(config.max_num_queued_requests, tenants_of(api_keys) if api_keys else None)
    force_usage, per_request_metrics = config.enable_force_include_usage, config.enable_per_request_metrics
    completions = CompletionServing(engine, state, served_model_name, request_timeout,
                                   model_defaults=config.model_defaults, force_include_usage=force_usage,
                                   per_request_metrics=per_request_metrics)  # fmt: skip
    chat = ChatServing(engine, state, served_model_name, request_timeout, config.tool_call_parser,
                       config.reasoning_parser, model_defaults=config.model_defaults,
                       force_include_usage=force_usage, per_request_metrics=per_request_metrics)  # fmt: skip
    store = ResponseStore(config.responses_store_max_entries, config.responses_store_max_bytes)
    responses = ResponsesServing(chat, store)
    embeddings = EmbeddingServing(engine, state, served_model_name, request_timeout)
    created = int(time.time())

    app = FastAPI(title="pagoda", version=pagoda.__version__, description="OpenAI-compatible LLM server")
    app.state.pagoda = state
    install_error_handlers(app)
    files = batches = None
    if config.file_storage_path is not None:
        files = FileStore(config.file_storage_path, config.file_max_bytes)
        batches = BatchService(config.file_storage_path, files, state, config.batch_max_lines,
                               config.batch_max_concurrency)  # fmt: skip
    app.state.batches = batches   # started by the server once its loop runs (server.py)
    app.add_middleware(ServerMiddleware, state=state, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       protect_internal=config.api_key_on_internal_endpoints, api_keys=api_keys,
                       load_report=lambda: engine_load(engine),
                       max_upload_bytes=config.file_max_bytes + _UPLOAD_OVERHEAD if files is not None else None)

    def model_card(model: str | None = None) -> ModelCard:
        lora = completions.check_model(model)
        if lora is not None:
            return ModelCard(id=lora.lora_name, created=created, root=lora.lora_path, parent=served_model_name,
                             max_model_len=engine.max_model_len)
        return ModelCard(id=served_model_name, created=created, root=model_root(engine),
                         max_model_len=engine.max_model_len)  # fmt: skip

    def check_model(model: str | None) -> None:
        completions.check_model(model)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        adapters = list(engine.lora_requests)
        return ModelList(data=[model_card()] + [model_card(name) for name in adapters])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def retrieve_model(model_id: str) -> ModelCard:
        return model_card(model_id)

    _add_lora_routes(app, engine, served_model_name, LoRAPathPolicy(config.allow_runtime_lora, config.lora_roots))
    add_ollama_routes(app, chat, embeddings)  # Ollama's API (pagoda/entrypoints/ollama)

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse}, **_ERRORS})
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create(body, raw_request)

    @app.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}, **_ERRORS})
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create(body, raw_request)

    @app.post("/v1/chat/completions/batch", responses={200: {"model": ChatCompletionResponse}, **_ERRORS})
    async def create_batch_chat_completion(body: BatchChatCompletionRequest, raw_request: Request) -> Response:
        """vLLM's: ``messages`` a list of conversations, choice i conversation i's reply."""
        return await create_batch(chat, body, raw_request)

    add_messages_routes(app, chat)  # Anthropic's Messages API, over the same chat serving
    add_responses_routes(app, responses, _ERRORS)
    invocation_ok = {"description": "A chat completion or a completion, as the body's shape asks (JSON or SSE)."}

    @app.post("/invocations", responses={200: invocation_ok, **_ERRORS})
    async def invocations(body: dict[str, Any], raw_request: Request) -> Response:
        """SageMaker's one route: the body's shape says which API it is for, as in vLLM
        (``messages``: chat completions, ``prompt``: completions); that API's own checks follow."""
        if "messages" in body:
            return await chat.create(parse_body(ChatCompletionRequest, body), raw_request)
        if "prompt" in body:
            return await completions.create(parse_body(CompletionRequest, body), raw_request)
        raise bad_request("Cannot find a suitable handler for the request: /invocations takes a chat completion "
                          "request (with 'messages') or a completion request (with 'prompt').")  # fmt: skip

    @app.post("/v1/embeddings", responses={200: {"model": EmbeddingResponse}, **_ERRORS})
    async def create_embedding(body: EmbeddingRequest, raw_request: Request) -> Response:
        return await embeddings.create(body, raw_request)

    scores = ScoreServing(embeddings)

    @app.post("/v1/score", responses={200: {"model": ScoreResponse}, **_ERRORS})
    @app.post("/score", responses={200: {"model": ScoreResponse}, **_ERRORS})
    async def create_score(body: ScoreRequest, raw_request: Request) -> Response:
        return await scores.score(body, raw_request)

    @app.post("/v1/rerank", responses={200: {"model": RerankResponse}, **_ERRORS})
    @app.post("/rerank", responses={200: {"model": RerankResponse}, **_ERRORS})
    @app.post("/v2/rerank", responses={200: {"model": RerankResponse}, **_ERRORS})
    async def create_rerank(body: RerankRequest, raw_request: Request) -> Response:
        return await scores.rerank(body, raw_request)

    @app.post("/classify", responses={200: {"model": ClassificationResponse}, **_ERRORS})
    async def create_classification(body: ClassifyRequest, raw_request: Request) -> Response:
        return await scores.cross_encoder.classify(body, raw_request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_model(body.model)
        body.check_supported()
        if body.prompt is not None:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=add_special)
        else:
            assert body.messages is not None
            plan = plan_tools(body.tools, None, None)
            text = chat.render([m.to_template_dict() for m in body.messages], body.add_generation_prompt, plan,
                               body.chat_template_kwargs, body.continue_final_message)  # fmt: skip
            tokens = engine.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
        strs = [engine.tokenizer.id_to_token(t) or "" for t in tokens] if body.return_token_strs else None
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=engine.max_model_len, token_strs=strs)

    @app.get("/tokenizer_info", response_model=TokenizerInfoResponse)
    async def tokenizer_info() -> TokenizerInfoResponse:
        return TokenizerInfoResponse(**tokenizer_config(engine.tokenizer, engine.max_model_len))

    @app.get("/load", response_model=ServerLoadResponse)
    async def load() -> ServerLoadResponse:
        # Generation requests admitted and not yet answered in full (vLLM's server_load).
        return ServerLoadResponse(server_load=len(state.groups))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise bad_request(f"Token ids out of range [0, {engine.vocab_size}): {bad[:5]}", param="tokens")
        # Special tokens kept, so that detokenize(tokenize(x)) gives x back.
        return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens, skip_special_tokens=False))

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if not engine.is_healthy:
            reason = engine.dead_reason or "the engine is not healthy"
            return service_unavailable(f"Unhealthy: {reason}", "engine_dead").to_response()
        degraded = engine.degraded_reason
        if degraded:
            # Some data-parallel replicas are down; the others still serve.
            return JSONResponse({"status": "degraded", "reason": degraded})
        return JSONResponse({})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagoda.__version__}

    @app.get("/v1/engine/stats")
    async def engine_stats() -> dict[str, Any]:
        stats: dict[str, Any] = msgspec.structs.asdict(engine.latest_stats())
        queries = stats.get("prefix_cache_queries") or 0
        stats["prefix_cache_hit_rate"] = (stats.get("prefix_cache_hits") or 0) / queries if queries else 0.0
        stats["server_num_active_requests"] = state.num_active_http - 1  # not counting this one
        stats["server_num_waiting_requests"] = state.num_waiting
        return stats

    _add_observability_routes(app, engine, served_model_name)
    add_batch_routes(app, files, batches)
    if engine.config.kv_role is not None:
        from pagoda.entrypoints.kv_transfer.api import add_kv_transfer_routes

        add_kv_transfer_routes(app, engine, served_model_name)
    if config.enable_debug_endpoints:
        _add_debug_routes(app, engine)
    return app


def _add_lora_routes(app: FastAPI, engine: EngineClient, served_model_name: str, policy: LoRAPathPolicy) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies and answers),
    only with --allow-runtime-lora, from folders under --lora-root (see LoRAPathPolicy).

    Once loaded, an adapter is a model of its own: listed in /v1/models with the base
    model as ``parent``, and chosen by a request's ``model``.
    """
    from pagoda.lora.errors import LoRAInUseError

    def check_enabled() -> None:
        if not engine.config.enable_lora:
            raise bad_request("LoRA is not enabled; start the server with --enable-lora.", code="lora_not_enabled")
        if not policy.allow_runtime_lora:
            raise bad_request("Loading and unloading LoRA adapters at run time is disabled; start the server with "
                              "--allow-runtime-lora and --lora-root DIR.", code="runtime_lora_disabled")  # fmt: skip

    ok = {200: {"description": "Success: a line of text.", "content": {"text/plain": {}}}}

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses={**ok, **_ERRORS})
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        check_enabled()
        if body.lora_name == served_model_name:
            raise bad_request(f"The name {body.lora_name!r} is the base model's.", param="lora_name")
        path = policy.resolve(body.lora_path)
        if path is None:
            raise bad_request(LORA_PATH_REFUSED, param="lora_path", code="invalid_lora_path")
        try:
            await engine.add_lora(body.lora_name, path)
        except LoRAExistsError as e:
            raise bad_request(str(e), param="lora_name", code="lora_adapter_exists") from None
        except ValueError as e:  # a bad adapter: its message names the file, setting or module
            raise bad_request(str(e), param="lora_path", code="invalid_lora_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses={**ok, **_ERRORS})
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        check_enabled()
        known = engine.lora_requests.get(body.lora_name)
        if known is not None and body.lora_int_id is not None and body.lora_int_id != known.lora_int_id:
            raise bad_request(
                f"The LoRA adapter {body.lora_name!r} has id {known.lora_int_id}, not {body.lora_int_id}.",
                param="lora_int_id",
            )
        try:
            await engine.remove_lora(body.lora_name)
        except LoRANotFoundError as e:
            raise APIError(404, str(e), param="lora_name", code="lora_adapter_not_found") from None
        except LoRAInUseError as e:
            raise APIError(409, str(e), param="lora_name", code="lora_adapter_in_use") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _add_debug_routes(app: FastAPI, engine: EngineClient) -> None:
    """Internal endpoints for tests and soak runs; never expose them publicly.

    POST /debug/check_integrity: the engine core runs check_integrity() (block pool ref
    counts and free list, KV cache manager, scheduler) between two steps and reports
    {"ok": bool, "error": str | null, "engine_pid": int}, with the current scheduler stats.
    """

    @app.post("/debug/check_integrity", include_in_schema=False)
    async def check_integrity() -> Response:
        try:
            result: dict[str, Any] = await engine.check_integrity()
        except Exception as e:  # the engine is dead or did not answer in time
            return service_unavailable(f"Integrity check failed to run: {e!r}", "engine_dead").to_response()
        result["stats"] = msgspec.structs.asdict(engine.latest_stats())
        return JSONResponse(result, status_code=200 if result["ok"] else 500)


def _add_observability_routes(app: FastAPI, engine: EngineClient, served_model_name: str) -> None:
    """/metrics (Prometheus), /dashboard (a self-contained page) and /dashboard/data (its JSON).

    Open like /health (no API key): scrapers and the page's own fetches carry none, and
    they show counts and timings, never prompts or outputs.
    """
    registry = make_registry(engine, served_model_name)
    page = (resources.files("pagoda.entrypoints.openai") / "dashboard.html").read_bytes()

    def start_reading() -> None:
        # So that a scrape before the first request sees the engine's real state.
        engine.ensure_background_tasks()

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        start_reading()
        return Response(render_metrics(registry), media_type=METRICS_CONTENT_TYPE)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8")

    @app.get("/dashboard/data", include_in_schema=False)
    async def dashboard_json(since: int = -1) -> dict[str, Any]:
        start_reading()
        return dashboard_data(engine, served_model_name, since)
