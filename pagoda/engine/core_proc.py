"""The engine-core busy loop, run in its own process (or thread) behind ZMQ.

Each frame is one message of pagoda/engine/messages.py (which lists them all): requests,
aborts, stops, integrity checks, LoRA calls and shutdown come in; Ready, step outputs,
heartbeats, request errors, the answers to checks and LoRA calls, and Dead go out.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import tempfile
import time
import traceback

import zmq

from pagoda.config import EngineConfig
from pagoda.engine.messages import (
    Abort,
    AddLora,
    CheckIntegrity,
    Dead,
    EngineCoreOutputs,
    EngineCoreRequest,
    IntegrityResult,
    LoraResult,
    MessageError,
    Ready,
    RemoveLora,
    RequestError,
    Shutdown,
    Stop,
    WakeUp,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
IDLE_POLL_MS = 100
KV_POLL_MS = 5      # while a decode instance waits for KV blocks (pagoda/kv_transfer)


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
        out.send(encode(Dead(traceback.format_exc())))
        _close(inp, out, ctx, own_context)
        return 1
    out.send(encode(Ready(core.max_model_len, core.vocab_size, core.num_blocks, config.block_size,
                           core.pooler_config, core.kv_transfer.address if core.kv_transfer else None)))

    code = 0
    try:
        if core.ep_group is not None:
            _serve_expert_parallel(core, inp, out)
        else:
            _serve(core, inp, out)
    except Exception:
        logger.exception("engine core failed")
        out.send(encode(Dead(traceback.format_exc())))
        code = 1
    core.shutdown()
    _close(inp, out, ctx, own_context)
    return code


def _serve(core, inp, out) -> None:
    """The loop of an engine core on its own: step while it has requests, else wait for input."""
    last_sent = 0.0
    parent = os.getppid()
    while True:
        if _parent_gone(parent):
            return
        timeout = 0 if core.has_unfinished_requests() else KV_POLL_MS if core.has_pending_transfers() else IDLE_POLL_MS
        for msg in _inputs(inp, timeout):
            if isinstance(msg, EngineCoreRequest):
                _add_request(core, msg, out)
            elif _handle(core, msg, out):
                return
        core.check_health()
        if core.has_unfinished_requests():
            out.send(encode(core.step()))
            last_sent = time.monotonic()
        elif time.monotonic() - last_sent > HEARTBEAT_INTERVAL_S:
            out.send(encode(core.idle_stats()))
            last_sent = time.monotonic()


def _serve_expert_parallel(core, inp, out) -> None:
    """The loop of a replica in an expert-parallel group (docs/parallel.md): every MoE layer's
    exchange is a collective of the group, so all replicas run the same number of forward
    passes. They do it in waves. Idle, a replica waits on its input like any engine core;
    a request, or a WakeUp for a request number not yet accounted for, starts a wave. In
    a wave, each iteration: take the input without waiting, then one all-gather of
    [has unfinished requests, requests received so far, highest request number seen];
    the wave ends on every replica at once when no replica has unfinished requests and
    the requests received add up to the highest number seen (none is on its way). Else
    every replica steps (EngineCore.step_expert_parallel: its own step, or a dummy pass
    through the MoE exchanges), unless none has requests (a request still on its way:
    nothing to run). Aborts, stops and the other calls are answered without a wave."""
    group = core.ep_group
    received = highest = 0   # requests received here; the highest request number seen here
    accounted = 0            # the highest number the group had seen when the last wave ended
    in_wave, anyone_busy = False, False
    last_sent = 0.0
    parent = os.getppid()
    while True:
        if _parent_gone(parent):
            return
        timeout = (0 if anyone_busy else 1) if in_wave else IDLE_POLL_MS
        for msg in _inputs(inp, timeout):
            if isinstance(msg, EngineCoreRequest):
                if msg.ep_seq < 1:
                    raise MessageError(f"request {msg.request_id!r} came without its expert-parallel group number "
                                       "(ep_seq): an expert-parallel replica takes requests only through "
                                       "DataParallelLLM")
                received += 1
                highest = max(highest, msg.ep_seq)
                in_wave = True
                _add_request(core, msg, out)
            elif isinstance(msg, WakeUp):
                highest = max(highest, msg.seq)
                in_wave = in_wave or msg.seq > accounted
            elif _handle(core, msg, out):
                return
        core.check_health()
        stepped = False
        if in_wave:
            rows = group.all_gather_ints([int(core.has_unfinished_requests()), received, highest])
            anyone_busy = any(r[0] for r in rows)
            top = max(r[2] for r in rows)
            if not anyone_busy and sum(r[1] for r in rows) == top:
                in_wave, accounted = False, top
            elif anyone_busy:
                result = core.step_expert_parallel()
                if result is not None:
                    out.send(encode(result))
                    last_sent = time.monotonic()
                    stepped = True
        if not stepped and time.monotonic() - last_sent > HEARTBEAT_INTERVAL_S:
            out.send(encode(core.idle_stats()))
            last_sent = time.monotonic()


def _parent_gone(parent: int) -> bool:
    """Whether the API server process that started this one is gone (logged once)."""
    if os.getppid() == parent:
        return False
    logger.error("the API server process is gone; engine core exiting")
    return True


def _inputs(inp, timeout: int):
    """The messages waiting on ``inp``: the first waited for up to ``timeout`` ms, the rest
    taken while they are there."""
    while inp.poll(timeout):
        timeout = 0
        yield decode(inp.recv())


def _add_request(core, msg: EngineCoreRequest, out) -> None:
    try:
        core.add_request(msg)
    except ValueError as e:
        out.send(encode(RequestError(msg.request_id, str(e))))


def _handle(core, msg, out) -> bool:
    """Any message but a request; True for Shutdown (leave the loop)."""
    if isinstance(msg, Abort):
        aborted = core.abort_requests(msg.request_ids)
        if aborted:
            out.send(encode(EngineCoreOutputs(outputs=aborted)))
    elif isinstance(msg, Stop):
        core.finish_stopped(msg.request_ids)
    elif isinstance(msg, CheckIntegrity):
        out.send(encode(_check_integrity(core, msg)))
    elif isinstance(msg, (AddLora, RemoveLora)):
        out.send(encode(_lora_call(core, msg)))
    elif isinstance(msg, Shutdown):
        return True
    elif isinstance(msg, WakeUp):
        pass   # an engine core outside an expert-parallel group has no lockstep to join
    else:
        raise MessageError(f"the engine core does not take {type(msg).__name__} messages")
    return False


def _check_integrity(core, msg: CheckIntegrity) -> IntegrityResult:
    """Debug only: the answer to a CheckIntegrity."""
    try:
        core.check_integrity()
        error = None
    except Exception as e:  # an AssertionError from the block pool, most likely
        error = f"{type(e).__name__}: {e}"
    return IntegrityResult(msg.token, error, os.getpid())


def _lora_call(core, msg: AddLora | RemoveLora) -> LoraResult:
    """Load or unload an adapter; a ValueError (a bad adapter, one in use) goes back by name."""
    try:
        if isinstance(msg, AddLora):
            core.add_lora(msg.lora_request)
        else:
            core.remove_lora(msg.lora_int_id)
    except ValueError as e:
        return LoraResult(msg.token, type(e).__name__, str(e))
    return LoraResult(msg.token)


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


def ipc_addresses() -> tuple[str, str, str]:
    """A fresh folder and the engine core's input and output ipc addresses in it."""
    tmpdir = tempfile.mkdtemp(prefix="pagoda-")
    return tmpdir, f"ipc://{tmpdir}/input", f"ipc://{tmpdir}/output"


