"""The benchmark's own arithmetic on synthetic timelines, its datasets, its SSE client
(against a mock transport) and the step cost model."""

from __future__ import annotations

import asyncio
import json
import math
import statistics

import httpx
import pytest
import torch

from pagoda.bench import datasets as ds
from pagoda.bench.client import RequestSpec, arrival_delays, build_payload, send_request
from pagoda.metrics.cost import linear_params_per_layer, step_cost, step_cost_breakdown
from pagoda.bench.latency import summarize_iteration
from pagoda.bench.metrics import (
    RequestResult, compute_metrics, itl_from_chunk_times, meets_slos, parse_goodput, percentile, summarize, tpot,
)
from pagoda.model.arch import ModelArchConfig
from pagoda.ops import cpu_kernels


def req(start: float, chunks: list[float], end: float, out: int, prompt: int = 10, ok: bool = True) -> RequestResult:
    return RequestResult(success=ok, error="" if ok else "HTTP 500: boom", prompt_len=prompt, output_tokens=out,
                         output_tokens_source="usage", start_time=start, chunk_times=chunks, end_time=end)


# ---------------------------------------------------------------- percentiles and summaries

def test_percentile_matches_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 90) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_summarize_in_ms_with_median_and_percentiles():
    s = summarize([0.1, 0.2, 0.3, 0.4], percentiles=(50, 90, 99))
    assert s["mean"] == pytest.approx(250.0)
    assert s["median"] == pytest.approx(250.0)
    assert "p50" not in s                      # the median already says it
    assert s["p90"] == pytest.approx(370.0)
    assert s["std"] == pytest.approx(statistics.pstdev([100, 200, 300, 400]))
    assert math.isnan(summarize([])["p99"])


# ---------------------------------------------------------------- per-request timelines

def test_itl_ttft_tpot_e2e_from_chunk_timestamps():
    r = req(10.0, [10.5, 10.6, 10.8, 11.1], 11.2, out=4)
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2el == pytest.approx(1.2)
    assert r.tpot == pytest.approx((1.2 - 0.5) / 3)
    assert itl_from_chunk_times([1.0]) == []


def test_tpot_counts_tokens_not_chunks():
    # Two chunks carried 6 tokens (a server that packs tokens): TPOT uses the token count.
    r = req(0.0, [1.0, 2.0], 2.0, out=6)
    assert r.itl == [1.0]
    assert r.tpot == pytest.approx(1.0 / 5)
    assert tpot(2.0, 1.0, 1) is None and tpot(2.0, None, 5) is None


