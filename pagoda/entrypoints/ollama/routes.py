"""Ollama's routes on pagoda's app: ``add_ollama_routes(app, chat)``.

Errors on these routes are Ollama's ``{"error": "message"}``: ``OllamaRoute`` rewrites
the APIError that shared code raises (and request validation errors) into that shape,
and the server middleware does the same for its own errors (auth, body limit, drain)
on paths under /api/.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import PlainTextResponse, Response

import pagoda
from pagoda.entrypoints.ollama.model_facts import (
    ModelFacts,
    file_identity,
    read_model_facts,
)
from pagoda.entrypoints.ollama.protocol import (
    DEFAULT_SAMPLING,
    ChatRequest,
    EmbedRequest,
    GenerateRequest,
    LegacyEmbeddingsRequest,
    ManageRequest,
    ShowRequest,
)
from pagoda.entrypoints.ollama.responses import (
    NDJSON,
    ChatResponse,
    EmbedResponse,
    ErrorResponse,
    GenerateResponse,
    LegacyEmbeddingsResponse,
    ListedModel,
    ModelDetails,
    PsResponse,
    RunningModel,
    ShowResponse,
    TagsResponse,
    VersionResponse,
    error_response,
    rfc3339,
)
from pagoda.entrypoints.ollama.serving import OllamaServing, ollama_name
from pagoda.entrypoints.openai.embedding_protocol import EmbeddingRequest
from pagoda.entrypoints.openai.errors import APIError, validation_error_to_api_error
from pagoda.entrypoints.openai.serving_chat import ChatServing
from pagoda.entrypoints.openai.serving_embedding import EmbeddingServing
from pagoda.entrypoints.openai.serving_engine import client_gone_response
from pagoda.lora.request import LoRARequest

# The Ollama API version whose endpoints and fields these routes follow; some clients
# gate features on it, so it is Ollama's numbering, not pagoda's (sent as pagoda_version).
OLLAMA_API_VERSION = "0.12.0"
RUNNING_TEXT = "Ollama is running"  # clients probe GET / for this exact text
# The model never unloads (keep_alive has no effect), so it never expires.
NEVER = "9999-12-31T23:59:59Z"

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)
}


class OllamaRoute(APIRoute):
    """An APIRoute whose errors are written in Ollama's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            request = _as_json(request)
            try:
                return await handler(request)
            except RequestValidationError as e:
                return error_response(validation_error_to_api_error(e))
            except APIError as e:
                return error_response(e)
            except StarletteHTTPException as e:  # FastAPI's own, e.g. a body that is not UTF-8
                return error_response(APIError(e.status_code, str(e.detail), headers=dict(e.headers or {})))

        return route


