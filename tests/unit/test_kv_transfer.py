"""The KV connector (pagoda/kv_transfer/connector.py) on its own: blocks parked by a sender,
fetched by a receiver over each transport, must arrive bit-exactly with their metadata
(block hashes, first token, logprobs); releases, timeouts and a vanished sender end a
transfer on both sides."""

from __future__ import annotations

import os
import time

import pytest
import torch

from pagoda.attention.kv_quant import QuantizedKVCache
from pagoda.config.kv_transfer import KVTransferConfig, KVTransferParams
from pagoda.core.outputs import TokenLogprobs
from pagoda.kv_transfer.blocks import cache_parts
from pagoda.kv_transfer.connector import FetchFailed, KVReceiver, KVSender, ReceivedKV
from pagoda.kv_transfer.wire import TransferMeta, release_transfer

BLOCK = 4


def _float_buffers(num_blocks: int = 12, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, BLOCK, 2, 8, generator=g) for _ in range(3)]


def _int8_buffers(num_blocks: int = 12, seed: int = 0) -> list[QuantizedKVCache]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        c = QuantizedKVCache(num_blocks, BLOCK, 2, 8, torch.int8, "cpu")
        c.data.copy_(torch.randint(-127, 128, c.data.shape, generator=g, dtype=torch.int8))
        c.scales.copy_(torch.rand(c.scales.shape, generator=g))
        out.append(c)
    return out


def _meta(tid: str) -> TransferMeta:
    lp = [TokenLogprobs(-0.25, [7, 3], [-0.25, -1.5], 1)]
    return TransferMeta(tid, prompt_token_ids=list(range(13)), output_token_ids=[7], block_size=0, layout=[],
                        logprobs=lp, num_cached_tokens=4)


def _wait(receiver: KVReceiver, timeout: float = 10.0) -> ReceivedKV | FetchFailed:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = receiver.poll()
        if out:
            assert len(out) == 1
            return out[0]
        time.sleep(0.005)
    raise AssertionError("no outcome from the receiver")


def _wait_done(sender: KVSender, tid: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tid in sender.poll_done():
            return
        time.sleep(0.01)
    raise AssertionError(f"transfer {tid} never reported done")


@pytest.fixture
def pair():
    made = []

    def make(src, dst, transport="auto", timeout_s=30.0):
        sender = KVSender(src, BLOCK, timeout_s=timeout_s)
        receiver = KVReceiver(dst, BLOCK, transport=transport, timeout_s=timeout_s)
        made.extend([sender, receiver])
        return sender, receiver

    yield make
    for x in made:
        x.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("kind", ["float", "int8"])
def test_blocks_round_trip_bit_exactly(pair, transport, kind):
    make = _float_buffers if kind == "float" else _int8_buffers
    src, dst = make(seed=1), make(seed=2)
    sender, receiver = pair(src, dst, transport)
    # Two KV groups; the second (windowed) released its first two blocks.
    tables = [[3, 7, 1, 9], [None, None, 4, 5]]
    hashes = [bytes([i]) * 32 for i in range(3)]
    sender.send_blocks("t1", tables, hashes, _meta("t1"))
    receiver.recv_blocks("req-1", "t1", sender.address, skip_blocks=1)
    got = _wait(receiver)
    assert isinstance(got, ReceivedKV), got
    assert got.request_id == "req-1"
    assert got.meta.block_hashes == hashes
    assert got.meta.output_token_ids == [7] and got.meta.prompt_token_ids == list(range(13))
    assert got.meta.logprobs == _meta("t1").logprobs and got.meta.num_cached_tokens == 4
    assert got.meta.entries == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3)]   # entry 0 skipped, None ones absent
    src_ids = [7, 1, 9, 4, 5]
    for part_src, rows in zip(cache_parts(src), got.rows):
        assert torch.equal(rows, part_src[:, src_ids])
    # Installing into the decode side's own blocks copies them exactly.
    copies = [(0, 1, 10), (0, 3, 2), (1, 2, 0)]
    got.install(cache_parts(dst), copies)
    for part_src, part_dst in zip(cache_parts(src), cache_parts(dst)):
        assert torch.equal(part_dst[:, [10, 2, 0]], part_src[:, [7, 9, 4]])
    _wait_done(sender, "t1")  # sent: the prefill side may free the blocks
    assert sender.num_parked == 0
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"pagoda-kv-{os.getpid()}-")]


def test_shm_transport_refused_across_machines(pair):
    sender, receiver = pair(_float_buffers(), _float_buffers(), "shm")
    receiver.machine = "elsewhere/boot"
    sender.send_blocks("t2", [[0, 1]], [], _meta("t2"))
    receiver.recv_blocks("r", "t2", sender.address)
    got = _wait(receiver)
    assert isinstance(got, FetchFailed) and "one host" in got.message
    _wait_done(sender, "t2")


