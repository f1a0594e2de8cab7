"""Run the real HTTP server (uvicorn) in a background thread for tests.

    with start_server(engine, served_model_name="m", api_key="k") as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="k")

The server listens on a port the OS picks on 127.0.0.1 (the socket is bound here, so
there is no window in which another process could take the port), runs its own event
loop in the thread, and is stopped, with any in-flight requests aborted, on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from pagoda.entrypoints.openai.api_server import ServerConfig
from pagoda.entrypoints.openai.server import PagodaServer, create_server

DEFAULT_MODEL_NAME = "pagoda-test"
_STARTUP_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 20.0

T = TypeVar("T")


@dataclass
class RunningServer:
    base_url: str
    server: PagodaServer
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the server's event loop (e.g. engine calls) and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def begin_shutdown(self, timeout: float | None = None) -> None:
        """What SIGTERM does: drain (new requests 503), then stop."""
        self.loop.call_soon_threadsafe(self.server.begin_shutdown, timeout)


@contextlib.contextmanager
def running_server(
    engine: Any,
    *,
    shutdown_engine: bool = False,
    shutdown_timeout: float = 5.0,
    uvicorn_log_level: str = "warning",
    **build_app_kwargs: Any,
) -> Iterator[RunningServer]:
    """Like start_server, yielding the RunningServer. ``shutdown_engine``: await engine.shutdown()
    on the server's loop once it stops (for engines bound to that loop)."""
    served_model_name = build_app_kwargs.pop("served_model_name", DEFAULT_MODEL_NAME)
    server = create_server(engine, ServerConfig(
        served_model_name, host="127.0.0.1", port=0, shutdown_timeout=shutdown_timeout,
        uvicorn_log_level=uvicorn_log_level, **build_app_kwargs,
    ))  # fmt: skip
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    loops: list[asyncio.AbstractEventLoop] = []
    errors: list[BaseException] = []

    async def main() -> None:
        loops.append(asyncio.get_running_loop())
        try:
            await server.serve(sockets=[sock])
        finally:
            if shutdown_engine:
                await engine.shutdown()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:  # reported to the test thread
            errors.append(e)

    thread = threading.Thread(target=run, name=f"pagoda-test-server-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while not server.started:
        if errors or not thread.is_alive():
            sock.close()
            raise RuntimeError(f"test server failed to start: {errors[0] if errors else 'thread exited'}")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("test server did not start in time")
        time.sleep(0.005)
    running = RunningServer(f"http://127.0.0.1:{port}", server, loops[0], thread)
    try:
        yield running
    finally:
        if thread.is_alive():
            # Abort whatever is still running so that uvicorn need not wait for it.
            running.loop.call_soon_threadsafe(server.state.stop_all, "shutdown")
        server.should_exit = True
        thread.join(_STOP_TIMEOUT_S)
        sock.close()
        if thread.is_alive():
            raise RuntimeError("test server did not stop")
        if errors:
            raise RuntimeError(f"test server failed: {errors[0]!r}") from errors[0]


@contextlib.contextmanager
def start_server(engine: Any, **build_app_kwargs: Any) -> Iterator[str]:
    """Serve ``engine`` on 127.0.0.1 (a free port) in a thread; yields the base URL (no /v1)."""
    with running_server(engine, **build_app_kwargs) as running:
        yield running.base_url


def sse_events(body: str) -> list[Any]:
    """The events of a text/event-stream body: parsed JSON objects, and "[DONE]" as a string."""
    import json

    events: list[Any] = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), f"not an SSE data event: {block!r}"
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


@contextlib.contextmanager
def real_engine_server(engine_config: Any = None, **server_kwargs: Any) -> Iterator[tuple[Any, RunningServer]]:
    """The bundled model in an AsyncLLM (``engine_config``, an EngineConfig; default: no
    progress bar, 1024 KV blocks, 2048 tokens) behind a real server on loopback, both
    stopped on exit. ``server_kwargs``: running_server's (served_model_name, api_key, ...)."""
    from pagoda.config import EngineConfig
    from pagoda.engine.async_llm import AsyncLLM

    config = engine_config or EngineConfig(show_progress=False, num_kv_blocks=1024, max_model_len=2048)
    engine = AsyncLLM.from_config(config)
    with running_server(engine, shutdown_engine=True, **server_kwargs) as running:
        yield engine, running


@contextlib.contextmanager
def serve_process(args: list[str], env: dict[str, str], timeout: float = 240.0) -> Iterator[tuple[Any, str]]:
    """`pagoda serve ARGS` in a process of its own on a free port: (the process, its base URL)
    once /health answers 200; SIGTERM on exit, and a clean exit asserted."""
    import subprocess
    import sys

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.entrypoints.cli", "serve", *args, "--port", str(port),
                             "--disable-log-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"pagoda serve exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "pagoda serve did not become healthy in time"
            time.sleep(0.2)
        yield proc, base
    finally:
        proc.send_signal(15)
        proc.wait(90)
    assert proc.returncode == 0, proc.stderr.read()[-3000:]
