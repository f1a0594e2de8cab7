"""The KV connector's messages (pagoda/kv_transfer/connector.py), without torch: the
router imports this to release parked transfers.

Multipart ZMQ messages; the first frame names the kind, the second is msgpack:
  decode/router -> prefill   ``fetch`` FetchRequest | ``release`` {"transfer_id"}
  prefill -> decode          ``tcp`` TransferMeta, part frames... | ``shm`` TransferMeta |
                             ``err`` {"transfer_id", "message"} | ``ok`` {"transfer_id"} (release ack)
"""

from __future__ import annotations

import socket
from typing import Any

import msgspec
import zmq

from pagoda.core.outputs import TokenLogprobs


class TransferMeta(msgspec.Struct, omit_defaults=True):
    """What travels with a transfer's blocks: enough for the decode side to check that they
    are the blocks of its request, and to continue it."""

    transfer_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]                 # sampled on the prefill instance (the first token)
    block_size: int
    layout: list[Any]                           # blocks.layout_of of the sender's cache
    block_hashes: list[bytes] = []              # prefix-cache keys of the full blocks, in order
    logprobs: list[TokenLogprobs] | None = None  # of output_token_ids, if the request asked
    finish_reason: str | None = None            # "stop" if the prefill instance's request ended for good
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0                  # prompt tokens the prefill instance found cached
    entries: list[tuple[int, int]] = []         # (KV group, table index) of each row sent
    shm_path: str | None = None                 # shm transport: the file holding the rows
    shm_size: int = 0


class FetchRequest(msgspec.Struct):
    transfer_id: str
    skip_blocks: int                            # leading table entries the decode side holds already
    transport: str                              # auto | shm | tcp
    machine: str                                # the decode side's machine_id()


class TransferError(RuntimeError):
    """A transfer failed; the message says why (it reaches the client in a 503)."""


def machine_id() -> str:
    """This machine: host name and kernel boot id (two processes with the same id share /dev/shm)."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


encode = msgspec.msgpack.Encoder().encode


def release_transfer(remote_address: str, transfer_id: str, timeout_s: float = 2.0) -> bool:
    """Tell a prefill endpoint to free a parked transfer (a router whose decode side failed);
    True once it acknowledged. Blocking, for a thread or an executor."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(remote_address)
        sock.send_multipart([b"release", encode({"transfer_id": transfer_id})])
        if sock.poll(int(timeout_s * 1000)):
            return sock.recv_multipart()[0] == b"ok"
        return False
    finally:
        sock.close(linger=0)
