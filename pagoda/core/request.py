"""A request as the engine core sees it: token ids, progress and status."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from pagoda.core.block_hash import BlockHash
    from pagoda.lora.request import LoRARequest
    from pagoda.multimodal.inputs import ImageInput
    from pagoda.pooling import PoolingParams
    from pagoda.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3      # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 4       # max_tokens or the context length
    FINISHED_ABORTED = 5      # client gone, timeout, shutdown

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence to generate.

    There is no prefill or decode phase: the scheduler only compares
    ``num_computed_tokens`` with ``num_tokens``. A fresh request has
    ``num_tokens = len(prompt)``, ``num_computed_tokens = 0``; after its prompt
    is computed and a token sampled it has ``num_tokens = len(prompt) + 1`` and
    ``num_computed_tokens = len(prompt)``, so the next step computes one token.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        mm_inputs: Sequence[ImageInput] = (),
        background: bool = False,
    ) -> None:
        """``pooling_params``: an embedding request, which computes its prompt, has it
        pooled, and finishes (its ``sampling_params`` are then a placeholder). ``background``:
        work that yields to every other request (a batch's lines, OpenAI's flex tier): it waits
        behind them, is preempted for them, and its prompt chunks leave them the budget."""
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.background = background
        self.cache_salt = cache_salt
        self.tenant = tenant
        # Leading prompt tokens of an operator-declared shared prefix: their blocks are
        # hashed without the cache salt (see KVCacheManager.block_hashes).
        self.num_shared_prefix_tokens = 0
        # Long-prefill fairness: the token count at which this request's prefill ends
        # while it counts as a long prefill in progress (0: not a long prefill).
        self.long_prefill_end = 0
        # Swap preemption: the host blocks holding this request's KV while it waits, and
        # where each came from: (KV group, table index).
        self.host_block_ids: list[int] = []
        self.state_slot = -1   # a hybrid model's state slot while running (pagoda/core/state_pool.py)
        self.host_state = -1   # swapped out: the host slot holding its state
        self.state_tail = None  # the block hash of its last saved state past the checkpoint grid
        self.host_block_places: list[tuple[int, int]] = []
        self.lora_request = lora_request
        self.pooling_params = pooling_params
        # Images in (pagoda/multimodal): their spans join the prefix cache's block hashes.
        self.mm_inputs = list(mm_inputs)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Overlapped steps: tokens being sampled by steps in flight (not in all_token_ids yet;
        # the next step may compute the position of each: the model runner takes the token
        # from the step before on the device).
        self.num_pending = 0
        # Prompt tokens found in the prefix cache when first scheduled.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # time.monotonic() when first admitted to running (queue time ends); kept across preemption.
        self.first_scheduled_time: float | None = None
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[BlockHash] = []
        # Structured output: a Future while the grammar compiles, then a matcher.
        self.grammar = None
        self.matcher = None
        # Prefill-decode disaggregation (pagoda/kv_transfer): on a prefill instance, keep the
        # blocks when the request finishes (parked for a decode instance); on a decode
        # instance, the KV received from the prefill instance (a ReceivedKV), installed into
        # the request's blocks when it is admitted.
        self.kv_park = False
        self.kv_received = None
        # Generation stops at max_tokens or when the context is full.
        limit = sampling_params.max_tokens
        if max_model_len is not None:
            room = max_model_len - len(prompt_token_ids)
            limit = room if limit is None else min(limit, room)
        if limit is None:
            raise ValueError("max_tokens must be set when the context length is unknown")
        self.max_output_tokens = limit

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def overlappable(self) -> bool:
        """Whether a step may compute this request's next position before the token there is
        known: nothing that samples it reads the output history on the host (penalties,
        min_tokens, a grammar) and nothing but tokens comes out (no pooling, no prompt
        logprobs)."""
        p = self.sampling_params
        return (self.pooling_params is None and self.matcher is None and self.grammar is None
                and p.prompt_logprobs is None and p.min_tokens == 0 and p.repetition_penalty == 1.0
                and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Set a finished status if the last token ends the request."""
        params = self.sampling_params
        n_out = self.num_output_tokens
        last = self.output_token_ids[-1]
        if n_out >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if params.stop_token_ids and last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if n_out >= self.max_output_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
