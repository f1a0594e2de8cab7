"""Several models behind one server, loaded on demand (Ollama's way, and llama-server's
router mode): ``pagoda serve --models-dir DIR`` (or ``--models-max N`` with no model: every
model of the stores, pagoda/hub/stores.py).

``ModelRouter`` is the ASGI app. It answers the listings itself (``/v1/models`` and
``/api/tags``: every servable model; ``/api/ps``: the loaded ones and until when) and hands
every other request to the app of the model its JSON body names (``"model"``), a whole
single-model pagoda app (pagoda/entrypoints/openai/api_server.py) over that model's own
engine core process, started on first use. Requests for a model that is loading wait for
it (up to ``--model-load-timeout``); a model that fails to load is an error for its
requests only. When ``--models-max`` models are loaded, the least recently used idle one is
unloaded to make room (a request waits for one to become idle). A model stays loaded for
Ollama's ``keep_alive`` after its last request (a duration such as ``5m``, seconds, ``0``
to unload at once, a negative value to keep it), the server's ``--keep-alive`` by default;
``{"model": M, "keep_alive": 0}`` on /api/generate or /api/chat unloads M without a reply.
Each model's KV cache takes its share of one budget (``--kv-cache-memory`` / models-max).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pagoda.config import EngineConfig

logger = logging.getLogger(__name__)

_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)(h|ms|m|s|us|µs|ns))")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_REAP_S = 0.5


def parse_keep_alive(value: Any) -> float | None:
    """Ollama's keep_alive as seconds (None: forever). ``"5m"``, ``"1h30m"``, ``"300ms"``
    (Go durations), a number of seconds, ``0`` (unload now) or a negative value (keep)."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be a duration or a number of seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"keep_alive {value!r} is not a duration (e.g. 5m, 1h30m, 30s, 0, -1)") from None
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    else:
        raise ValueError(f"keep_alive must be a duration or a number of seconds, got {value!r}")
    return None if seconds < 0 else seconds