@pytest.mark.parametrize("same_machine", [True, False])
def test_auto_transport_takes_shm_on_one_machine_else_tcp(pair, same_machine):
    src = _float_buffers()
    sender, receiver = pair(src, _float_buffers(seed=3), "auto")
    if not same_machine:
        receiver.machine = "elsewhere/boot"
    sender.send_blocks("t3", [[5, 6]], [], _meta("t3"))
    receiver.recv_blocks("r", "t3", sender.address)
    got = _wait(receiver)
    assert isinstance(got, ReceivedKV) and (got.meta.shm_path is not None) == same_machine
    assert torch.equal(got.rows[0], src[0][:, [5, 6]])


def test_layout_mismatch_fails_the_fetch(pair):
    sender, receiver = pair(_float_buffers(), _int8_buffers())
    sender.send_blocks("t4", [[0]], [], _meta("t4"))
    receiver.recv_blocks("r", "t4", sender.address)
    got = _wait(receiver)
    assert isinstance(got, FetchFailed) and "differs" in got.message


def test_release_and_timeout_end_a_parked_transfer(pair):
    sender, receiver = pair(_float_buffers(), _float_buffers(), timeout_s=0.5)
    sender.send_blocks("a", [[0]], [], _meta("a"))
    sender.send_blocks("b", [[1]], [], _meta("b"))
    sender.send_blocks("c", [[2]], [], _meta("c"))
    with pytest.raises(ValueError, match="in use"):
        sender.send_blocks("a", [[3]], [], _meta("a"))
    sender.release("a")                                       # the engine aborted its request
    assert "a" in sender.poll_done()
    assert release_transfer(sender.address, "b")             # a router gave up on it
    _wait_done(sender, "b")
    _wait_done(sender, "c", timeout=5)                        # nobody fetched it in timeout_s
    assert sender.num_expired == 1
    receiver.recv_blocks("r", "a", sender.address)           # too late: a clear error
    got = _wait(receiver)
    assert isinstance(got, FetchFailed) and "no parked transfer" in got.message


def test_a_vanished_sender_fails_the_fetch_fast(pair):
    sender, receiver = pair(_float_buffers(), _float_buffers())
    address = sender.address
    sender.close()
    start = time.monotonic()
    receiver.recv_blocks("r", "gone", address)
    got = _wait(receiver)
    assert isinstance(got, FetchFailed) and "refused" in got.message
    assert time.monotonic() - start < 5


def test_cancel_releases_the_transfer_on_the_sender(pair):
    sender, receiver = pair(_float_buffers(), _float_buffers())
    receiver.recv_blocks("r", "never-parked", sender.address)
    receiver.cancel("never-parked")
    sender.send_blocks("x", [[0]], [], _meta("x"))
    receiver.recv_blocks("r2", "x", sender.address)
    got = _wait(receiver)
    assert isinstance(got, ReceivedKV) and got.request_id == "r2"
    assert not receiver.busy


def test_params_and_config_are_checked():
    p = KVTransferParams.parse({"do_remote_prefill": True, "transfer_id": "x1", "remote_address": "tcp://h:5"})
    assert p.remote_address == "tcp://h:5"
    with pytest.raises(ValueError, match="exactly one"):
        KVTransferParams.parse({"transfer_id": "x"})
    with pytest.raises(ValueError, match="unknown key"):
        KVTransferParams.parse({"do_remote_decode": True, "transfer_id": "x", "bogus": 1})
    with pytest.raises(ValueError, match="remote_address"):
        KVTransferParams.parse({"do_remote_prefill": True, "transfer_id": "x", "remote_address": "http://h:1"})
    decode = {"do_remote_prefill": True, "transfer_id": "x", "remote_address": "tcp://h:5"}
    assert KVTransferParams.parse({**decode, "prompt_token_ids": [3, 0, 9]}).prompt_token_ids == [3, 0, 9]
    for bad in ([], [1, -2], [1, "2"], "1 2", [True]):
        with pytest.raises(ValueError, match="prompt_token_ids must be a non-empty list"):
            KVTransferParams.parse({**decode, "prompt_token_ids": bad})
    with pytest.raises(ValueError, match="given to a decode instance"):
        KVTransferParams.parse({"do_remote_decode": True, "transfer_id": "x", "prompt_token_ids": [1]})
    assert KVTransferConfig.parse("decode", '{"transport": "tcp"}').transport == "tcp"
    with pytest.raises(ValueError, match="does not apply to a decode"):
        KVTransferConfig.parse("decode", {"port": 5})
    with pytest.raises(ValueError, match="needs --kv-role"):
        KVTransferConfig.parse(None, {"port": 5})
