"""The KV connector: a prefill instance's parked blocks, fetched by a decode instance.

``KVSender`` (prefill side) binds a ZMQ ROUTER endpoint (``tcp://host:port``) and serves,
from a thread of its own, the transfers the engine parked with ``send_blocks``: a decode
instance's ``fetch`` gets the blocks and their metadata (first token, block hashes, ...) and
the sender reports the transfer done (``poll_done``), after which the engine frees the
blocks. ``release`` (from the engine on abort, or a ``release`` message from a router or a
decode instance that gave up) and ``timeout_s`` without a fetch end a transfer the same way.

``KVReceiver`` (decode side) fetches from any number of prefill endpoints, from a thread of
its own (a ZMQ DEALER per endpoint); the engine polls it for arrived transfers
(``ReceivedKV``) and failures (``FetchFailed``). A prefill endpoint that disconnects or
refuses the connection fails its pending fetches at once; an unanswered fetch fails after
``timeout_s``.

The control messages always travel over the endpoint; the blocks travel by one of two
transports, which the decode side asks for per fetch:

- ``ShmTransport``: the sender gathers the blocks straight into a file in /dev/shm and
  replies with its name; the receiver maps it and unlinks it at once (the mapping stays
  until the blocks are installed). One copy on each side; one host only.
- ``TcpTransport``: the blocks are frames of the reply, gathered into tensors and sent
  without another copy; the receiver views the frames in place. Works across hosts.

``auto`` takes shm when both sides run on one machine (the same host name and boot id).

The messages are those of pagoda/kv_transfer/wire.py.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import zmq
import zmq.utils.monitor

from pagoda.kv_transfer.blocks import LayerCache, cache_parts, gather_into, install, layout_of, part_views, row_bytes
from pagoda.config.kv_transfer import check_tcp_address
from pagoda.kv_transfer.wire import FetchRequest, TransferError, TransferMeta, encode as _encode, machine_id

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_POLL_MS = 100




# ---------------------------------------------------------------------- transports
class KVTransport:
    """How a transfer's rows travel: ``pack`` (sender) -> frames after the kind and meta;
    ``unpack`` (receiver) -> one tensor per part, and what keeps their memory alive."""

    name = ""

    def pack(self, parts: Sequence[torch.Tensor], block_ids: Sequence[int],
             meta: TransferMeta) -> list[Any]:  # fmt: skip
        raise NotImplementedError

    def unpack(self, parts: Sequence[torch.Tensor], meta: TransferMeta,
               frames: Sequence[Any]) -> tuple[list[torch.Tensor], Any]:  # fmt: skip
        raise NotImplementedError


class TcpTransport(KVTransport):
    name = "tcp"

    def pack(self, parts, block_ids, meta):
        # uint8 views of contiguous tensors: zmq sends their memory without a copy.
        return [rows.view(-1).view(torch.uint8).numpy() for rows in gather_into(parts, block_ids)]

    def unpack(self, parts, meta, frames):
        if len(frames) != len(parts):
            raise TransferError(f"the reply holds {len(frames)} part frames, the cache has {len(parts)} parts")
        n = len(meta.entries)
        rows = []
        for part, frame in zip(parts, frames):
            buf = frame.buffer if isinstance(frame, zmq.Frame) else frame
            if len(buf) != row_bytes(part, n):
                raise TransferError(f"a part frame holds {len(buf)} bytes, {n} blocks of it are {row_bytes(part, n)}")
            rows.extend(part_views([part], n, buf))
        return rows, list(frames)


class ShmTransport(KVTransport):
    name = "shm"

    def __init__(self, directory: str = SHM_DIR) -> None:
        self.directory = directory

    def pack(self, parts, block_ids, meta):
        n = len(block_ids)
        size = sum(row_bytes(p, n) for p in parts)
        path = os.path.join(self.directory, f"pagoda-kv-{os.getpid()}-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if size:
                # Reserve the pages now: a full tmpfs is an OSError here, not a SIGBUS on write.
                os.posix_fallocate(fd, 0, size)
                with mmap.mmap(fd, size) as mm:
                    views = part_views(parts, n, mm)
                    gather_into(parts, block_ids, views)
                    del views
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        meta.shm_path, meta.shm_size = path, size
        return []

    def unpack(self, parts, meta, frames):
        path, size = meta.shm_path, meta.shm_size
        if not path or os.path.dirname(path) != self.directory or not os.path.basename(path).startswith("pagoda-kv-"):
            raise TransferError(f"the reply names no transfer file of ours: {path!r}")
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise TransferError(f"cannot open the transfer file {path}: {e} (shm needs both instances on one "
                                "host; use transport tcp)") from None
        try:
            # A private (copy-on-write) mapping: writable for torch, never written.
            mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) if size else b""
        finally:
            os.close(fd)
            _unlink(path)  # the mapping stays valid; nothing is left behind in /dev/shm
        n = len(meta.entries)
        if size != sum(row_bytes(p, n) for p in parts):
            raise TransferError(f"the transfer file holds {size} bytes, {n} blocks of this cache need "
                                f"{sum(row_bytes(p, n) for p in parts)}")
        return part_views(parts, n, mm), mm


TRANSPORTS: dict[str, KVTransport] = {"tcp": TcpTransport(), "shm": ShmTransport()}


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------- prefill side
@dataclass
class _Parked:
    block_ids: list[int]                    # per row
    meta: TransferMeta
    tables: list[list[int | None]]
    parked_at: float
    sending: bool = False
    released: bool = False


class KVSender:
    """The prefill side of the connector; see the module docstring."""

    def __init__(self, buffers: Sequence[LayerCache], block_size: int, host: str = "127.0.0.1", port: int = 0,
                 advertise_host: str | None = None, timeout_s: float = 30.0) -> None:  # fmt: skip
        self.parts = cache_parts(buffers)
        self.layout = layout_of(buffers)
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.machine = machine_id()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        bind_host = f"[{host}]" if ":" in host else host
        try:
            if port:
                self._sock.bind(f"tcp://{bind_host}:{port}")
            else:
                port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            raise ValueError(f"kv_transfer_config: cannot bind the KV endpoint on {host}:{port}: {e}") from None
        advertised = advertise_host or (socket.gethostname() if host in ("0.0.0.0", "::") else host)
        bracketed = f"[{advertised}]" if ":" in advertised else advertised
        self.address = check_tcp_address("the KV endpoint", f"tcp://{bracketed}:{port}")
        self._lock = threading.Lock()
        self._parked: dict[str, _Parked] = {}
        self._done: list[str] = []
        self._files: list[tuple[str, float]] = []   # shm files written, swept after timeout_s
        self._stop = threading.Event()
        self.num_sent = 0
        self.num_expired = 0
        self._thread = threading.Thread(target=self._serve, name="pagoda-kv-sender", daemon=True)
        self._thread.start()

    # ---- the engine's side (its thread) ----------------------------------------------
    def send_blocks(self, transfer_id: str, tables: Sequence[Sequence[int | None]], hashes: Sequence[bytes],
                    meta: TransferMeta) -> None:  # fmt: skip
        """Park a request's blocks (``tables``: per KV group its block table, None where a
        window released a block) until a decode instance fetches them; ``hashes``: the
        prefix-cache keys of its full blocks. The blocks must stay untouched until
        ``poll_done`` names the transfer."""
        meta.block_hashes = list(hashes)
        meta.block_size = self.block_size
        meta.layout = self.layout
        with self._lock:
            if transfer_id in self._parked:
                raise ValueError(f"transfer id {transfer_id!r} is in use")
            self._parked[transfer_id] = _Parked([], meta, [list(t) for t in tables], time.monotonic())

    def has_transfer(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._parked

    def release(self, transfer_id: str) -> None:
        """Give up a transfer (its request was aborted): done now, or once a send in
        progress ends. Unknown ids are ignored (already done)."""
        with self._lock:
            self._release_locked(transfer_id)

    def _release_locked(self, transfer_id: str) -> bool:
        parked = self._parked.get(transfer_id)
        if parked is None:
            return False
        if parked.sending:
            parked.released = True
        else:
            del self._parked[transfer_id]
            self._done.append(transfer_id)
        return True

    def poll_done(self) -> list[str]:
        """Transfers whose blocks the engine may free now (sent, released or expired)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    @property
    def has_done(self) -> bool:
        with self._lock:
            return bool(self._done)

    @property
    def num_parked(self) -> int:
        with self._lock:
            return len(self._parked)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sock.close(linger=0)
        self._ctx.term()
        for path, _ in self._files:
            _unlink(path)

    # ---- the serving thread ----------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(_POLL_MS):
                    self._handle(self._sock.recv_multipart(copy=True))
                self._expire(time.monotonic())
            except Exception:  # one bad message must not stop the endpoint
                logger.exception("KV sender: error while serving a message")

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 3:
            return
        peer, kind, body = frames[0], frames[1], frames[2]
        if kind == b"release":
            tid = msgspec.msgpack.decode(body).get("transfer_id", "")
            with self._lock:
                self._release_locked(tid)
            self._sock.send_multipart([peer, b"ok", _encode({"transfer_id": tid})])
            return
        if kind != b"fetch":
            self._sock.send_multipart([peer, b"err", _encode({"transfer_id": "", "message": f"unknown "
                                                                  f"message kind {kind[:20]!r}"})])
            return
        try:
            req = msgspec.msgpack.decode(body, type=FetchRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._sock.send_multipart([peer, b"err", _encode({"transfer_id": "", "message": str(e)})])
            return
        try:
            reply = self._reply(req)
        except Exception as e:
            logger.exception("KV sender: transfer %s failed", req.transfer_id)
            reply = [b"err", _encode({"transfer_id": req.transfer_id, "message": f"{type(e).__name__}: {e}"})]
        self._sock.send_multipart([peer, *reply], copy=False)

    def _reply(self, req: FetchRequest) -> list[Any]:
        tid = req.transfer_id
        with self._lock:
            parked = self._parked.get(tid)
            if parked is None or parked.released:
                return [b"err", _encode({"transfer_id": tid, "message": f"no parked transfer {tid!r} on "
                                             f"{self.address} (expired after {self.timeout_s:g} s, released, "
                                             "fetched already, or never parked)"})]
            parked.sending = True
        try:
            entries, block_ids = [], []
            for g, table in enumerate(parked.tables):
                for i, b in enumerate(table):
                    if b is not None and i >= req.skip_blocks:
                        entries.append((g, i))
                        block_ids.append(b)
            meta = msgspec.structs.replace(parked.meta, entries=entries)
            transport = self._transport_for(req)
            frames = transport.pack(self.parts, block_ids, meta)
            if meta.shm_path:
                self._files.append((meta.shm_path, time.monotonic()))
            reply = [transport.name.encode(), _encode(meta), *frames]
        finally:
            with self._lock:
                # Gathered (or failed): the blocks are no longer read; the engine frees them.
                self._parked.pop(tid, None)
                self._done.append(tid)
        self.num_sent += 1
        return reply

    def _transport_for(self, req: FetchRequest) -> KVTransport:
        same_host = req.machine == self.machine
        if req.transport == "shm" and not same_host:
            raise TransferError("transport shm needs both instances on one host; this prefill instance runs on "
                                f"{self.machine.split('/')[0]!r}, the decode instance on {req.machine.split('/')[0]!r}")
        if req.transport == "shm" or (req.transport == "auto" and same_host and os.path.isdir(SHM_DIR)):
            return TRANSPORTS["shm"]
        if req.transport not in ("tcp", "auto"):
            raise TransferError(f"unknown transport {req.transport!r}")
        return TRANSPORTS["tcp"]

    def _expire(self, now: float) -> None:
        with self._lock:
            for tid, parked in list(self._parked.items()):
                if not parked.sending and now - parked.parked_at > self.timeout_s:
                    del self._parked[tid]
                    self._done.append(tid)
                    self.num_expired += 1
                    logger.warning("KV transfer %s: no decode instance fetched it in %g s; its blocks are freed",
                                   tid, self.timeout_s)
        while self._files and now - self._files[0][1] > self.timeout_s:
            _unlink(self._files.pop(0)[0])  # a decode instance that died before mapping it


# ---------------------------------------------------------------------- decode side
@dataclass
class ReceivedKV:
    """An arrived transfer: its metadata and rows (one tensor per cache part, row r holding
    the block of ``meta.entries[r]``), viewing memory that ``_holder`` keeps alive."""

    request_id: str
    meta: TransferMeta
    rows: list[torch.Tensor]
    _holder: Any = field(repr=False, default=None)
    skip_blocks: int = 0    # table entries below this were not asked for (this pool's prefix cache has them)

    def row_of(self) -> dict[tuple[int, int], int]:
        return {(g, i): r for r, (g, i) in enumerate(self.meta.entries)}

    def install(self, parts: Sequence[torch.Tensor], copies: Sequence[tuple[int, int, int]]) -> None:
        """Copy the rows of (group, index, block id) ``copies`` into those blocks."""
        rows = self.row_of()
        install(parts, self.rows, [rows[(g, i)] for g, i, _ in copies], [b for _, _, b in copies])


@dataclass
class FetchFailed:
    request_id: str
    message: str


@dataclass
class _Pending:
    request_id: str
    address: str
    deadline: float


class KVReceiver:
    """The decode side of the connector; see the module docstring."""

    def __init__(self, buffers: Sequence[LayerCache], block_size: int, transport: str = "auto",
                 timeout_s: float = 30.0) -> None:  # fmt: skip
        self.parts = cache_parts(buffers)
        self.layout = layout_of(buffers)
        self.block_size = block_size
        self.transport = transport
        self.timeout_s = timeout_s
        self.machine = machine_id()
        self._ctx = zmq.Context()
        endpoint = f"inproc://pagoda-kv-recv-{uuid.uuid4().hex}"
        self._cmd_in = self._ctx.socket(zmq.PAIR)
        self._cmd_in.bind(endpoint)
        self._cmd = self._ctx.socket(zmq.PAIR)
        self._cmd.connect(endpoint)
        self._lock = threading.Lock()
        self._results: list[ReceivedKV | FetchFailed] = []
        self._num_pending = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagoda-kv-receiver", daemon=True)
        self._thread.start()

    # ---- the engine's side ------------------------------------------------------------
    def recv_blocks(self, request_id: str, transfer_id: str, remote_address: str, skip_blocks: int = 0) -> None:
        """Start fetching transfer ``transfer_id`` from the prefill endpoint ``remote_address``
        for ``request_id`` (table entries below ``skip_blocks`` are not sent); the outcome
        comes out of ``poll``."""
        with self._lock:
            self._num_pending += 1
        self._cmd.send_multipart([b"fetch", _encode([request_id, transfer_id, remote_address, skip_blocks])])

    def cancel(self, transfer_id: str) -> None:
        """Stop waiting for a transfer and tell its prefill instance to free the blocks."""
        self._cmd.send_multipart([b"cancel", transfer_id.encode()])

    def poll(self) -> list[ReceivedKV | FetchFailed]:
        with self._lock:
            out, self._results = self._results, []
            self._num_pending -= len(out)
        return out

    @property
    def has_results(self) -> bool:
        with self._lock:
            return bool(self._results)

    @property
    def busy(self) -> bool:
        """Fetches in flight or outcomes not polled yet."""
        with self._lock:
            return self._num_pending > 0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._cmd.close(linger=0)
        self._cmd_in.close(linger=0)
        self._ctx.term()

    # ---- the fetching thread ------------------------------------------------------------
    def _run(self) -> None:
        socks: dict[str, zmq.Socket] = {}
        monitors: dict[zmq.Socket, str] = {}
        pending: dict[str, _Pending] = {}
        poller = zmq.Poller()
        poller.register(self._cmd_in, zmq.POLLIN)

        def dealer(address: str) -> zmq.Socket:
            sock = socks.get(address)
            if sock is None:
                sock = socks[address] = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                if "[" in address:
                    sock.setsockopt(zmq.IPV6, 1)
                mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
                monitors[mon] = address
                sock.connect(address)
                poller.register(sock, zmq.POLLIN)
                poller.register(mon, zmq.POLLIN)
            return sock

        def fail(tid: str, message: str) -> None:
            p = pending.pop(tid, None)
            if p is not None:
                self._put(FetchFailed(p.request_id, message))

        try:
            while not self._stop.is_set():
                events = dict(poller.poll(_POLL_MS))
                if self._cmd_in in events:
                    kind, body = self._cmd_in.recv_multipart()
                    if kind == b"fetch":
                        rid, tid, address, skip = msgspec.msgpack.decode(body)
                        pending[tid] = _Pending(rid, address, time.monotonic() + self.timeout_s)
                        req = FetchRequest(tid, skip, self.transport, self.machine)
                        dealer(address).send_multipart([b"fetch", _encode(req)])
                    elif kind == b"cancel":
                        tid = body.decode()
                        p = pending.pop(tid, None)
                        if p is not None:
                            with self._lock:
                                self._num_pending -= 1
                            dealer(p.address).send_multipart([b"release", _encode({"transfer_id": tid})])
                for sock in list(socks.values()):
                    if sock in events:
                        self._on_reply(sock.recv_multipart(copy=False), pending)
                for mon, address in list(monitors.items()):
                    if mon in events:
                        event = zmq.utils.monitor.recv_monitor_message(mon)["event"]
                        what = "closed the connection" if event == zmq.EVENT_DISCONNECTED else "refused the connection"
                        for tid in [t for t, p in pending.items() if p.address == address]:
                            fail(tid, f"the prefill instance's KV endpoint {address} {what}")
                now = time.monotonic()
                for tid in [t for t, p in pending.items() if now > p.deadline]:
                    fail(tid, f"the prefill instance's KV endpoint {pending[tid].address} did not answer in "
                              f"{self.timeout_s:g} s")
        finally:
            for tid in list(pending):
                fail(tid, "the decode instance is shutting down")
            for mon in monitors:
                mon.close(linger=0)
            for sock in socks.values():
                sock.disable_monitor()
                sock.close(linger=0)

    def _on_reply(self, frames: list[zmq.Frame], pending: dict[str, _Pending]) -> None:
        kind = frames[0].bytes
        if kind == b"ok":
            return  # a release's ack
        try:
            meta = msgspec.msgpack.decode(frames[1].bytes, type=TransferMeta) if kind in (b"tcp", b"shm") else None
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.error("KV receiver: a reply that is not a transfer: %s", e)
            return
        if meta is None:
            info = msgspec.msgpack.decode(frames[1].bytes)
            p = pending.pop(info.get("transfer_id", ""), None)
            if p is not None:
                self._put(FetchFailed(p.request_id, f"the prefill instance refused the transfer: {info.get('message')}"))
            return
        p = pending.pop(meta.transfer_id, None)
        if p is None:  # cancelled meanwhile: drop it (and its file)
            if meta.shm_path:
                _unlink(meta.shm_path)
            return
        try:
            if meta.layout != self.layout or meta.block_size != self.block_size:
                raise TransferError("the prefill instance's KV cache differs from this one (model, --dtype, "
                                    "--kv-cache-dtype or --block-size): its layout "
                                    f"{meta.layout[:1]}... blocks of {meta.block_size}, "
                                    f"this one's {self.layout[:1]}... blocks of {self.block_size}")
            rows, holder = TRANSPORTS[kind.decode()].unpack(self.parts, meta, frames[2:])
        except TransferError as e:
            if meta.shm_path:
                _unlink(meta.shm_path)
            self._put(FetchFailed(p.request_id, str(e)))
            return
        self._put(ReceivedKV(p.request_id, meta, rows, holder))

    def _put(self, result: ReceivedKV | FetchFailed) -> None:
        with self._lock:
            self._results.append(result)
