"""The engine core's side of prefill-decode disaggregation (``PDTransfer``).

EngineCore calls it at five points: ``add_request`` (a request with kv_transfer_params),
``poll`` (at the start of a step), ``install`` (after scheduling), ``after_update`` (after
the step's outputs) and ``abort``.

Prefill instance: a ``do_remote_decode`` request runs as any other with ``max_tokens`` 1;
when it finishes, the scheduler parks it (``Request.kv_park``: its blocks stay held) and
``after_update`` offers the blocks with the first token to the ``KVSender``. Once the sender
reports the transfer done (fetched, released, or expired after ``timeout_s``), ``poll``
frees the blocks.

Decode instance: a ``do_remote_prefill`` request is checked and held here while the
``KVReceiver`` fetches (skipping the leading blocks this pool's prefix cache holds already).
When its KV arrives, ``poll`` checks it is this request's (same prompt tokens, same block
hashes, blocks for every position the next step reads), appends the first token, emits it,
and queues the request with the received rows (``Request.kv_received``). The scheduler
admits it like a resumed request with one token left to compute (pagoda/core/scheduler.py,
``_try_admit``), and ``install`` copies the rows into the blocks it allocated, before the
forward. A failed fetch ends the request with an error (``EngineCoreOutput.error``).

E.g. a 150-token prompt, blocks of 64: the prefill instance computes positions 0..149 in
blocks [a, b, c] and samples t0. The decode instance's request has 151 tokens with 150
computed: its table gets 3 blocks, receives a, b and c (c is partly filled), and its first
step computes position 150 (t0) and samples t1.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from pagoda.config.kv_transfer import KVTransferConfig
from pagoda.core.kv_cache_manager import cdiv
from pagoda.core.outputs import EngineCoreOutput
from pagoda.core.request import Request, RequestStatus
from pagoda.kv_transfer.blocks import LayerCache, cache_parts
from pagoda.kv_transfer.connector import FetchFailed, KVReceiver, KVSender, ReceivedKV
from pagoda.kv_transfer.wire import TransferMeta

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pagoda.core.sched_output import SchedulerOutput
    from pagoda.core.scheduler import Scheduler

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 30.0   # a decode request's grammar compiles while its KV travels; the most to wait after


class PDTransfer:
    def __init__(self, config: KVTransferConfig, scheduler: Scheduler, buffers: Sequence[LayerCache]) -> None:
        self.role = config.role
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.parts = cache_parts(buffers)
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        if config.role == "prefill":
            self.sender = KVSender(buffers, self.kv.block_size, config.host, config.port, config.advertise_host,
                                   config.timeout_s)
            logger.info("prefill instance: parked KV blocks are served on %s", self.sender.address)
        else:
            self.receiver = KVReceiver(buffers, self.kv.block_size, config.transport, config.timeout_s)
        # Prefill: request id <-> transfer id of requests that will park or are parked.
        self._transfer_of: dict[str, str] = {}
        self._request_of: dict[str, str] = {}
        # Decode: requests whose KV is on its way: request id -> (request, transfer id, skipped blocks).
        self._fetching: dict[str, tuple[Request, str, int]] = {}

    @property
    def address(self) -> str | None:
        """The prefill instance's KV endpoint (None on a decode instance)."""
        return self.sender.address if self.sender is not None else None

    # ---- requests in -------------------------------------------------------------------
    def add_request(self, request: Request) -> bool:
        """Take part in a request with kv_transfer_params: True if it is held here (its KV is
        being fetched), False if the scheduler takes it as usual. ValueError for a request
        this instance cannot serve."""
        kv = request.sampling_params.kv_transfer_params
        if kv is None:
            return False
        if self.role == "prefill":
            if not kv.do_remote_decode:
                raise ValueError("kv_transfer_params: this is a prefill instance; do_remote_prefill requests go "
                                 "to a decode instance")
            if request.sampling_params.max_tokens != 1:
                raise ValueError("kv_transfer_params.do_remote_decode needs max_tokens=1: a prefill instance "
                                 "samples the first token only")
            self._claim(kv.transfer_id, request.request_id)
            request.kv_park = True
            return False
        if not kv.do_remote_prefill:
            raise ValueError("kv_transfer_params: this is a decode instance; do_remote_decode requests go to a "
                             "prefill instance")
        rid = request.request_id
        if rid in self._fetching:
            raise ValueError(f"duplicate request id {rid!r}")
        self.scheduler.check_request(request)
        # Leading blocks this pool holds already need not travel (checked again at admission).
        _, num_cached = self.kv.get_computed_blocks(request)
        skip = num_cached // self.kv.block_size
        self._fetching[rid] = (request, kv.transfer_id, skip)
        assert self.receiver is not None
        self.receiver.recv_blocks(rid, kv.transfer_id, kv.remote_address, skip)
        return True

    def _claim(self, transfer_id: str, request_id: str) -> None:
        if transfer_id in self._request_of:
            raise ValueError(f"kv_transfer_params.transfer_id {transfer_id!r} is in use on this instance")
        self._transfer_of[request_id] = transfer_id
        self._request_of[transfer_id] = request_id

    # ---- a step --------------------------------------------------------------------------
    def poll(self) -> list[EngineCoreOutput]:
        """Free the blocks of finished transfers (prefill); take arrived KV in (decode): the
        outputs of requests that arrived (their first token) or failed."""
        if self.sender is not None:
            for tid in self.sender.poll_done():
                rid = self._request_of.get(tid)
                if rid is not None:
                    self._drop_claim(rid)
                    self.scheduler.release_parked(rid)
            return []
        outputs = []
        assert self.receiver is not None
        for result in self.receiver.poll():
            entry = self._fetching.pop(result.request_id, None)
            if entry is None:
                continue  # aborted meanwhile
            request, tid, skip = entry
            if isinstance(result, FetchFailed):
                outputs.append(_failed(request, f"KV transfer {tid} failed: {result.message}"))
                continue
            result.skip_blocks = skip
            try:
                outputs.append(self._arrived(request, result))
            except _Refused as e:
                outputs.append(_failed(request, f"KV transfer {tid}: {e}"))
        return outputs

    def _arrived(self, request: Request, received: ReceivedKV) -> EngineCoreOutput:
        meta = received.meta
        self._check(request, received)
        for token in meta.output_token_ids:
            request.append_output_token(token)
        hashes = [h.value for h in self.kv.block_hashes(request)]
        if hashes != meta.block_hashes[:len(hashes)] or len(meta.block_hashes) < len(hashes):
            raise _Refused("the received block hashes are not this request's (the prefill instance hashed "
                           "another prompt, cache salt or block size)")
        request.num_cached_tokens = meta.num_cached_tokens
        if meta.finish_reason == "stop":
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = meta.stop_reason
        else:
            request.check_stop()
        if not request.is_finished and request.grammar is not None:
            self._accept_grammar(request)
        out = EngineCoreOutput(
            request.request_id, list(meta.output_token_ids), new_logprobs=meta.logprobs,
            finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
            num_cached_tokens=meta.num_cached_tokens, scheduled_time=time.monotonic(),
        )  # fmt: skip
        if not request.is_finished:
            request.kv_received = received
            try:
                self.scheduler.add_request(request)
            except ValueError as e:
                raise _Refused(str(e)) from None
        return out

    def _check(self, request: Request, received: ReceivedKV) -> None:
        """Refuse KV that is not this request's, or that lacks a block the next step reads."""
        meta = received.meta
        if meta.prompt_token_ids != request.prompt_token_ids:
            raise _Refused("the prefill instance's prompt differs from this request's (another tokenizer, chat "
                           "template or model?)")
        if not meta.output_token_ids:
            raise _Refused("the prefill instance sent no first token")
        computed = request.num_tokens + len(meta.output_token_ids) - 1   # the tokens the KV covers
        have = set(received.row_of())
        for g in range(self.kv.num_groups):
            first = max(received.skip_blocks, self.kv._first_needed(g, computed))
            missing = [i for i in range(first, cdiv(computed, self.kv.block_size)) if (g, i) not in have]
            if missing:
                raise _Refused(f"blocks {missing[:4]} of KV group {g} were not sent")

    @staticmethod
    def _accept_grammar(request: Request) -> None:
        """The grammar compiled while the KV travelled: it takes the first token(s) before the
        request decodes on (the prefill instance sampled them under the same grammar)."""
        future, request.grammar = request.grammar, None
        try:
            request.matcher = future.result(GRAMMAR_WAIT_S)
        except Exception as e:
            raise _Refused(f"its structured output grammar did not compile: {e}") from None
        for token in request.output_token_ids:
            request.matcher.accept_token(token)
            if request.matcher.is_terminated():
                request.status = RequestStatus.FINISHED_STOPPED
                return

    @staticmethod
    def merge(arrived: list[EngineCoreOutput], outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """The step's outputs after those of requests whose KV arrived: one output per request
        (the front end reads one per step), so a request admitted in the step that took its KV in
        gets its first token and the next in one output."""
        if not arrived:
            return outputs
        first = {o.request_id: o for o in arrived}
        rest = []
        for o in outputs:
            a = first.get(o.request_id)
            if a is None:
                rest.append(o)
                continue
            a.new_token_ids = a.new_token_ids + o.new_token_ids
            if o.new_logprobs is not None:
                a.new_logprobs = (a.new_logprobs or []) + o.new_logprobs
            a.finish_reason, a.stop_reason, a.num_preemptions = o.finish_reason, o.stop_reason, o.num_preemptions
        return arrived + rest

    def install(self, sched_out: SchedulerOutput) -> None:
        """Copy the received rows of the requests admitted this step into their blocks."""
        for rid, copies in sched_out.kv_in:
            request = self.scheduler.requests[rid]
            received, request.kv_received = request.kv_received, None
            received.install(self.parts, copies)

    def after_update(self, outputs: Sequence[EngineCoreOutput]) -> None:
        """Offer the blocks of requests the step parked (prefill instance)."""
        if self.sender is None:
            return
        parked = self.scheduler.parked
        for out in outputs:
            tid = self._transfer_of.get(out.request_id) if out.finished else None
            if tid is None:
                continue
            request = parked.get(out.request_id)
            if request is None:  # ended without parking (aborted)
                self._drop_claim(out.request_id)
                continue
            tables = [[None if b is None else b.block_id for b in t] for t in self.kv.req_to_blocks[request.request_id]]
            meta = TransferMeta(tid, request.prompt_token_ids, list(request.output_token_ids), 0, [],
                                logprobs=out.new_logprobs, finish_reason=out.finish_reason if out.finish_reason ==
                                "stop" else None, stop_reason=request.stop_reason,
                                num_cached_tokens=max(request.num_cached_tokens, 0))  # fmt: skip
            self.sender.send_blocks(tid, tables, [h.value for h in self.kv.block_hashes(request)], meta)

    def abort(self, request_ids: Sequence[str]) -> list[EngineCoreOutput]:
        """Requests ended from outside (client gone): a parked transfer is released (its blocks
        freed at the next poll); a fetch in flight is cancelled, and its prefill instance told."""
        outputs = []
        for rid in request_ids:
            if self.sender is not None:
                tid = self._transfer_of.get(rid)
                if tid is not None and rid in self.scheduler.parked:
                    self.sender.release(tid)
                elif tid is not None and rid not in self.scheduler.requests:
                    self._drop_claim(rid)  # aborted before it parked (the scheduler ended it first)
            elif rid in self._fetching:
                request, tid, _ = self._fetching.pop(rid)
                assert self.receiver is not None
                self.receiver.cancel(tid)
                outputs.append(EngineCoreOutput(rid, [], finish_reason="abort"))
        return outputs

    def _drop_claim(self, request_id: str) -> None:
        tid = self._transfer_of.pop(request_id, None)
        if tid is not None:
            self._request_of.pop(tid, None)

    # ---- the core loop -------------------------------------------------------------------
    def has_work(self) -> bool:
        """Something for the next step to do: transfers to free, or KV arrived."""
        if self.sender is not None:
            return self.sender.has_done
        assert self.receiver is not None
        return self.receiver.has_results

    def has_pending(self) -> bool:
        """A decode instance waits for KV (the core loop polls more often meanwhile)."""
        return self.receiver is not None and bool(self._fetching)

    def close(self) -> None:
        for part in (self.sender, self.receiver):
            if part is not None:
                part.close()


class _Refused(Exception):
    """Received KV that cannot be used for its request."""


def _failed(request: Request, message: str) -> EngineCoreOutput:
    logger.warning("request %s: %s", request.request_id, message)
    return EngineCoreOutput(request.request_id, [], finish_reason="abort", error=message)
