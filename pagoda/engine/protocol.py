"""Messages between the engine front end and the engine core.

They are msgspec structs so that the same objects serve the in-process client
and the ZMQ link to an engine-core process. What the core reports inside them
(per-request outputs, scheduler stats, step records) is defined in
``pagoda.core.outputs``.
"""

from __future__ import annotations

import msgspec

from pagoda.core.outputs import EngineCoreOutput, SchedulerStats, StepRecord
from pagoda.lora.request import LoRARequest
from pagoda.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    tenant: str | None = None
    lora_request: LoRARequest | None = None


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    # time.monotonic() in the engine core when the step ended. CLOCK_MONOTONIC is
    # system-wide, so the front end can subtract its own monotonic timestamps.
    timestamp: float = 0.0
    step: StepRecord | None = None
    # A sampled picture of the KV block pool, sent about once a second: one char per
    # sampled block, "u" in use, "c" free but still holding a cached prefix, "." free.
    kv_block_map: str | None = None
    # MoE models, about once a second: per MoE layer, tokens routed to each expert since start.
    expert_load: list[list[int]] | None = None