def test_compute_metrics_on_a_synthetic_run():
    results = [
        req(0.0, [0.2, 0.3, 0.4], 0.4, out=3, prompt=10),   # ttft .2, tpot .1
        req(0.0, [0.6, 0.8, 1.0], 1.0, out=3, prompt=20),   # ttft .6, tpot .2
        req(0.1, [], 0.3, out=0, ok=False),
    ]
    m = compute_metrics(results, duration_s=2.0, slos={"ttft": 0.5})
    assert (m["completed"], m["failed"], m["num_requests"]) == (2, 1, 3)
    assert m["errors"] == {"HTTP 500: boom": 1}
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(18.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(400.0)
    assert m["tpot_ms"]["median"] == pytest.approx(150.0)
    assert m["itl_ms"]["mean"] == pytest.approx(150.0)      # gaps .1 .1 .2 .2
    assert m["e2el_ms"]["p99"] == pytest.approx(400 + 600 * 0.99)
    assert m["goodput"]["good_requests"] == 1                # only the first meets TTFT <= 500 ms
    assert m["goodput"]["request_goodput"] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        compute_metrics(results, 0.0)


def test_goodput_slos():
    assert parse_goodput(["ttft:500", "TPOT:50", "e2el:2000"]) == {"ttft": 0.5, "tpot": 0.05, "e2el": 2.0}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    good = req(0.0, [0.1, 0.2], 0.3, out=3)                 # ttft .1, tpot .1, e2el .3
    assert meets_slos(good, {"ttft": 0.1, "tpot": 0.1, "e2el": 0.3})
    assert not meets_slos(good, {"tpot": 0.09})
    assert not meets_slos(req(0.0, [], 0.3, out=0, ok=False), {})
    assert meets_slos(req(0.0, [0.1], 0.1, out=1), {"tpot": 0.001})   # one token: no TPOT to miss


def test_arrival_delays():
    assert arrival_delays(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    poisson = arrival_delays(20000, 4.0, 1.0, 0)
    assert statistics.mean(poisson) == pytest.approx(0.25, rel=0.05)
    assert statistics.pstdev(poisson) / statistics.mean(poisson) == pytest.approx(1.0, rel=0.05)
    bursty = arrival_delays(20000, 4.0, 0.25, 0)             # same mean, CV = 1/sqrt(shape) = 2
    assert statistics.mean(bursty) == pytest.approx(0.25, rel=0.1)
    assert statistics.pstdev(bursty) / statistics.mean(bursty) == pytest.approx(2.0, rel=0.1)
    assert arrival_delays(5, 2.0, 1.0, 7) == arrival_delays(5, 2.0, 1.0, 7)  # the seed fixes the gaps
    assert arrival_delays(5, 2.0, 1.0, 7) != arrival_delays(5, 2.0, 1.0, 8)  # and another seed changes them
    with pytest.raises(ValueError):
        arrival_delays(1, 0.0, 1.0, 0)


# ---------------------------------------------------------------- SSE client on a mock server

def _sse(events: list[object]) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _send(handler, spec: RequestSpec, payload: dict) -> RequestResult:
    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_request(client, spec, payload, count_tokens=lambda t: len(t.split()))
    return asyncio.run(go())


def test_client_reads_chunks_and_usage():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        body = _sse([{"choices": [{"text": "a"}]}, {"choices": [{"text": ""}]}, {"choices": [{"text": " b"}]},
                     {"choices": [{"text": " c", "finish_reason": "length"}]},
                     {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}}, "[DONE]"])
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    spec = RequestSpec("http://x/v1/completions", "m", chat=False, ignore_eos=True)
    payload = build_payload(spec, ds.Turn("hi", 4), [], 4)
    r = _send(handler, spec, payload)
    assert seen["stream"] and seen["stream_options"] == {"include_usage": True} and seen["ignore_eos"] is True
    assert r.success and r.generated_text == "a b c"
    assert len(r.chunk_times) == 3                           # the empty chunk carries no text
    assert (r.output_tokens, r.prompt_len, r.output_tokens_source) == (4, 7, "usage")
    assert r.start_time <= r.chunk_times[0] <= r.chunk_times[-1] <= r.end_time


def test_client_chat_without_usage_and_errors():
    def handler(request: httpx.Request) -> httpx.Response:
        body = _sse([{"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": "x y"}}]},
                     "[DONE]"])
        return httpx.Response(200, content=body)

    spec = RequestSpec("http://x/v1/chat/completions", "m", chat=True)
    payload = build_payload(spec, ds.Turn("q2", 8), [("q1", "a1")], 8)
    assert [m["content"] for m in payload["messages"]] == ["q1", "a1", "q2"]
    r = _send(handler, spec, payload)
    assert r.success and (r.output_tokens, r.output_tokens_source) == (2, "tokenizer")

    r = _send(lambda request: httpx.Response(429, content=b'{"error": "busy"}'), spec, payload)
    assert not r.success and r.error.startswith("HTTP 429")
    r = _send(lambda request: httpx.Response(200, content=_sse([{"error": {"message": "x"}}])), spec, payload)
    assert not r.success and "stream error" in r.error


# ---------------------------------------------------------------- datasets

@pytest.fixture(scope="module")
def sampler() -> ds.TextSampler:
    from pagoda.config import EngineConfig
    from pagoda.tokenizer import load_tokenizer

    return ds.TextSampler(load_tokenizer(EngineConfig()), seed=0)


def test_random_lengths_in_range(sampler):
    convs = ds.random_dataset(sampler, 20, 64, 32, range_ratio=0.25)
    assert ds.length_range(64, 0.25) == (48, 80)
    for c in convs:
        (t,) = c.turns
        assert 48 <= t.prompt_len <= 80 and 24 <= t.output_len <= 40
        assert len(sampler.encode(t.prompt)) == t.prompt_len
    assert len({c.turns[0].prompt for c in convs}) == 20
    exact = ds.random_dataset(sampler, 5, 50, 10)
    assert all(c.turns[0].prompt_len == 50 and c.turns[0].output_len == 10 for c in exact)