def catalogue_from_dir(folder: str) -> dict[str, str]:
    """Name -> path of every model in ``folder``: GGUF files (named by their stem) and HF
    folders (config.json; named by the folder)."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ValueError(f"--models-dir {folder}: not a folder")
    found = {}
    for entry in sorted(root.iterdir()):
        if entry.is_file() and entry.suffix == ".gguf" and not entry.name.lower().startswith("mmproj"):
            found[entry.stem] = str(entry)
        elif entry.is_dir() and (entry / "config.json").is_file():
            found[entry.name] = str(entry)
    if not found:
        raise ValueError(f"--models-dir {folder}: no GGUF file or HF model folder in it")
    return found


def catalogue_from_stores() -> dict[str, str]:
    """Name -> name of every model the stores hold (as `pagoda list` shows them)."""
    from pagoda.hub.stores import list_models

    return {m.name: m.name for m in list_models()}


@dataclass
class Slot:
    name: str
    config: EngineConfig
    engine: Any = None
    app: Any = None
    loading: asyncio.Task | None = None
    in_flight: int = 0
    last_used: float = 0.0
    expires_at: float | None = None      # time.time() deadline; None: kept

    @property
    def loaded(self) -> bool:
        return self.app is not None


class RouterState:
    """What the graceful shutdown (pagoda/entrypoints/openai/server.py) reads: draining, the
    requests in flight, and how to stop them all (every loaded model's)."""

    def __init__(self, router: ModelRouter) -> None:
        self.router = router
        self.draining = False
        self.num_active_http = 0

    def stop_all(self, reason: Any) -> None:
        for slot in self.router.slots.values():
            if slot.app is not None:
                slot.app.state.pagoda.stop_all(reason)


class ModelRouter:
    def __init__(self, catalogue: dict[str, str], base: EngineConfig, build: Callable[[Any, Slot], Any],
                 models_max: int, keep_alive: float | None, load_timeout: float, api_key: str | None = None,
                 engine_factory: Callable[[EngineConfig], Any] | None = None) -> None:
        if models_max < 1:
            raise ValueError(f"--models-max must be >= 1, got {models_max}")
        self.slots = {name: Slot(name, dataclasses.replace(base, model=model, served_model_name=name))
                      for name, model in catalogue.items()}
        self.build = build                      # (engine, slot) -> the model's FastAPI app
        self.models_max = models_max
        self.keep_alive = keep_alive
        self.load_timeout = load_timeout
        self.api_key = api_key
        self.engine_factory = engine_factory or _start_engine
        self.state = RouterState(self)
        self.created = int(time.time())
        self._room = asyncio.Condition()
        self._reaper: asyncio.Task | None = None

    # ---- models ------------------------------------------------------------------------------
    def lookup(self, name: Any) -> Slot | None:
        if not isinstance(name, str):
            return None
        slot = self.slots.get(name)
        if slot is None and name.endswith(":latest"):
            slot = self.slots.get(name[: -len(":latest")])
        return slot

    def loaded(self) -> list[Slot]:
        return [s for s in self.slots.values() if s.loaded or s.loading is not None]

    async def acquire(self, slot: Slot) -> Slot:
        """``slot`` loaded (loading it, and unloading idle ones for room, when needed), with
        one more request in flight."""
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
        slot.in_flight += 1
        slot.last_used = time.monotonic()
        try:
            while not slot.loaded:
                if slot.loading is None:
                    await self._make_room(slot)
                    if slot.loaded or slot.loading is not None:
                        continue
                    slot.loading = asyncio.get_running_loop().create_task(self._load(slot))
                await asyncio.wait_for(asyncio.shield(slot.loading), self.load_timeout)
        except BaseException:
            self.release(slot, None, used=False)
            raise
        return slot

    async def _make_room(self, wanted: Slot) -> None:
        """Wait until fewer than models_max models are loaded, unloading the least recently
        used idle one when all seats are taken."""
        deadline = time.monotonic() + self.load_timeout
        async with self._room:
            while len(self.loaded()) >= self.models_max:
                idle = [s for s in self.loaded() if s.in_flight == 0 and s.loading is None and s is not wanted]
                if idle:
                    victim = min(idle, key=lambda s: s.last_used)
                    logger.info("unloading %s to make room for %s (--models-max %d)", victim.name, wanted.name,
                                self.models_max)
                    await self._unload(victim)
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no room to load {wanted.name}: {self.models_max} model(s) loaded, all busy")
                try:
                    await asyncio.wait_for(self._room.wait(), left)
                except TimeoutError:
                    raise TimeoutError(f"no room to load {wanted.name}: {self.models_max} model(s) loaded, "
                                       f"all busy") from None

    async def _load(self, slot: Slot) -> None:
        start = time.monotonic()
        logger.info("loading %s", slot.name)
        try:
            engine = await asyncio.to_thread(self.engine_factory, slot.config)
            slot.engine, slot.app = engine, self.build(engine, slot)
            logger.info("loaded %s in %.1f s", slot.name, time.monotonic() - start)
        finally:
            slot.loading = None

    def release(self, slot: Slot, keep_alive: float | None | str, used: bool = True) -> None:
        """One request of ``slot`` done; ``keep_alive``: its seconds (None: forever), or
        "default" for the server's."""
        slot.in_flight -= 1
        slot.last_used = time.monotonic()
        if used:
            seconds = self.keep_alive if keep_alive == "default" else keep_alive
            slot.expires_at = None if seconds is None else time.time() + seconds
        if slot.in_flight == 0:
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._room:
            self._room.notify_all()

    async def _unload(self, slot: Slot) -> None:
        engine, slot.engine, slot.app, slot.expires_at = slot.engine, None, None, None
        if engine is not None:
            await engine.shutdown()
            logger.info("unloaded %s", slot.name)

    async def unload(self, slot: Slot) -> None:
        async with self._room:
            if slot.loaded and slot.in_flight == 0:
                await self._unload(slot)
            self._room.notify_all()

    async def _reap(self) -> None:
        """Unload the models whose keep_alive has run out."""
        while True:
            await asyncio.sleep(_REAP_S)
            now = time.time()
            for slot in list(self.slots.values()):
                if slot.loaded and slot.in_flight == 0 and slot.expires_at is not None and slot.expires_at <= now:
                    await self.unload(slot)

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for slot in self.slots.values():
            if slot.loading is not None:
                with contextlib.suppress(BaseException):
                    await slot.loading
            if slot.loaded:
                await self._unload(slot)

    # ---- ASGI ----------------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        ollama = path.startswith("/api/")
        if self.state.draining:
            return await _reply(send, 503, _error("the server is shutting down", ollama))
        if self.api_key and path.startswith("/v1/") and not _authorized(scope, self.api_key):
            return await _reply(send, 401, _error("Invalid or missing API key", False, "invalid_api_key"))
        if method in ("GET", "HEAD"):
            listing = self._listing(path)
            if listing is not None:
                return await _reply(send, 200, listing)
            if path in ("/", "/api/version", "/health", "/version"):
                body = {"/": "Ollama is running", "/api/version": {"version": "0.12.0"},
                        "/health": {"status": "ok", "models_loaded": len(self.loaded())}}.get(path, {"version": "pagoda"})
                return await _reply(send, 200, body)
            # /metrics, /dashboard, ...: each model's app has its own; none for the router yet.
            return await _reply(send, 404, _error(f"{path} is not served by a server of several models (yet); "
                                                  f"it serves /v1/models, /api/tags, /api/ps, /health and the "
                                                  f"requests that name a model", ollama, "not_found"))
        body = await _read_body(receive)
        try:
            request = json.loads(body) if body else {}
        except ValueError:
            request = None
        if not isinstance(request, dict):
            return await _reply(send, 400, _error("the request body must be a JSON object", ollama, "invalid_json"))
        name = request.get("model")
        slot = self.lookup(name)
        if slot is None:
            known = ", ".join(sorted(self.slots))
            what = f"model {name!r} not found" if name else "the request names no model"
            return await _reply(send, 404, _error(f"{what}; this server has: {known}", ollama, "model_not_found"))
        keep: float | None | str = "default"
        if "keep_alive" in request and request["keep_alive"] is not None:
            try:
                keep = parse_keep_alive(request["keep_alive"])
            except ValueError as e:
                return await _reply(send, 400, _error(str(e), ollama, "invalid_value"))
        if keep == 0 and path in ("/api/generate", "/api/chat") and not request.get("prompt") \
                and not request.get("messages"):
            # Ollama's unload call: no reply to generate, the model unloaded.
            await self.unload(slot)
            done = {"model": name, "created_at": _now(), "done": True, "done_reason": "unload"}
            done.update({"response": ""} if path == "/api/generate" else {"message": {"role": "assistant",
                                                                                       "content": ""}})
            return await _reply(send, 200, done)
        self.state.num_active_http += 1
        try:
            try:
                await self.acquire(slot)
            except TimeoutError as e:
                return await _reply(send, 503, _error(f"{slot.name}: {e or 'loading took too long'}", ollama,
                                                      "model_loading_timeout"))
            except Exception as e:  # the model failed to load: its requests fail, the server serves on
                logger.exception("loading %s failed", slot.name)
                return await _reply(send, 500, _error(f"{slot.name} failed to load: {e}", ollama, "model_load_failed"))
            try:
                await slot.app(scope, _replay(body, receive), send)
            finally:
                self.release(slot, keep)
                if keep == 0:
                    asyncio.get_running_loop().create_task(self.unload(slot))
        finally:
            self.state.num_active_http -= 1

    def _listing(self, path: str) -> dict | None:
        if path == "/v1/models":
            return {"object": "list", "data": [
                {"id": s.name, "object": "model", "created": self.created, "owned_by": "pagoda",
                 "root": s.config.model, "parent": None,
                 **({"max_model_len": s.engine.max_model_len} if s.engine is not None else {})}
                for s in self.slots.values()]}
        if path == "/api/tags":
            return {"models": [self._ollama_entry(s) for s in self.slots.values()]}
        if path == "/api/ps":
            entries = []
            for s in self.loaded():
                if not s.loaded:
                    continue
                entry = self._ollama_entry(s)
                expires = (datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC) if s.expires_at is None
                           else datetime.fromtimestamp(s.expires_at, UTC))
                entry.pop("modified_at")
                entries.append({**entry, "expires_at": _rfc3339(expires), "size_vram": 0,
                                "context_length": s.engine.max_model_len})
            return {"models": entries}
        return None

    def _ollama_entry(self, slot: Slot) -> dict:
        from pagoda.entrypoints.ollama.model_facts import read_model_facts
        from pagoda.entrypoints.ollama.serving import ollama_name

        try:
            facts = read_model_facts(slot.config)
            size, modified, digest, details = facts.size, _rfc3339(facts.modified_at), facts.digest, facts.details()
        except Exception:   # a model that cannot be read is still listed; loading it says why
            size, modified, digest, details = 0, _now(), "", {}
        name = ollama_name(slot.name)
        return {"name": name, "model": name, "modified_at": modified, "size": size, "digest": digest,
                "details": details}


