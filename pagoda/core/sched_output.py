"""What the scheduler tells the model runner each step.

New requests (and requests resumed after preemption) are sent whole; requests
the runner already knows are sent as a diff: their new blocks and progress.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.core.outputs import TokenLogprobs
from pagoda.pooling import PoolingParams
from pagoda.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]     # non-empty when resumed after preemption
    sampling_params: SamplingParams
    block_ids: list[list[int]]      # its block table per KV group (pagoda/core/kv_layout.py)
    num_computed_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    lora_int_id: int = 0            # 0 = the base model
    pooling_params: PoolingParams | None = None   # an embedding request: pool, never sample
    state_slot: int = -1            # a hybrid model's state slot (pagoda/core/state_pool.py); -1: none
    state_restore: int = -1         # a prefix hit's saved state to start from (StateCheckpoints entry); -1: none
    state_swap_in: int = -1         # swapped in: the host state slot its state comes back from; -1: none
    mm_inputs: list = field(default_factory=list)   # its images (pagoda.multimodal.ImageInput)


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[list[int]]  # per KV group, the entries appended to its table
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # req_id -> tokens to compute this step, in batch order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests the runner must forget (finished, aborted or preempted since the last step).
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests under a grammar that sample this step (their logits get masked).
    structured_req_ids: list[str] = field(default_factory=list)
    # Speculative decoding: req_id -> draft slots reserved this step (included in
    # num_scheduled_tokens). The runner proposes at most this many drafts.
    num_spec_tokens: dict[str, int] = field(default_factory=dict)
    # Swap preemption: copy these KV blocks before the forward, out first, then in.
    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (host block, device block)
    # A hybrid model's swapped-out states, copied before the slots are reused this step.
    state_swap_out: list[tuple[int, int]] = field(default_factory=list)   # (state slot, host state slot)
    # Prefill-decode disaggregation: requests admitted with KV received from a prefill instance,
    # each with the (KV group, table index, block id) its received rows go to before the forward.
    kv_in: list[tuple[str, list[tuple[int, int, int]]]] = field(default_factory=list)
    # A hybrid model's prefix cache: req_id -> (block end - chunk start, checkpoint entry) of
    # the states its chunk saves (pagoda/core/state_pool.py's StateCheckpoints).
    state_writes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per scheduled request: [] for a request still inside its
    # prompt (a prefill chunk samples nothing), else the sampled token(s).
    sampled_token_ids: list[list[int]]
    # Per request: None, or one TokenLogprobs (or a (logprob, top ids, top logprobs) tuple)
    # per sampled token.
    logprobs: list[list[TokenLogprobs | tuple[float, list[int], list[float]]] | None] | None = None
    # Speculative decoding: req_id -> drafts verified this step (requests with at
    # least one). Its sampled_token_ids hold the kept drafts plus one target token.
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    # prompt_logprobs: req_id -> (the first prompt position scored, one entry per position
    # from there), for requests whose prompt chunk ran this step and asked for them.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Embedding requests whose prompt ended this step: req_id -> the pooled vector.
    pooled: dict[str, list[float]] = field(default_factory=dict)