def start_core_process(config: EngineConfig) -> CoreProcess:
    tmpdir, in_addr, out_addr = ipc_addresses()
    proc = multiprocessing.get_context("spawn").Process(
        target=engine_core_process_main, args=(config, in_addr, out_addr), name="pagoda-engine-core", daemon=True,
    )
    proc.start()
    return CoreProcess(proc, tmpdir, in_addr, out_addr)


def engine_core_process_main(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """Entry point of the spawned engine-core process."""
    import signal
    import sys

    # The API server handles SIGINT/SIGTERM and shuts us down by message.
    # A SIGTERM sent to the whole process group (systemd, `timeout`) must not
    # kill the core before the server has drained; the server stops us by
    # message, and we exit on our own if the server process disappears.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(serve_engine_core(config, input_addr, output_addr))


def serve_engine_core(config: EngineConfig, input_addr: str, output_addr: str) -> int:
    """The engine-core process's body: a spawned process's, or a Ray actor's
    (pagoda/engine/ray_dp.py). Returns the exit code."""
    logging.basicConfig(level=os.environ.get("PAGODA_LOG_LEVEL", "INFO"),
                        format="%(asctime)s engine-core %(levelname)s %(message)s")
    from pagoda.executor.multiproc import configure_threads

    configure_threads(config)
    return run_engine_core(config, input_addr, output_addr)