def _start_engine(config: EngineConfig) -> Any:
    from pagoda.engine.async_llm import AsyncLLM

    return AsyncLLM.from_config(config)


def _authorized(scope: dict, api_key: str) -> bool:
    for key, value in scope.get("headers", []):
        if key == b"authorization":
            return value.decode("latin-1") == f"Bearer {api_key}"
    return False


def _error(message: str, ollama: bool, code: str = "error") -> dict:
    if ollama:
        return {"error": message}
    return {"error": {"message": message, "type": "invalid_request_error", "param": "model", "code": code}}


def _now() -> str:
    return _rfc3339(datetime.now(UTC))


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


async def _read_body(receive: Callable) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Callable) -> Callable:
    """A receive that hands the buffered body over once, then waits for the client's
    disconnect as the original would."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _reply(send: Callable, status: int, body: Any) -> None:
    if isinstance(body, str):
        data, kind = body.encode(), b"text/plain; charset=utf-8"
    else:
        data, kind = json.dumps(body).encode(), b"application/json"
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", kind), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def per_model_kv_budget(config: EngineConfig, models_max: int) -> EngineConfig:
    """Each model's KV cache a share of one budget: --kv-cache-memory (default: a quarter of
    free memory, at most 4 GiB) over --models-max."""
    if config.num_kv_blocks is not None:
        return config
    from pagoda.host import available_memory_bytes

    total = config.kv_cache_memory or min(available_memory_bytes() // 4, 4 << 30)
    return dataclasses.replace(config, kv_cache_memory=max(1, total // models_max))
