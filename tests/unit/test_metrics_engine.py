"""Engine-side metrics: step records from the real scheduler, the KV pool picture, the
per-request timestamps on outputs, and the FLOPs/bytes estimates on each step."""

from __future__ import annotations

import msgspec

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import StepRecord
from pagoda.core.request import Request
from pagoda.core.sched_output import ModelRunnerOutput
from pagoda.core.scheduler import Scheduler, SchedulerConfig
from pagoda.engine.messages import EngineCoreOutputs
from pagoda.metrics.cost import step_cost
from pagoda.metrics.step import StepStatsCollector, kv_block_map
from pagoda.model.arch import ModelArchConfig
from pagoda.sampling_params import SamplingParams


def _sched(num_blocks: int = 32, budget: int = 16, block_size: int = 4) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=64)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size))


def _add(s: Scheduler, rid: str, prompt: list[int], max_tokens: int = 3) -> Request:
    req = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), max_model_len=64)
    s.add_request(req)
    return req


def _step(s: Scheduler, collector: StepStatsCollector, t: float = 0.0):
    so = s.schedule()
    record = collector.record_step(so, s.requests, t)
    # Fake runner: a request samples when its known tokens are all computed.
    ids = list(so.num_scheduled_tokens)
    sampled = [[7] if s.requests[r].num_computed_tokens == s.requests[r].num_tokens else [] for r in ids]
    return record, s.update_from_output(so, ModelRunnerOutput(ids, sampled))


def test_step_records_tell_prompt_chunks_from_decodes() -> None:
    s = _sched(budget=16)
    collector = StepStatsCollector(None)
    _add(s, "long", list(range(100, 124)))    # 24 tokens: a 16-token chunk, then 8
    _add(s, "short", list(range(200, 204)))
    r0, outs0 = _step(s, collector, t=1.0)
    assert r0.step_id == 0 and r0.start == 1.0
    assert r0.batch == [("long", 16, True)]
    assert outs0 == []                          # a chunk samples nothing
    r1, outs1 = _step(s, collector)
    # The last chunk of "long" samples its first token but is still prompt work.
    assert r1.batch == [("long", 8, True), ("short", 4, True)]
    assert {o.request_id for o in outs1} == {"long", "short"}
    # First outputs carry the admission time, later ones do not.
    assert all(o.scheduled_time > 0 for o in outs1)
    r2, outs2 = _step(s, collector)
    assert r2.batch == [("long", 1, False), ("short", 1, False)]
    assert all(o.scheduled_time == 0.0 for o in outs2)
    assert [r.step_id for r in (r0, r1, r2)] == [0, 1, 2]
    _, outs3 = _step(s, collector)
    assert all(o.finish_reason == "length" and o.num_preemptions == 0 for o in outs3)
    so = s.schedule()
    assert collector.record_step(so, s.requests, 0.0) is None    # nothing scheduled: no record


def test_preempted_request_reports_its_preemptions_and_recomputes_as_prompt() -> None:
    s = _sched(num_blocks=4, budget=32, block_size=4)
    collector = StepStatsCollector(None)
    _add(s, "a", list(range(100, 106)), max_tokens=8)    # 6 + 8 = 14 tokens: 4 blocks at the end
    _add(s, "b", list(range(200, 206)), max_tokens=8)
    records, outputs = [], []
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        record, outs = _step(s, collector)
        records.append(record)
        outputs += outs
    assert sum(r.num_preempted for r in records if r) >= 1
    finals = {o.request_id: o.num_preemptions for o in outputs if o.finish_reason}
    assert finals["b"] >= 1 and finals["a"] == 0
    assert sum(finals.values()) == s.num_preemptions
    # b's recompute after preemption is prompt work, though b already has outputs.
    resumed = [e for r in records if r for e in r.batch if e[0] == "b" and e[1] > 1]
    assert len(resumed) >= 2 and all(is_prompt for _, _, is_prompt in resumed)


def test_kv_block_map_marks_used_cached_and_free_blocks() -> None:
    s = _sched(num_blocks=8, block_size=4)
    collector = StepStatsCollector(None)
    _add(s, "a", list(range(100, 109)), max_tokens=1)    # 9 prompt tokens: 3 blocks, 2 full
    assert kv_block_map(s.kv.pool) == "........"
    so = s.schedule()
    assert kv_block_map(s.kv.pool).count("u") == 3
    s.update_from_output(so, ModelRunnerOutput(["a"], [[7]]))   # finishes: blocks freed, 2 keep their hash
    picture = kv_block_map(s.kv.pool)
    assert picture.count("c") == 2 and picture.count("u") == 0 and len(picture) == 8
    assert collector.maybe_block_map(s.kv.pool, now=100.0) == picture
    assert collector.maybe_block_map(s.kv.pool, now=100.5) is None     # rate limited
    assert collector.maybe_block_map(s.kv.pool, now=101.0) == picture


def test_kv_block_map_samples_big_pools() -> None:
    s = _sched(num_blocks=10_000)
    assert len(kv_block_map(s.kv.pool, max_cells=4096)) == 3334    # stride 3


def test_step_record_round_trips_through_msgpack() -> None:
    msg = EngineCoreOutputs(timestamp=1.5, step=StepRecord(3, 1.0, 0.5, [("r", 4, True)], 1, 2.0, 3.0),
                            kv_block_map="uc.")
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=EngineCoreOutputs)
    assert back == msg and back.step.batch == [("r", 4, True)]


ARCH = ModelArchConfig(
    architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True, attention_bias=False,
)


def test_collector_attaches_the_bench_cost_model_estimates() -> None:
    s = _sched(budget=16)
    collector = StepStatsCollector(ARCH, weight_bytes=2, act_bytes=4, kv_bytes=2)
    _add(s, "long", list(range(100, 124)))     # chunks of 16 then 8
    _add(s, "short", list(range(200, 204)))
    r0, _ = _step(s, collector)
    # A 16-token chunk that samples nothing: no LM head rows.
    assert (r0.flops, r0.bytes_moved) == step_cost(ARCH, 16, [0], [16], num_logits=0, weight_bytes=2,
                                                   act_bytes=4, kv_bytes=2)
    r1, _ = _step(s, collector)
    # The last chunk (8 on top of 16) and a whole 4-token prompt; both sample.
    assert (r1.flops, r1.bytes_moved) == step_cost(ARCH, 12, [16, 0], [8, 4], num_logits=2, weight_bytes=2,
                                                   act_bytes=4, kv_bytes=2)
    r2, _ = _step(s, collector)
    assert r2.flops == step_cost(ARCH, 2, [24, 4], [1, 1], weight_bytes=2, act_bytes=4, kv_bytes=2)[0]
    assert r2.flops < r1.flops
