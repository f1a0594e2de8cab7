"""The engine link's messages (pagoda/engine/messages.py): every kind survives the codec, and a
frame that is not one of them is a clear error."""

from __future__ import annotations

import typing

import msgspec
import pytest

from pagoda.core.outputs import EngineCoreOutput, SchedulerStats, StepRecord, TokenLogprobs
from pagoda.engine import messages
from pagoda.engine.messages import (
    Abort,
    AddLora,
    CheckIntegrity,
    Dead,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineMessage,
    Heartbeat,
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
from pagoda.lora.request import LoRARequest
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

LORA = LoRARequest("sql", 3, "/adapters/sql")
STATS = SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5, num_blocks=8, spec_accepted_per_pos=[3, 1],
                       running_lora_adapters={"sql": 1})  # fmt: skip

EXAMPLES = [
    EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=4)),
    EngineCoreRequest(
        "1_r", [5] * 20,
        SamplingParams(n=1, temperature=0.7, seed=2**63 - 1, stop=["\n"], stop_token_ids=[2], logit_bias={50: -1.5},
                       logprobs=2, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a+")),
        eos_token_ids=[2], arrival_time=12.5, priority=-(2**63), cache_salt="salt", tenant="acme", lora_request=LORA,
    ),  # fmt: skip
    Abort(["r", "1_r"]),
    Stop(["r"]),
    CheckIntegrity("tok-1"),
    AddLora("tok-2", LORA),
    RemoveLora("tok-3", 3),
    Shutdown(),
    WakeUp(7),
    EngineCoreRequest("2_r", [4], SamplingParams(max_tokens=1), ep_seq=7),
    Ready(max_model_len=2048, vocab_size=49152, num_blocks=512, block_size=64),
    EngineCoreOutputs(),
    EngineCoreOutputs(
        outputs=[EngineCoreOutput("r", [7], [TokenLogprobs(-0.5, [7, 9], [-0.5, -1.5])], num_cached_tokens=16,
                                  scheduled_time=3.25),
                 EngineCoreOutput("1_r", [2], finish_reason="stop", stop_reason=2, num_preemptions=1)],
        scheduler_stats=STATS, timestamp=4.0, step=StepRecord(7, 3.9, 0.1, [("r", 1, False), ("1_r", 20, True)]),
        kv_block_map="uuc.", expert_load=[[1, 0], [0, 1]],
    ),  # fmt: skip
    Heartbeat(scheduler_stats=STATS, timestamp=5.0),
    RequestError("1_r", "prompt token ids out of range [0, 100): [100]"),
    IntegrityResult("tok-1", None, 4242),
    IntegrityResult("tok-1", "AssertionError: block 3 has ref count -1", 4242),
    LoraResult("tok-2"),
    LoraResult("tok-3", "LoRAInUseError", "in use by 1 running or waiting request(s)"),
    Dead("Traceback (most recent call last): ..."),
]


def _kinds(union: object) -> set[type]:
    kinds: set[type] = set()
    for arg in typing.get_args(union):
        kinds |= _kinds(arg) if typing.get_origin(arg) is typing.Union else {arg}
    return kinds


def test_every_kind_has_an_example_and_its_own_tag():
    kinds = _kinds(EngineMessage)
    assert kinds == {type(m) for m in EXAMPLES}
    assert kinds == _kinds(messages.ToCore) | _kinds(messages.FromCore)
    assert not _kinds(messages.ToCore) & _kinds(messages.FromCore)
    tags = [msgspec.inspect.type_info(k).tag for k in kinds]
    assert len(set(tags)) == len(tags) and all(tags)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: messages.Message) -> None:
    frame = encode(msg)
    back = decode(frame)
    assert type(back) is type(msg) and back == msg
    # The frame names its kind; nothing but the tag and the fields is on the wire.
    assert msgspec.msgpack.decode(frame)["kind"] == msgspec.inspect.type_info(type(msg)).tag


def test_a_heartbeat_reads_like_step_outputs():
    beat = decode(encode(Heartbeat(scheduler_stats=STATS)))
    assert isinstance(beat, EngineCoreOutputs) and beat.outputs == [] and beat.scheduler_stats == STATS


@pytest.mark.parametrize(
    "frame, says",
    [
        (b"", "0 bytes"),
        (b"\xc1", "starting c1"),                                       # not msgpack at all
        (msgspec.msgpack.encode([1, 2, 3]), "Expected `object`"),       # msgpack, not a message
        (msgspec.msgpack.encode({"request_ids": ["r"]}), "missing required field `kind`"),
        (msgspec.msgpack.encode({"kind": "launch", "x": 1}), "Invalid value 'launch'"),
        (msgspec.msgpack.encode({"kind": "abort", "request_ids": "r"}), "Expected `array`, got `str`"),
        (msgspec.msgpack.encode({"kind": "add", "request_id": "r"}), "missing required field"),
    ],
)  # fmt: skip
def test_a_garbled_frame_is_a_clear_error(frame: bytes, says: str) -> None:
    with pytest.raises(MessageError, match="not an engine message") as info:
        decode(frame)
    assert says in str(info.value)
    assert isinstance(info.value, ValueError)
