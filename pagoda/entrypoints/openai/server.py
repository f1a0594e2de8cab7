"""Running the app under uvicorn, with a graceful shutdown on SIGTERM / SIGINT.

uvicorn's own shutdown closes the listening socket at once, so a client arriving
during the drain gets "connection refused" and cannot tell a restart from a crash;
and uvicorn re-raises the signal after serving, so the process would exit 143. We
replace its signal handling: the first signal starts a drain during which the server
keeps listening but answers new requests 503, in-flight requests get up to
``shutdown_timeout`` seconds to finish, the rest are aborted (their engine requests
freed, streaming clients told with an error event), and ``serve`` returns normally
so that the process exits 0. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn

from pagoda.engine.client import EngineClient
from pagoda.entrypoints.openai.api_server import ServerConfig, build_app
from pagoda.entrypoints.openai.batch.service import BatchService
from pagoda.entrypoints.openai.request_group import ServerState

logger = logging.getLogger(__name__)

# After aborting the stragglers, how long to give their handlers to send the error out.
_ABORT_GRACE_S = 5.0
_POLL_S = 0.05


class PagodaServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float,
                 batches: BatchService | None = None) -> None:  # fmt: skip
        super().__init__(config)
        self.state = state
        # The Batch API's worker (--file-storage-path): started with the server, resuming
        # unfinished batches; stopped after the drain (what is in flight then runs again later).
        self.batches = batches
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        if self.batches is not None:
            self.batches.start(self.config.app)
        try:
            await super().serve(sockets)
        finally:
            if self.batches is not None:
                await self.batches.stop()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as the signal handler, between two bytecodes of the main thread: only hand over.
        # Deliberately not recording the signal, which would make uvicorn re-raise it at the end.
        loop = self._loop
        if loop is None or not self.started or self.state.draining:
            self.force_exit = self.state.draining  # a second signal: stop without waiting
            self.should_exit = True
            if loop is not None:
                loop.call_soon_threadsafe(self.state.stop_all, "shutdown")
            return
        logger.info("received signal %d: draining (up to %g s)", sig, self.shutdown_timeout)
        loop.call_soon_threadsafe(self.begin_shutdown)

    def begin_shutdown(self, timeout: float | None = None) -> None:
        """Start the drain (call on the server's loop; a no-op when already draining)."""
        if self.state.draining:
            return
        self.state.draining = True
        loop = asyncio.get_running_loop()
        self._drain_task = loop.create_task(self._drain(self.shutdown_timeout if timeout is None else timeout))

    async def _drain(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.state.num_active_http > 0 and loop.time() < deadline:
            await asyncio.sleep(_POLL_S)
        if self.state.num_active_http > 0:
            logger.warning("shutdown timeout: aborting %d request(s) still running", self.state.num_active_http)
            self.state.stop_all("shutdown")
            grace = loop.time() + _ABORT_GRACE_S
            while self.state.num_active_http > 0 and loop.time() < grace:
                await asyncio.sleep(_POLL_S)
        self.should_exit = True


def create_server(engine: EngineClient, config: ServerConfig) -> PagodaServer:
    app = build_app(engine, config)
    uv = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.uvicorn_log_level, lifespan="off",
        # Our drain already waited for requests; this only bounds uvicorn's final connection wait.
        timeout_graceful_shutdown=int(_ABORT_GRACE_S),
    )  # fmt: skip
    return PagodaServer(uv, app.state.pagoda, config.shutdown_timeout, app.state.batches)


async def serve(
    engine: EngineClient, config: ServerConfig, *, sock: socket.socket | None = None, shutdown_engine: bool = True
) -> None:
    """Serve until SIGTERM/SIGINT, drain (see the module docstring), then return.

    ``sock``: an already bound socket to serve on instead of binding host:port (e.g. port 0
    bound by the caller, who then knows the port). ``shutdown_engine``: shut the engine down
    once the server has stopped.
    """
    server = create_server(engine, config)
    try:
        await server.serve(sockets=[sock] if sock is not None else None)
    finally:
        if shutdown_engine:
            await engine.shutdown()
