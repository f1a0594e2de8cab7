"""What the engine core reports: per-request outputs of a step, the scheduler's
stats, and a record of the step itself.

They live here, under the scheduler that fills them, so that ``pagoda.core`` needs
nothing from the engine; ``pagoda.engine.messages`` carries them over the ZMQ link
inside its ``EngineCoreOutputs`` message. They are msgspec structs for that reason.
"""

from __future__ import annotations

import msgspec


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprob of one token (sampled, or a prompt token) and the top alternatives at its
    position; ``rank``: 1 + the tokens more likely than it (None where not computed);
    ``tracked_*``: the request's logprob_token_ids at this position."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    rank: int | None = None
    tracked_token_ids: list[int] = []
    tracked_logprobs: list[float] = []
    tracked_ranks: list[int] = []


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None        # "stop" | "length" | "abort"
    stop_reason: int | str | None = None    # the stop token id, if one ended it
    num_cached_tokens: int = 0
    # For metrics. Set only on the request's first output: when the scheduler first
    # admitted it (time.monotonic(), comparable with the front end's arrival time).
    scheduled_time: float = 0.0
    # Set only on the final output: how often the request was preempted.
    num_preemptions: int = 0
    # prompt_logprobs: entries for prompt positions prompt_logprobs_start, +1, ... (position
    # i's entry is about prompt token i, computed from position i - 1's logits; 0 has none).
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_start: int = 0
    # An embedding request's only output: its pooled (and normalised) vector.
    pooled: list[float] | None = None
    # The request failed (finish_reason "abort"): why. The front end raises it to the caller;
    # set where the core gives up on a request mid-way (a KV transfer, pagoda/kv_transfer).
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_blocks: int = 0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0     # cumulative, tokens
    prefix_cache_hits: int = 0        # cumulative, tokens
    num_preemptions: int = 0          # cumulative
    step_batch_size: int = 0          # requests scheduled in the last step
    step_num_tokens: int = 0          # tokens computed in the last step
    num_steps: int = 0                # cumulative
    # Speculative decoding, cumulative: verification rounds with >= 1 draft, drafts
    # proposed, drafts accepted, and accepted counts per draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    num_swap_preemptions: int = 0     # cumulative: preemptions that swapped rather than recomputed
    num_swapped_out_blocks: int = 0   # cumulative
    num_swapped_in_blocks: int = 0    # cumulative
    num_host_blocks: int = 0
    num_free_host_blocks: int = 0
    # A hybrid model's state slots (one per running request), the states its prefix cache
    # keeps, and prefix hits that started from one (cumulative).
    num_state_slots: int = 0
    num_free_state_slots: int = 0
    num_saved_states: int = 0
    num_state_restores: int = 0
    # A vision-language model's encoder cache (cumulative): lookups answered from it, images
    # encoded, and seconds in the encoder.
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0
    encoder_seconds: float = 0.0
    # LoRA: adapter name -> requests running / waiting with it.
    running_lora_adapters: dict[str, int] = {}
    waiting_lora_adapters: dict[str, int] = {}


class StepRecord(msgspec.Struct, array_like=True, omit_defaults=True):
    """One engine step, for metrics and the dashboard's batching timeline."""

    step_id: int
    start: float                          # time.monotonic() when the step began
    duration: float                       # seconds: schedule + model + update
    # (request id, tokens computed, is_prompt), in batch order. is_prompt: the tokens
    # were prompt tokens (a chunk, a whole prompt, or a recompute after preemption)
    # rather than the one token sampled last step.
    batch: list[tuple[str, int, bool]] = []
    num_preempted: int = 0
    flops: float = 0.0                    # estimated (pagoda/metrics/cost.py)
    bytes_moved: float = 0.0              # estimated: weights + KV read + KV written