def test_prefix_shares_exactly_the_prefix(sampler):
    convs = ds.prefix_dataset(sampler, 6, prefix_len=100, input_len=20, output_len=8)
    ids = [sampler.encode(c.turns[0].prompt) for c in convs]
    first = ids[0][:100]
    for x, c in zip(ids, convs):
        assert x[:100] == first                     # the same 100 tokens...
        assert len(x) == 120 == c.turns[0].prompt_len
    assert len({tuple(x[100:]) for x in ids}) == 6  # ...then six different suffixes


def test_multiturn_and_history(sampler):
    convs = ds.multiturn_dataset(sampler, 3, num_turns=4, input_len=10, output_len=5)
    assert [len(c.turns) for c in convs] == [4, 4, 4]
    assert all(t.prompt_len == 10 for c in convs for t in c.turns)
    text = ds.completion_history([("u1", " a1")], "u2")
    assert text == "User: u1\nAssistant: a1\nUser: u2\nAssistant:"
    assert ds.chat_history([], "u")[0] == {"role": "user", "content": "u"}


def test_jsonl(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "hello there", "output_len": 3}\n\n{"messages": [{"role": "user", "content": "x"}]}\n'
                 '{"prompt": "third"}\n')
    convs = ds.jsonl_dataset(str(p), 2, output_len=9)
    assert [c.turns[0].output_len for c in convs] == [3, 9]
    assert convs[1].turns[0].messages == [{"role": "user", "content": "x"}]
    assert len(ds.jsonl_dataset(str(p), None, 9)) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no"}\n')
    with pytest.raises(ValueError):
        ds.jsonl_dataset(str(bad), None, 9)


# ---------------------------------------------------------------- cost model and latency summary

ARCH = ModelArchConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                       rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192, tie_word_embeddings=True,
                       attention_bias=False)


def test_step_cost_counts():
    p_lin = linear_params_per_layer(ARCH)
    assert p_lin == 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536
    d = step_cost_breakdown(ARCH, 4, [10, 10, 10, 10])      # four decodes, 10 cached tokens each
    assert d["flops_linear"] == 2 * 4 * p_lin * 30
    assert d["flops_attention"] == 4 * 9 * 64 * (4 * 11) * 30
    assert d["flops_lm_head"] == 2 * 4 * 576 * 49152
    # One prefill of 8 tokens: queries see 1..8 keys.
    assert step_cost_breakdown(ARCH, 8, [0])["flops_attention"] == 4 * 9 * 64 * 36 * 30
    assert step_cost(ARCH, 8, [0]) == step_cost(ARCH, 8, [0], [8])
    with pytest.raises(ValueError):
        step_cost(ARCH, 5, [0, 0])                           # ambiguous without query_lens
    flops, nbytes = step_cost(ARCH, 5, [0, 0], [2, 3])
    assert flops > 0 and nbytes > 0


def test_step_cost_shapes_the_roofline():
    # Decode of one token moves every weight once: intensity < 1 FLOP/B (fp32);
    # a long prefill reuses them across tokens and is far more intense.
    flops, nbytes = step_cost(ARCH, 1, [128])
    assert nbytes > linear_params_per_layer(ARCH) * 30 * 4
    assert flops / nbytes < 1.0
    f2, b2 = step_cost(ARCH, 512, [0])
    assert f2 / b2 > 50 * flops / nbytes
    # Batching decodes raises intensity; quantised weights move fewer bytes.
    assert step_cost_breakdown(ARCH, 64, [128] * 64)["intensity"] > 20 * flops / nbytes
    assert step_cost(ARCH, 1, [128], weight_bytes=0.625)[1] < nbytes / 3


def test_latency_iteration_summary():
    steps = [{"kind": "prefill", "time_s": 0.5, "num_tokens": 256, "batch_size": 2},
             {"kind": "decode", "time_s": 0.1, "num_tokens": 2, "batch_size": 2},
             {"kind": "decode", "time_s": 0.3, "num_tokens": 2, "batch_size": 2}]
    s = summarize_iteration(steps, 2)
    assert s["total_s"] == pytest.approx(0.9) and s["prefill_s"] == pytest.approx(0.5)
    assert (s["num_prefill_steps"], s["num_decode_steps"], s["prefill_tokens"]) == (1, 2, 256)
    assert s["decode_step_ms"]["median"] == pytest.approx(200.0)
    assert s["decode_tokens_per_s"] == pytest.approx(4 / 0.4)


