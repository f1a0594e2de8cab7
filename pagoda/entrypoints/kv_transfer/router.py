"""``pagoda router``: one OpenAI endpoint over prefill and decode instances.

    pagoda serve --kv-role prefill --port 8100 &
    pagoda serve --kv-role decode --port 8200 &
    pagoda router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

A completion or chat completion request runs in two halves. The router picks the least
busy prefill and decode instances and a fresh transfer id X, then

1. sends the request to the prefill instance as ``max_tokens: 1``, not streamed, with
   ``kv_transfer_params: {"do_remote_decode": true, "transfer_id": X}``: it computes the
   prompt, samples the first token and parks the KV blocks under X (and, asked for
   ``return_token_ids``, answers with the prompt's token ids);
2. sends the original request to the decode instance with ``{"do_remote_prefill": true,
   "transfer_id": X, "remote_address": <the prefill instance's KV endpoint>,
   "prompt_token_ids": <those ids>}``: it takes those ids as the prompt (no rendering of its
   own), fetches the blocks and the first token, emits that token, and decodes on;

and answers with the decode instance's response, streamed or not, as it comes: one ordinary
response, its usage that of one request. The first token was sampled on the prefill
instance; it reaches the client in the decode instance's stream, once the blocks arrived.

Failures: a prefill instance that cannot be reached or answers 5xx, and a decode instance
that cannot be reached, answers 5xx (a failed transfer is a 503) or breaks a response
that is not streamed, make the router release the parked blocks (if any) and try another
pair, up to ``max_attempts`` pairs, as long as nothing has reached the client. An instance
that cannot be reached is skipped for ``cooldown_s``. Once a stream has started, a decode
instance that fails ends it with an error event. A client that disconnects closes the
router's requests to the instances, which abort theirs (and free the blocks on both sides).

Not routed here: ``n`` > 1, ``best_of``, beam search, ``prompt_logprobs`` (and echo with
logprobs), several prompts in one completions request, a thinking budget (400, naming the
field); the other endpoints of ``pagoda serve``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagoda.kv_transfer.wire import release_transfer

logger = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")
_FORWARDED_HEADERS = ("authorization", "x-api-key", "x-tenant")


class RouterError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return JSONResponse({"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}},
                            status_code=self.status)


@dataclass
class Instance:
    url: str
    role: str                       # prefill | decode
    kv_address: str | None = None   # a prefill instance's KV endpoint, from /v1/kv_transfer/info
    model: str | None = None
    known: bool = False             # its info was read
    down_until: float = 0.0         # skipped until then (it could not be reached)
    in_flight: int = 0
    served: int = 0

    def usable(self, now: float) -> bool:
        return now >= self.down_until


class PDRouter:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], max_attempts: int = 3,
                 cooldown_s: float = 5.0, connect_timeout_s: float = 5.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:  # fmt: skip
        """``transport``: httpx's, for tests (default: real connections)."""
        if not prefill_urls or not decode_urls:
            raise ValueError("the router needs at least one --prefill and one --decode instance")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.instances = ([Instance(u.rstrip("/"), "prefill") for u in prefill_urls]
                          + [Instance(u.rstrip("/"), "decode") for u in decode_urls])  # fmt: skip
        self.max_attempts = max_attempts
        self.cooldown_s = cooldown_s
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=connect_timeout_s), transport=transport,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.counts = {"requests": 0, "succeeded": 0, "failed": 0, "retries": 0, "client_errors": 0}

    # ---- instances ----------------------------------------------------------------------
    async def refresh(self, inst: Instance) -> bool:
        """Read an instance's /v1/kv_transfer/info; False (and down for cooldown_s) if unreachable."""
        try:
            r = await self.client.get(f"{inst.url}/v1/kv_transfer/info", timeout=5.0)
            info = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            info = None
        if info is None:
            self._down(inst)
            return False
        if info.get("kv_role") != inst.role:
            raise RouterError(500, f"{inst.url} is a {info.get('kv_role')!r} instance, configured as {inst.role}",
                              "instance_role_mismatch")
        inst.kv_address, inst.model, inst.known = info.get("kv_address"), info.get("model"), True
        if inst.role == "prefill" and not inst.kv_address:
            raise RouterError(500, f"{inst.url} reports no KV endpoint", "instance_role_mismatch")
        return True

    async def start(self, wait_s: float = 120.0) -> None:
        """Wait (up to ``wait_s``) until at least one instance of each role answers; the rest
        are tried again when a request needs them. ValueError if a role stays unreachable or
        the instances serve different models."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                await asyncio.gather(*(self.refresh(i) for i in self.instances if not i.known))
            except RouterError as e:
                raise ValueError(str(e)) from None
            roles = {i.role for i in self.instances if i.known}
            if roles == {"prefill", "decode"} or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        missing = {"prefill", "decode"} - roles
        if missing:
            raise ValueError(f"no {' or '.join(sorted(missing))} instance answered /v1/kv_transfer/info in {wait_s:g} s")
        models = {i.model for i in self.instances if i.known}
        if len(models) > 1:
            raise ValueError(f"the instances serve different models: {sorted(map(str, models))}")
        for inst in self.instances:
            inst.down_until = 0.0 if inst.known else inst.down_until

    def _down(self, inst: Instance) -> None:
        inst.down_until = time.monotonic() + self.cooldown_s
        logger.warning("%s instance %s is unreachable; skipped for %g s", inst.role, inst.url, self.cooldown_s)

    async def _pick(self, role: str, tried: set[str]) -> Instance | None:
        now = time.monotonic()
        for inst in sorted((i for i in self.instances if i.role == role and i.url not in tried and i.usable(now)),
                           key=lambda i: (i.in_flight, i.served)):  # fmt: skip
            if inst.known or await self.refresh(inst):
                return inst
        return None

    # ---- a request ------------------------------------------------------------------------
    async def handle(self, path: str, raw: Request) -> Response:
        self.counts["requests"] += 1
        try:
            body = json.loads(await raw.body())
        except ValueError as e:
            return self._client_error(RouterError(400, f"The body is not valid JSON: {e}", "invalid_json"))
        try:
            _check_routable(path, body)
        except RouterError as e:
            return self._client_error(e)
        headers = {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED_HEADERS}
        work = asyncio.ensure_future(self._route(path, body, headers))
        watcher = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if work not in done:   # the client left before an answer: close the instances' requests
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return Response(status_code=499)
        return work.result()

    def _client_error(self, err: RouterError) -> Response:
        self.counts["client_errors"] += 1
        return err.response()

    async def _route(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        tried_p: set[str] = set()
        tried_d: set[str] = set()
        last = "no instance was available"
        for attempt in range(self.max_attempts):
            if attempt:
                self.counts["retries"] += 1
            prefill = await self._pick("prefill", tried_p)
            decode = await self._pick("decode", tried_d)
            if prefill is None or decode is None:
                break
            tid = uuid.uuid4().hex
            parked = await self._prefill(prefill, path, body, headers, tid)
            if isinstance(parked, Response):
                return parked         # the request's own fault (4xx): as the prefill instance said
            if isinstance(parked, str):
                last = parked
                tried_p.add(prefill.url)
                continue
            try:
                outcome = await self._decode(prefill, decode, path, body, headers, tid, parked)
            except BaseException:
                self._release(prefill, tid)
                raise
            if isinstance(outcome, Response):
                self.counts["succeeded" if outcome.status_code < 400 else "client_errors"] += 1
                if outcome.status_code >= 400:
                    self._release(prefill, tid)
                return outcome
            self._release(prefill, tid)
            last = outcome
            tried_d.add(decode.url)
        self.counts["failed"] += 1
        return RouterError(503, f"No prefill/decode pair could serve the request: {last}",
                           "no_instance_pair").response()

    async def _prefill(self, inst: Instance, path: str, body: dict[str, Any], headers: dict[str, str],
                       tid: str) -> Response | str | list[int] | None:  # fmt: skip
        """The prompt's token ids when the blocks are parked (None if the answer lacks them); a
        Response to pass on (4xx); a message to retry on."""
        inst.in_flight += 1
        try:
            r = await self.client.post(inst.url + path, json=_prefill_body(path, body, tid), headers=headers)
        except httpx.HTTPError as e:
            self._down(inst)
            return f"prefill instance {inst.url}: {type(e).__name__}: {e}"
        finally:
            inst.in_flight -= 1
        inst.served += 1
        if r.status_code >= 500:
            return f"prefill instance {inst.url} answered {r.status_code}: {_error_message(r.content)}"
        if r.status_code != 200:
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        return _prompt_token_ids(r.content)

    async def _decode(self, prefill: Instance, inst: Instance, path: str, body: dict[str, Any],
                      headers: dict[str, str], tid: str, prompt_token_ids: list[int] | None) -> Response | str:  # fmt: skip
        """The response to return, or a message to retry on (nothing reached the client).
        ``prompt_token_ids``: the prompt as the prefill instance computed it, which the decode
        instance takes instead of rendering the request again."""
        transfer: dict[str, Any] = {"do_remote_prefill": True, "transfer_id": tid, "remote_address": prefill.kv_address}
        if prompt_token_ids is not None:
            transfer["prompt_token_ids"] = prompt_token_ids
        payload = dict(body, kv_transfer_params=transfer)
        inst.in_flight += 1
        counted = True
        try:
            try:
                up = await self.client.send(self.client.build_request("POST", inst.url + path, json=payload,
                                                                      headers=headers), stream=True)
            except httpx.HTTPError as e:
                self._down(inst)
                return f"decode instance {inst.url}: {type(e).__name__}: {e}"
            inst.served += 1
            if up.status_code != 200 or not body.get("stream"):
                try:
                    content = await up.aread()
                except httpx.HTTPError as e:
                    return f"decode instance {inst.url} broke off its response: {type(e).__name__}: {e}"
                finally:
                    await up.aclose()
                if up.status_code >= 500:
                    return f"decode instance {inst.url} answered {up.status_code}: {_error_message(content)}"
                return Response(content, up.status_code, media_type=up.headers.get("content-type"))
            counted = False   # the stream keeps it busy until it ends

            async def close() -> None:
                inst.in_flight -= 1
                await up.aclose()   # a client gone: the decode instance sees it and aborts

            return _RelayResponse(_relay(inst, up), close)
        finally:
            if counted:
                inst.in_flight -= 1

    def _release(self, prefill: Instance, tid: str) -> None:
        """Free a transfer's parked blocks on the prefill instance (if still parked), in the background."""
        if prefill.kv_address is None:
            return
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, release_transfer, prefill.kv_address, tid)

    # ---- the rest ---------------------------------------------------------------------------
    async def models(self) -> Response:
        for inst in sorted(self.instances, key=lambda i: i.role != "decode"):
            try:
                r = await self.client.get(f"{inst.url}/v1/models", timeout=10.0)
            except httpx.HTTPError:
                continue
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        return RouterError(503, "No instance answered /v1/models", "no_instance").response()

    async def health(self) -> Response:
        async def ok(inst: Instance) -> bool:
            try:
                return (await self.client.get(f"{inst.url}/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                return False

        results = await asyncio.gather(*(ok(i) for i in self.instances))
        status = {i.url: ("up" if up else "down") for i, up in zip(self.instances, results)}
        roles_up = {i.role for i, up in zip(self.instances, results) if up}
        code = 200 if roles_up == {"prefill", "decode"} else 503
        return JSONResponse({"status": "ok" if code == 200 else "unavailable", "instances": status}, status_code=code)

    def metrics(self) -> str:
        lines = []
        for name, help_ in (("requests", "requests received"), ("succeeded", "requests answered by a decode "
                            "instance"), ("failed", "requests no instance pair could serve (503)"),
                            ("retries", "tries on another pair"), ("client_errors", "requests refused (4xx)")):
            lines += [f"# HELP pagoda_router_{name}_total {help_}", f"# TYPE pagoda_router_{name}_total counter",
                      f"pagoda_router_{name}_total {self.counts[name]}"]
        lines += ["# HELP pagoda_router_in_flight requests in progress on an instance",
                  "# TYPE pagoda_router_in_flight gauge"]
        lines += [f'pagoda_router_in_flight{{role="{i.role}",instance="{i.url}"}} {i.in_flight}' for i in self.instances]
        now = time.monotonic()
        lines += ["# HELP pagoda_router_instance_up 0 while an instance is skipped after a failure",
                  "# TYPE pagoda_router_instance_up gauge"]
        lines += [f'pagoda_router_instance_up{{role="{i.role}",instance="{i.url}"}} {int(i.usable(now))}'
                  for i in self.instances]  # fmt: skip
        return "\n".join(lines) + "\n"

    async def close(self) -> None:
        await self.client.aclose()


async def _relay(inst: Instance, up: httpx.Response) -> AsyncIterator[bytes]:
    """The decode instance's events, whole; an error event if it breaks off."""
    buf = b""
    try:
        async for chunk in up.aiter_bytes():
            buf += chunk
            end = buf.rfind(b"\n\n")
            if end >= 0:
                yield buf[:end + 2]
                buf = buf[end + 2:]
    except httpx.HTTPError as e:
        logger.warning("decode instance %s broke off a stream: %s", inst.url, e)
        err = {"error": {"message": f"The decode instance failed mid-stream: {type(e).__name__}: {e}",
                         "type": "server_error", "param": None, "code": "decode_instance_failed"}}
        yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        return
    if buf:
        yield buf


class _RelayResponse(StreamingResponse):
    """An SSE relay that runs ``on_close`` once whatever happens (a client gone before the
    first byte included, when the body iterator never starts)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Any) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._on_close()


def _check_routable(path: str, body: Any) -> None:
    """400 for what the two halves cannot reproduce (see the module docstring)."""
    if not isinstance(body, dict):
        raise RouterError(400, "The body must be a JSON object.", "invalid_body")
    refused = {
        "kv_transfer_params": ("is set by the router", body.get("kv_transfer_params") is not None),
        "n": ("other than 1 is not supported through the prefill-decode router", body.get("n", 1) not in (1, None)),
        "best_of": ("is not supported through the prefill-decode router", body.get("best_of") not in (None, 1)),
        "use_beam_search": ("is not supported through the prefill-decode router", bool(body.get("use_beam_search"))),
        "prompt_logprobs": ("is not supported through the prefill-decode router: the prompt is computed on the "
                            "prefill instance", body.get("prompt_logprobs") is not None),
        "thinking_token_budget": ("is not supported through the prefill-decode router",
                                  body.get("thinking_token_budget") is not None),
    }
    if path == "/v1/completions":
        prompt = body.get("prompt")
        several = isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt)
        refused["prompt"] = ("must be one prompt through the prefill-decode router (a string or a list of token "
                             "ids)", several)
        refused["echo"] = ("with logprobs is not supported through the prefill-decode router (the prompt's "
                           "logprobs are computed on the prefill instance)",
                           bool(body.get("echo")) and body.get("logprobs") is not None)
    for name, (why, bad) in refused.items():
        if bad:
            raise RouterError(400, f"'{name}' {why}.", "unsupported_by_router", param=name)


def _prefill_body(path: str, body: dict[str, Any], tid: str) -> dict[str, Any]:
    """The request a prefill instance runs: the first token only, not streamed."""
    out = dict(body, stream=False, return_token_ids=True,
               kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
    out.pop("stream_options", None)
    if path == "/v1/chat/completions" and body.get("max_completion_tokens") is not None:
        out["max_completion_tokens"] = 1
    else:
        out["max_tokens"] = 1
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 1:
        out["min_tokens"] = 1
    return out


def _prompt_token_ids(content: bytes) -> list[int] | None:
    """The prompt's token ids in a prefill instance's answer (return_token_ids: chat has them
    at the top, completions in the choice); None where it has none."""
    try:
        answer = json.loads(content)
        ids = answer.get("prompt_token_ids") or answer["choices"][0].get("prompt_token_ids")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return ids if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids) else None


def _error_message(content: bytes) -> str:
    try:
        return str(json.loads(content)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return content[:200].decode("utf-8", "replace")


async def _wait_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def build_router_app(router: PDRouter) -> FastAPI:
    app = FastAPI(title="pagoda router", description="prefill-decode disaggregation router")

    for route in ROUTES:
        async def endpoint(raw: Request, _route: str = route) -> Response:
            return await router.handle(_route, raw)

        app.add_api_route(route, endpoint, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.models()

    @app.get("/health")
    async def health() -> Response:
        return await router.health()

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(router.metrics(), media_type="text/plain; version=0.0.4")

    return app


def run_router(args: Any) -> int:
    """`pagoda router`: serve until SIGINT/SIGTERM."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = PDRouter(args.prefill, args.decode, max_attempts=args.max_attempts, cooldown_s=args.cooldown)

    async def main() -> None:
        await router.start(args.startup_timeout)
        logger.info("routing over %d prefill and %d decode instance(s)", len(args.prefill), len(args.decode))
        config = uvicorn.Config(build_router_app(router), host=args.host, port=args.port,
                                log_level=args.uvicorn_log_level)
        try:
            await uvicorn.Server(config).serve()
        finally:
            await router.close()

    asyncio.run(main())
    return 0
