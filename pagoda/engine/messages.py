"""The messages between the engine's front end (API process) and its core: the whole protocol.

Each ZMQ frame is one msgpack-encoded message, a msgspec struct tagged by its ``kind``
field; ``decode`` reads any of them with one decoder of the tagged union
``EngineMessage`` and raises MessageError for a frame that is none of them. The
structs the core reports inside EngineCoreOutputs (per-request outputs, scheduler
stats, step records) are defined in ``pagoda.core.outputs``.

Front end -> core (``ToCore``):

- ``add``       EngineCoreRequest: one sequence to generate (one per sample of a request), or to embed
- ``abort``     Abort: end requests now; the core answers with their final outputs
- ``stop``      Stop: end requests whose stop string the front end matched
- ``check``     CheckIntegrity: debug, run check_integrity() between steps; answered by ``integrity``
- ``lora_add``  AddLora: load an adapter; answered by ``lora_result``
- ``lora_rm``   RemoveLora: unload an adapter; answered by ``lora_result``
- ``shutdown``  Shutdown: leave the loop
- ``wake``      WakeUp: expert parallelism across replicas: another replica of the group got
                request number ``seq``; this one joins the group's lockstep steps (core_proc)

Core -> front end (``FromCore``):

- ``ready``       Ready: the engine's facts, once, when the core has started
- ``outputs``     EngineCoreOutputs: one per step (and the final outputs of aborted requests)
- ``heartbeat``   Heartbeat: stats alone, about twice a second while idle
- ``error``       RequestError: the core rejected a request
- ``integrity``   IntegrityResult: the answer to a ``check``
- ``lora_result`` LoraResult: the answer to ``lora_add`` / ``lora_rm``
- ``dead``        Dead: a fatal error (a traceback); the core's loop has exited

The same structs serve the in-process paths: the offline LLM hands EngineCoreRequest to
EngineCore.add_request directly, and gets EngineCoreOutputs back from EngineCore.step.
"""

from __future__ import annotations

from typing import Union

import msgspec

from pagoda.core.outputs import EngineCoreOutput, SchedulerStats, StepRecord
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import ImageInput
from pagoda.pooling import PoolerConfig, PoolingParams
from pagoda.sampling_params import SamplingParams

__all__ = [
    "Abort", "AddLora", "CheckIntegrity", "Dead", "EngineCoreOutputs", "EngineCoreRequest", "EngineMessage",
    "FromCore", "Heartbeat", "IntegrityResult", "LoraResult", "MessageError", "Ready", "RemoveLora",
    "RequestError", "Shutdown", "Stop", "ToCore", "WakeUp", "decode", "encode",
]  # fmt: skip


class Message(msgspec.Struct, tag_field="kind", omit_defaults=True):
    """Base of every engine message; each subclass sets its ``kind`` tag."""


# ---- front end -> core ---------------------------------------------------------------------


class EngineCoreRequest(Message, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    tenant: str | None = None
    lora_request: LoRARequest | None = None
    # An embedding request: pooled and finished after its prompt (sampling_params: a placeholder).
    pooling_params: PoolingParams | None = None
    # Expert parallelism across data-parallel replicas: the request's number within the group
    # (1, 2, ...; every other replica gets a WakeUp with it). 0: no such group.
    ep_seq: int = 0
    # Images in: each image's pixels and the prompt span its embeddings fill (pagoda/multimodal).
    mm_inputs: list[ImageInput] = []
    # Yields to every other request (a batch's lines, the flex tier): pagoda/core/scheduler.py.
    background: bool = False


class Abort(Message, tag="abort"):
    request_ids: list[str]


class Stop(Message, tag="stop"):
    """Requests that matched a stop string (the core knows only token ids)."""

    request_ids: list[str]


class CheckIntegrity(Message, tag="check"):
    token: str                      # echoed by the IntegrityResult


class AddLora(Message, tag="lora_add"):
    token: str                      # echoed by the LoraResult
    lora_request: LoRARequest


class RemoveLora(Message, tag="lora_rm"):
    token: str                      # echoed by the LoraResult
    lora_int_id: int


class Shutdown(Message, tag="shutdown"):
    pass


class WakeUp(Message, tag="wake"):
    """Expert parallelism across data-parallel replicas: request ``seq`` of the group went to
    another replica; this one must step in lockstep with it (pagoda/engine/core_proc.py)."""

    seq: int


# ---- core -> front end ---------------------------------------------------------------------


class Ready(Message, tag="ready"):
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    pooler: PoolerConfig | None = None   # an embedding engine's pooling; None: it generates
    kv_address: str | None = None        # a prefill instance's KV endpoint (pagoda/kv_transfer)


class EngineCoreOutputs(Message, tag="outputs"):
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


class Heartbeat(EngineCoreOutputs, tag="heartbeat"):
    """An idle core's stats (no step, no outputs); read like EngineCoreOutputs."""


class RequestError(Message, tag="error"):
    request_id: str                 # the core's (child) request id
    message: str


class IntegrityResult(Message, tag="integrity"):
    token: str
    error: str | None               # None: every invariant holds
    engine_pid: int


class LoraResult(Message, tag="lora_result"):
    token: str
    error_type: str | None = None   # the exception's class name ("LoRAInUseError", ...), None on success
    message: str | None = None


class Dead(Message, tag="dead"):
    reason: str                     # the traceback


ToCore = Union[EngineCoreRequest, Abort, Stop, CheckIntegrity, AddLora, RemoveLora, Shutdown, WakeUp]
FromCore = Union[Ready, EngineCoreOutputs, Heartbeat, RequestError, IntegrityResult, LoraResult, Dead]
EngineMessage = Union[ToCore, FromCore]


class MessageError(ValueError):
    """A frame that is not an engine message, or a message the receiving side does not take."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EngineMessage)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes) -> EngineMessage:
    try:
        return _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        head = bytes(frame[:16]).hex(" ")
        raise MessageError(f"not an engine message ({len(frame)} bytes, starting {head or 'empty'}): {e}") from None