@pytest.mark.parametrize("quantization, kv_cache_dtype, want", [
    ("none", "auto", torch.float32), ("int8", "auto", torch.float16), ("none", "int8", torch.int8)])
def test_roofline_steps_run_on_the_engines_kv_cache(tiny_llama_dir, default_model_path, quantization,
                                                    kv_cache_dtype, want):
    """The roofline times steps against the KV cache the engine would use (float16 in the
    quantized modes, 8 bits with scales for --kv-cache-dtype int8) and counts its bytes.
    (int8 calibrates on a text, so it needs a model with a tokenizer: the default one.)"""
    from pagoda.attention.kv_quant import QuantizedKVCache
    from pagoda.bench.roofline import StepTimer
    from pagoda.config import EngineConfig

    model = default_model_path if quantization == "int8" else tiny_llama_dir
    config = EngineConfig(model=model, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    timer = StepTimer(config, 5 * config.block_size)
    assert timer.kv_dtype == want
    cache = timer.kv_caches[0]
    assert (cache.data.dtype if isinstance(cache, QuantizedKVCache) else cache.dtype) == want
    assert timer.kv_bytes_per_element == {torch.float32: 4.0, torch.float16: 2.0}.get(
        want, 1.0 + 4.0 / timer.arch.head_dim)
    assert timer.decode_kernel == (cpu_kernels.kernels() is not None)
    assert timer.time_step([1] * 4, [20] * 4, 0.0) > 0      # decodes
    assert timer.time_step([24], [0], 0.0) > 0              # a prompt


def test_roofline_counts_the_int8_weights_a_step_reads_once():
    """int8 layers packed for AVX-512 VNNI hold a second copy of their weights; the
    roofline's bytes count the copy the steps read, about one byte per weight either way."""
    from pagoda.bench.roofline import linear_weight_bytes_per_element
    from pagoda.model.layers.quantization import Int8Linear

    torch.manual_seed(0)
    model = torch.nn.Sequential(Int8Linear(torch.nn.Linear(576, 128), outliers=torch.arange(16)))
    per_weight = linear_weight_bytes_per_element(model)
    assert 1.0 <= per_weight < 1.2, per_weight


def test_step_cost_of_moe_and_windowed_layers():
    """A MoE layer costs its router and k experts per token and reads the experts its tokens
    pick; a windowed layer attends to at most its window."""
    import dataclasses

    moe = dataclasses.replace(ARCH, architecture="Qwen3MoeForCausalLM", num_hidden_layers=2, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=256, qk_norm="head")
    h, q, kv = 576, 9 * 64, 3 * 64
    p_attn = h * (q + 2 * kv) + q * h
    one = step_cost_breakdown(moe, 1, [10])
    assert one["flops_linear"] == 2 * 2 * (p_attn + h * 8 + 2 * 3 * h * 256)
    # One token reads its 2 experts of 8 per layer; 64 tokens read (nearly) all 8.
    dense_reads = (2 * p_attn + 2 * h * 8) * 4 + (h + 5 * h) * 4    # and the embedding row, 5 norms
    assert one["bytes_weights"] - dense_reads - 49152 * h * 4 == pytest.approx(2 * 2 * 3 * h * 256 * 4, rel=1e-3)
    many = step_cost_breakdown(moe, 64, [0] * 64)
    assert many["bytes_weights"] > one["bytes_weights"] + 2 * 5.9 * 3 * h * 256 * 4
    windowed = dataclasses.replace(ARCH, architecture="MistralForCausalLM", num_hidden_layers=1, sliding_window=4)
    # A 10-token prompt: queries see 1, 2, 3, 4, 4, ... 4 keys.
    assert step_cost_breakdown(windowed, 10, [0])["flops_attention"] == 4 * 9 * 64 * (1 + 2 + 3 + 4 * 7)
    assert step_cost_breakdown(windowed, 1, [100])["flops_attention"] == 4 * 9 * 64 * 4
