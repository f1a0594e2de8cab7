"""The engine-core busy loop, run in its own process (or thread) behind ZMQ.

Frames are [kind, msgspec-msgpack payload]. In: add / abort / stop /
shutdown, check (debug: run check_integrity()) and lora (load / unload an
adapter). Out: ready (engine facts), outputs (one per step, with scheduler
stats), heartbeat (idle; stats only), error (a request the core rejected),
integrity (the answer to a check), lora_result (the answer to a lora call),
dead (a fatal error; the loop exits).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import tempfile
import time
import traceback

import msgspec
import zmq

from pagoda.config import EngineConfig
from pagoda.engine.protocol import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
IDLE_POLL_MS = 100


class EngineInfo(msgspec.Struct):
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int


_encoder = msgspec.msgpack.Encoder()
_dec_request = msgspec.msgpack.Decoder(EngineCoreRequest)
_dec_ids = msgspec.msgpack.Decoder(list[str])


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str,
                    context: zmq.Context | None = None) -> int:
    """Serve the engine core until told to shut down. Returns an exit code."""
    own_context = context is None
    ctx = context or zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    try:
        from pagoda.engine.engine_core import EngineCore

        core = EngineCore(config)
    except Exception:
        out.send_multipart([b"dead", _encoder.encode(traceback.format_exc())])
        _close(inp, out, ctx, own_context)
        return 1
    out.send_multipart([b"ready", _encoder.encode(EngineInfo(
        core.max_model_len, core.vocab_size, core.num_blocks, config.block_size))])

    last_sent = 0.0
    code = 0
    try:
        parent = os.getppid()
        while True:
            if os.getppid() != parent:
                logger.error("the API server process is gone; engine core exiting")
                break
            timeout = 0 if core.has_unfinished_requests() else IDLE_POLL_MS
            shutdown = False
            while inp.poll(timeout):
                timeout = 0
                kind, payload = inp.recv_multipart()
                if kind == b"add":
                    req = _dec_request.decode(payload)
                    try:
                        core.add_request(req)
                    except ValueError as e:
                        out.send_multipart([b"error", _encoder.encode([req.request_id, str(e)])])
                elif kind == b"abort":
                    aborted = core.abort_requests(_dec_ids.decode(payload))
                    if aborted:
                        out.send_multipart([b"outputs", _encoder.encode(EngineCoreOutputs(outputs=aborted))])
                elif kind == b"stop":
                    core.finish_stopped(_dec_ids.decode(payload))
                elif kind == b"check":
                    out.send_multipart([b"integrity", _encoder.encode(_check_integrity(core, payload))])
                elif kind == b"lora":
                    out.send_multipart([b"lora_result", _encoder.encode(_lora_call(core, payload))])
                elif kind == b"shutdown":
                    shutdown = True
                    break
            if shutdown:
                break
            core.check_health()
            if core.has_unfinished_requests():
                outputs = core.step()
                out.send_multipart([b"outputs", _encoder.encode(outputs)])
                last_sent = time.monotonic()
            elif time.monotonic() - last_sent > HEARTBEAT_INTERVAL_S:
                beat = core.idle_stats()
                out.send_multipart([b"heartbeat", _encoder.encode(beat)])
                last_sent = time.monotonic()
    except Exception:
        logger.exception("engine core failed")
        out.send_multipart([b"dead", _encoder.encode(traceback.format_exc())])
        code = 1
    core.shutdown()
    _close(inp, out, ctx, own_context)
    return code


def _check_integrity(core, payload: bytes) -> list:
    """Debug only: [token, error message or None, pid] for a ``check`` frame."""
    token = msgspec.msgpack.decode(payload)
    try:
        core.check_integrity()
        error = None
    except Exception as e:  # an AssertionError from the block pool, most likely
        error = f"{type(e).__name__}: {e}"
    return [token, error, os.getpid()]


def _lora_call(core, payload: bytes) -> list:
    """[token, error type or None, message or None] for a ``lora`` frame:
    [token, "add", name, id, path] or [token, "remove", id]."""
    from pagoda.lora.request import LoRARequest

    token, op, *args = msgspec.msgpack.decode(payload)
    try:
        if op == "add":
            core.add_lora(LoRARequest(*args))
        elif op == "remove":
            core.remove_lora(args[0])
        else:
            raise ValueError(f"unknown lora operation {op!r}")
    except ValueError as e:
        return [token, type(e).__name__, str(e)]
    return [token, None, None]


def _close(inp, out, ctx, own_context: bool) -> None:
    inp.close(linger=0)
    out.close(linger=1000)
    if own_context:
        ctx.term()


@dataclasses.dataclass
class CoreProcess:
    """A spawned engine-core process and the two ipc addresses it connects to; its
    client (AsyncLLM) binds them. `pagoda serve` starts it before importing the API
    stack, so that the two processes' imports (torch in each) overlap."""

    proc: multiprocessing.process.BaseProcess
    tmpdir: str
    input_addr: str
    output_addr: str


def start_core_process(config: EngineConfig) -> CoreProcess:
    tmpdir = tempfile.mkdtemp(prefix="pagoda-")
    in_addr, out_addr = f"ipc://{tmpdir}/input", f"ipc://{tmpdir}/output"
    proc = multiprocessing.get_context("spawn").Process(
        target=engine_core_process_main, args=(config, in_addr, out_addr), name="pagoda-engine-core", daemon=True,
    )
    proc.start()
    return CoreProcess(proc, tmpdir, in_addr, out_addr)


def engine_core_process_main(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """Entry point of the spawned engine-core process."""
    import os
    import signal
    import sys

    # The API server handles SIGINT/SIGTERM and shuts us down by message.
    # A SIGTERM sent to the whole process group (systemd, `timeout`) must not
    # kill the core before the server has drained; the server stops us by
    # message, and we exit on our own if the server process disappears.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("PAGODA_LOG_LEVEL", "INFO"),
                        format="%(asctime)s engine-core %(levelname)s %(message)s")
    from pagoda.executor.multiproc import configure_threads

    configure_threads(config)
    sys.exit(run_engine_core(config, input_addr, output_addr))