def _as_json(request: Request) -> Request:
    """The request with its body read as JSON whatever its content type says, as Ollama
    reads it: its documentation calls the API as ``curl URL -d '{...}'``, which sends
    ``application/x-www-form-urlencoded`` (and a client may send no content type at all)."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() == "application/json" or request.method in ("GET", "HEAD"):
        return request
    scope = dict(request.scope)
    scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
    scope["headers"].append((b"content-type", b"application/json"))
    return Request(scope, request.receive)


def _generation_responses(model: type) -> dict[int | str, dict[str, Any]]:
    """200: one JSON object, or (streaming, the default) one per line."""
    ndjson = {NDJSON: {"schema": {"type": "string", "description": "one JSON object per line"}}}
    return {200: {"model": model, "content": ndjson}, **_ERRORS}


def add_ollama_routes(app: FastAPI, chat: ChatServing, embeddings: EmbeddingServing | None = None) -> None:
    serving = OllamaServing(chat)
    engine = chat.engine
    router = APIRouter(route_class=OllamaRoute, tags=["ollama"])

    @functools.cache
    def facts() -> ModelFacts:
        return read_model_facts(engine.config)

    def details(lora: LoRARequest | None) -> ModelDetails:
        return ModelDetails(**facts().details(parent_model=ollama_name(chat.served_model_name) if lora else ""))

    def identity(lora: LoRARequest | None) -> tuple[int, str, str]:
        """(size, modified_at, digest) of the model or adapter."""
        if lora is None:
            f = facts()
            return f.size, rfc3339(f.modified_at), f.digest
        size, modified, digest = file_identity(lora.lora_path)
        return size, rfc3339(modified), digest

    def listed(name: str) -> ListedModel:
        lora = serving.lookup(name)
        size, modified, digest = identity(lora)
        return ListedModel(name=ollama_name(name), model=ollama_name(name), modified_at=modified, size=size,
                           digest=digest, details=details(lora))  # fmt: skip

    async def root() -> PlainTextResponse:
        return PlainTextResponse(RUNNING_TEXT)

    for method in ("GET", "HEAD"):  # one route each: an operation id per method
        router.add_api_route("/", root, methods=[method], response_class=PlainTextResponse, name=f"root_{method}")

    @router.get("/api/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=OLLAMA_API_VERSION, pagoda_version=pagoda.__version__)

    @router.get("/api/tags", response_model=TagsResponse, responses=_ERRORS)
    async def tags() -> TagsResponse:
        return TagsResponse(models=[listed(name) for name in serving.model_names()])

    @router.get("/api/ps", response_model=PsResponse, responses=_ERRORS)
    async def ps() -> PsResponse:
        models = []
        for name in serving.model_names():
            entry = listed(name)
            vram = entry.size if engine.config.device != "cpu" else 0
            models.append(RunningModel(name=entry.name, model=entry.model, size=entry.size, digest=entry.digest,
                                       details=entry.details, expires_at=NEVER, size_vram=vram,
                                       context_length=engine.max_model_len))  # fmt: skip
        return PsResponse(models=models)

    @router.post("/api/show", response_model=ShowResponse, responses=_ERRORS)
    async def show(body: ShowRequest) -> ShowResponse:
        name = body.model_name()
        lora = serving.lookup(name)
        f = facts()
        template = chat.tokenizer.chat_template or ""
        parameters = [("num_ctx", str(engine.max_model_len))]
        parameters += [(k, str(v)) for k, v in DEFAULT_SAMPLING.items()]
        for token_id in sorted(chat.tokenizer.eos_token_ids):
            token = chat.tokenizer.id_to_token(token_id)
            if token is not None:
                parameters.append(("stop", f'"{token}"'))
        modelfile = [f"# Modelfile generated by pagoda {pagoda.__version__}", f"FROM {f.path}"]
        if lora is not None:
            modelfile.append(f"ADAPTER {lora.lora_path}")
        modelfile.append(f'TEMPLATE """{template}"""')
        modelfile += [f"PARAMETER {k} {v}" for k, v in parameters]
        license_ = f.model_info.get("general.license")
        return ShowResponse(
            modelfile="\n".join(modelfile) + "\n", parameters="\n".join(f"{k:<30} {v}" for k, v in parameters),
            template=template, details=details(lora), model_info=f.info(bool(body.verbose)),
            capabilities=["completion", "tools"], modified_at=identity(lora)[1],
            license=license_ if isinstance(license_, str) else None,
        )  # fmt: skip

    @router.post("/api/generate", responses=_generation_responses(GenerateResponse))
    async def generate(body: GenerateRequest, raw_request: Request) -> Response:
        return await serving.generate(body, raw_request)

    @router.post("/api/chat", responses=_generation_responses(ChatResponse))
    async def chat_route(body: ChatRequest, raw_request: Request) -> Response:
        return await serving.chat_turn(body, raw_request)

    if embeddings is not None:
        _add_embedding_routes(router, serving, embeddings)
    _add_management_routes(router, chat.served_model_name)
    app.include_router(router)
    # (404 / 405 under /api/ come out in Ollama's shape through the shape registered in responses.py)


def _add_embedding_routes(router: APIRouter, serving: OllamaServing, embeddings: EmbeddingServing) -> None:
    """/api/embed and the older /api/embeddings: the same engine requests as /v1/embeddings
    (a server started with --task embed; otherwise the same 400 as there)."""

    async def vectors(body: EmbedRequest | LegacyEmbeddingsRequest, inputs: str | list[str], truncate: bool,
                      dimensions: int | None, raw_request: Request) -> tuple[list[list[float]], int] | None:  # fmt: skip
        lora = serving.lookup(body.model)
        body.check_supported()
        request = EmbeddingRequest(input=inputs, model=lora.lora_name if lora else serving.served_model_name,
                                   dimensions=dimensions, truncate_prompt_tokens=-1 if truncate else None)
        return await embeddings.vectors(request, raw_request)

    @router.post("/api/embed", response_model=EmbedResponse, responses=_ERRORS)
    async def embed(body: EmbedRequest, raw_request: Request) -> Response:
        start = time.monotonic_ns()
        result = await vectors(body, body.input, body.truncate, body.dimensions, raw_request)
        if result is None:
            return client_gone_response()
        response = EmbedResponse(model=body.model, embeddings=result[0], total_duration=time.monotonic_ns() - start,
                                 load_duration=0, prompt_eval_count=result[1])  # fmt: skip
        return Response(response.model_dump_json(), media_type="application/json")

    @router.post("/api/embeddings", response_model=LegacyEmbeddingsResponse, responses=_ERRORS)
    async def legacy_embeddings(body: LegacyEmbeddingsRequest, raw_request: Request) -> Response:
        result = await vectors(body, body.prompt, True, None, raw_request)
        if result is None:
            return client_gone_response()
        return Response(LegacyEmbeddingsResponse(embedding=result[0][0]).model_dump_json(),
                        media_type="application/json")  # fmt: skip


def _add_management_routes(router: APIRouter, served_model_name: str) -> None:
    """/api/pull, /push, /create, /copy and /delete: 403, since pagoda serves the model it
    was started with and keeps no model library to change."""
    refused = {403: {"model": ErrorResponse}, **_ERRORS}

    def refuse(what: str) -> APIError:
        return APIError(403, f"{what} is not supported: pagoda serves the model it was started with "
                        f"({ollama_name(served_model_name)!r}) and has no model library; restart it with "
                        "another model (or load a LoRA adapter with POST /v1/load_lora_adapter) instead.",
                        code="unsupported")  # fmt: skip

    def refusing(what: str) -> Callable[[ManageRequest], Coroutine[Any, Any, Response]]:
        async def endpoint(body: ManageRequest) -> Response:
            raise refuse(what)

        return endpoint

    for path, method, what in (("/api/pull", "POST", "pulling a model"), ("/api/push", "POST", "pushing a model"),
                               ("/api/create", "POST", "creating a model"), ("/api/copy", "POST", "copying a model"),
                               ("/api/delete", "DELETE", "deleting a model")):  # fmt: skip
        router.add_api_route(path, refusing(what), methods=[method], responses=refused, name=path.rsplit("/", 1)[1])
