"""Pipeline parallelism on CPU (gloo): stages in their own processes against one process.

Greedy outputs must match one process token for token (batches may form differently with
several micro-batches in flight, so a genuine fp32 near-tie is excused, as for TP: see
helpers.compare_greedy); each stage must hold only its own layers' weights and KV cache;
a stage's worker that dies ends the in-flight requests with an error and turns /health red;
the expert load the engine reports covers every stage's MoE layers, as one process counts it.
"""

from __future__ import annotations

from typing import Any

import pytest

from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig
from pagoda.model.layers.pipeline import StagePlan, split_layers
from pagoda.ops import cpu_kernels
from tests.conftest import _save_tiny, _tiny_family, _tiny_llama_config
from tests.model.helpers import compare_greedy, logprob_gap
# Rank 0 of a parallel engine runs in the test process and sets one thread per rank.
from tests.model.test_tensor_parallel import _restore_threads  # noqa: F401 (an autouse fixture)


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory) -> str:
    """Three layers (2 + 1 on two stages), an LM head of its own."""
    config = _tiny_llama_config(tie_word_embeddings=False)
    config.num_hidden_layers = 3
    return _save_tiny(tmp_path_factory, "tiny-llama3", config)


# ---- the plan ---------------------------------------------------------------------------


def test_split_layers():
    assert split_layers(5, 2) == [(0, 3), (3, 5)]
    assert split_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert split_layers(5, 2, "1,4") == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        split_layers(2, 3)
    for bad in ("2,2", "5,0", "1,2,2", "a,b"):
        with pytest.raises(ValueError, match="PAGODA_PP_LAYER_PARTITION"):
            split_layers(5, 2, bad)


def test_stage_plan_reads_only_its_tensors():
    first, last = (StagePlan.build(5, s, 2, tie_word_embeddings=True, partition="") for s in range(2))
    assert (first.layers, last.layers) == ((0, 3), (3, 5))
    assert first.holds("model.layers.2.mlp.down_proj.weight") and not last.holds("model.layers.2.mlp.down_proj.weight")
    assert last.holds("model.layers.4.self_attn.q_proj.weight") and not first.holds("model.layers.4.input_layernorm.weight")
    assert first.holds("model.embed_tokens.weight") and not first.holds("lm_head.weight")
    assert not first.holds("model.norm.weight") and last.holds("model.norm.weight")
    # A tied LM head: the last stage reads the embedding's tensor as its head.
    assert last.holds("model.embed_tokens.weight") and last.rename("model.embed_tokens.weight") == "lm_head.weight"
    assert first.rename("model.embed_tokens.weight") == "model.embed_tokens.weight"
    untied = StagePlan.build(5, 1, 2, tie_word_embeddings=False, partition="")
    assert not untied.holds("model.embed_tokens.weight") and untied.holds("lm_head.weight")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size"),
    ({"quantization": "int8"}, "--quantization int8"),
    ({"quantization": "q4"}, "--quantization q4"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "--speculative-config"),
    ({"enable_lora": True}, "--enable-lora"),
    ({"kv_cache_dtype": "int8"}, "--kv-cache-dtype int8"),
    ({"preemption_mode": "swap", "swap_space": 1 << 20}, "--preemption-mode swap"),
    ({"data_parallel_size": 2}, "--data-parallel-size"),
    ({"task": "embed"}, "--task embed"),
])
def test_pipeline_parallel_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{"pipeline_parallel_size": 2, **kwargs})


def test_cli_pipeline_parallel_size():
    from pagoda.entrypoints.cli import build_parser, config_from_args

    for cmd in ("serve", "generate"):
        c = config_from_args(build_parser().parse_args([cmd, "--pipeline-parallel-size", "2", "-tp", "2"]))
        assert (c.pipeline_parallel_size, c.tensor_parallel_size, c.world_size) == (2, 2, 4)


# ---- the engine -------------------------------------------------------------------------

_PROMPTS = [list(range(3, 9)), list(range(20, 61)), [7] * 19, list(range(100, 133))]
# A second round: the long prompt again with another tail (its first block from the prefix cache).
_AGAIN = [list(range(20, 61)) + [5, 6, 7], list(range(300, 310))]


class _InFlight:
    """Counts the steps rank 0 has started (``submit``) and not finished (``collect``)."""

    def __init__(self, executor) -> None:
        self.now = self.most = 0
        self.sizes: list[int] = []   # requests per step sent
        submit, collect = executor.submit, executor.collect

        def counted_submit(so, *args):
            self.now += 1
            self.most = max(self.most, self.now)
            self.sizes.append(len(so.num_scheduled_tokens))
            return submit(so, *args)

        def counted_collect(batch):
            self.now -= 1
            return collect(batch)

        executor.submit, executor.collect = counted_submit, counted_collect


def _run(path: str, tp: int = 1, pp: int = 1, **kw) -> tuple[list, list, Any]:
    """Greedy outputs of both rounds (block size 16, chunks of 24 tokens), and the engine
    (shut down) for inspection. With pipeline parallelism, the engine must have kept as many
    steps in flight as there are stages."""
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_kv_blocks=64, max_model_len=256,
              block_size=16, max_num_batched_tokens=24, show_progress=False, skip_tokenizer_init=True, **kw)
    in_flight = _InFlight(llm.engine.executor) if pp > 1 else None
    try:
        first = llm.generate([{"prompt_token_ids": p} for p in _PROMPTS], params, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": p} for p in _AGAIN], params, use_tqdm=False)
        llm.engine.check_integrity()
        assert llm.engine.kv_manager.pool.num_free_blocks == llm.engine.num_blocks
        if in_flight is not None:
            assert (in_flight.most, in_flight.now) == (pp, 0)
        return [o.outputs[0] for o in first], list(again), llm.engine
    finally:
        llm.shutdown()


def _assert_same_greedy(base, got, label: str) -> None:
    for i, (a, b) in enumerate(zip(got, base)):
        cmp = compare_greedy(a.token_ids, b.token_ids,
                             lambda pos: min(logprob_gap(a, pos), logprob_gap(b, pos)), f"{label} prompt {i}")
        assert cmp.equal, cmp.excused


def _stage_bytes(model, layers: tuple[int, int], first: bool, last: bool) -> int:
    """Bytes of a one-process model's parameters that a stage holds (the rotary tables,
    buffers, on every stage); a tied LM head counted where it is held."""
    total = sum(b.numel() * b.element_size() for b in model.buffers())
    for name, p in model.named_parameters(remove_duplicate=False):
        size = p.numel() * p.element_size()
        if name.startswith("model.layers."):
            total += size if layers[0] <= int(name.split(".")[2]) < layers[1] else 0
        elif name.startswith("model.embed_tokens."):
            total += size if first else 0
        elif name.startswith(("model.norm.", "lm_head.")):
            total += size if last else 0
    return total


@pytest.mark.parametrize("model", ["tiny_llama3_dir", "tiny_llama_dir"])
def test_pp2_matches_one_process(model, request):
    """Prompts of different lengths, chunked (24-token budget) and batched with decodes, and
    a second round whose long prompt starts from the prefix cache: the tokens of one process.
    Each stage holds exactly its layers' weights (the tied model's last stage its own copy of
    the head) and KV buffers only for its layers."""
    path = request.getfixturevalue(model)
    base, base_again, one = _run(path)
    got, again, engine = _run(path, pp=2)
    _assert_same_greedy(base, got, model)
    _assert_same_greedy([o.outputs[0] for o in base_again], [o.outputs[0] for o in again], f"{model} again")
    assert again[0].num_cached_tokens >= 16, "no prefix-cache hit in the second round"
    one_model = one.loaded.model
    num_layers = len(one_model.model.layers)
    ranges = split_layers(num_layers, 2)
    want = [_stage_bytes(one_model, r, s == 0, s == 1) for s, r in enumerate(ranges)]
    assert engine.tp_driver.weight_bytes == want
    assert engine.loaded.stage.layers == ranges[0]
    assert [b is not None for b in engine.runner.kv_buffers] == [i < ranges[0][1] for i in range(num_layers)]


@pytest.mark.parametrize("model", ["tiny_gemma3_dir", "tiny_olmo2_dir", "tiny_gptoss_dir", "tiny_qwen3moe_dir"])
def test_pp2_families(model, request):
    """Gemma 3's windowed and global layers (KV groups over shared buffers, split across
    stages), OLMo 2's post-norms (the residual stream passed on as is), GPT-OSS's sinks,
    biases and experts, Qwen3-MoE's experts: one process's tokens."""
    path = request.getfixturevalue(model)
    base, base_again, _ = _run(path)
    got, again, _ = _run(path, pp=2)
    _assert_same_greedy(base, got, model)
    _assert_same_greedy([o.outputs[0] for o in base_again], [o.outputs[0] for o in again], f"{model} again")


def test_micro_batches_share_the_work(tiny_llama_dir):
    """Eight 4-token prompts at PP=2: each step in flight takes half of the work not in flight
    (16 prompt tokens, then 4 decodes each), so the stages never wait for an empty step."""
    llm = LLM(tiny_llama_dir, pipeline_parallel_size=2, num_kv_blocks=64, max_model_len=256, block_size=16,
              show_progress=False, skip_tokenizer_init=True)
    in_flight = _InFlight(llm.engine.executor)
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": [3 + i] * 4} for i in range(8)], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    # (An empty step tells the ranks of finished requests.)
    assert [n for n in in_flight.sizes if n] == [4] * 16, in_flight.sizes


@pytest.mark.slow   # (CI time: TP=2 and PP=2 each match one process in the default run)
def test_tp2_pp2_matches_one_process(tiny_llama3_dir):
    """Four ranks: two stages, each a tensor-parallel pair (half of its layers' heads)."""
    base, base_again, one = _run(tiny_llama3_dir)
    got, again, engine = _run(tiny_llama3_dir, tp=2, pp=2)
    _assert_same_greedy(base, got, "TP=2 x PP=2")
    _assert_same_greedy([o.outputs[0] for o in base_again], [o.outputs[0] for o in again], "TP=2 x PP=2 again")
    weights = engine.tp_driver.weight_bytes
    assert len(weights) == 4
    ranges = split_layers(3, 2)
    for stage in range(2):
        full = _stage_bytes(one.loaded.model, ranges[stage], stage == 0, stage == 1)
        for b in weights[2 * stage:2 * stage + 2]:   # about half of the stage each (norms replicated)
            assert 0.4 * full < b < 0.7 * full, (stage, b, full)


@pytest.mark.slow   # (TP x PP and expert parallelism each run in the default suite)
def test_tp2_pp2_expert_parallel_matches_one_process(tiny_qwen3moe_dir):
    """Experts split by expert within every stage (TP=2 x PP=2 with --enable-expert-parallel):
    each rank holds half of its stage's layers' experts, and the tokens are one process's."""
    base, _, _ = _run(tiny_qwen3moe_dir)
    got, _, engine = _run(tiny_qwen3moe_dir, tp=2, pp=2, enable_expert_parallel=True)
    _assert_same_greedy(base, got, "TP=2 x PP=2, EP")
    model = engine.loaded.model   # rank 0: stage 0, TP rank 0
    start, end = engine.loaded.stage.layers
    for i in range(start, end):
        experts = model.model.layers[i].mlp.experts
        held = [type(e).__name__ != "Identity" for e in experts]
        assert sum(held) == len(experts) // 2 and all(held[: len(experts) // 2]), held


def test_layer_partition_override(tiny_llama3_dir, monkeypatch):
    """PAGODA_PP_LAYER_PARTITION moves layers between stages (the workers inherit it)."""
    monkeypatch.setenv("PAGODA_PP_LAYER_PARTITION", "1,2")
    base, _, _ = _run(tiny_llama3_dir)
    got, _, engine = _run(tiny_llama3_dir, pp=2)
    _assert_same_greedy(base, got, "partition 1,2")
    assert engine.loaded.stage.layers == (0, 1)


# ---- the expert load (MoE) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_qwen3moe4_dir(tmp_path_factory) -> str:
    """Qwen3-MoE, four layers, layer 1 dense (``mlp_only_layers``): at PP=2 stage 0 holds MoE
    layer 0 and the dense layer, stage 1 MoE layers 2 and 3 (the load's rows 1 and 2)."""
    return _tiny_family(tmp_path_factory, "tiny-qwen3moe4", "Qwen3MoeConfig", num_hidden_layers=4, num_experts=6,
                        num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, rope_theta=1e6,
                        mlp_only_layers=[1], architectures=["Qwen3MoeForCausalLM"])


def _expert_load_run(path: str, tp: int = 1, pp: int = 1) -> tuple[list, list[list[int]], int, list]:
    """Both rounds of prompts with the expert load due at every step: the greedy outputs, the
    load the engine core reports once idle (its heartbeat, kept by EngineMetrics as /metrics
    reads it), the tokens computed, and the loads the steps reported on the way."""
    from pagoda.metrics.stats import EngineMetrics

    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_kv_blocks=64, max_model_len=256,
              block_size=16, max_num_batched_tokens=24, show_progress=False, skip_tokenizer_init=True,
              distributed_timeout=600)
    engine = llm.engine
    metrics = EngineMetrics(256, 256, 24)
    on_the_way: list[list[list[int]]] = []
    step = engine.step

    def step_and_keep():
        out = step()
        metrics.on_engine_outputs(out, 0.0)
        if out.expert_load is not None:
            on_the_way.append(out.expert_load)
        return out

    engine.step = step_and_keep
    try:
        outs = []
        for prompts in (_PROMPTS, _AGAIN):
            outs += llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        engine._last_expert_load = float("-inf")
        metrics.on_engine_outputs(engine.idle_stats(), 0.0)
        again = engine.idle_stats()   # due, nothing ran since: the same load (no round trip under PP)
        assert again.expert_load == metrics.expert_load
    finally:
        llm.shutdown()
    # Each forward computes the prompt's uncached tokens, then one per sampled token but the last.
    computed = sum(len(o.prompt_token_ids) - o.num_cached_tokens + len(o.outputs[0].token_ids) - 1 for o in outs)
    return [o.outputs[0] for o in outs], metrics.expert_load, computed, on_the_way


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_expert_load_covers_every_stage(tiny_qwen3moe4_dir, tp, pp, monkeypatch):
    """PP=2 and TP=2 x PP=2: the load the engine reports has a row per MoE layer of the whole
    model (stage 0's first), each equal to one process's for the same requests, each adding
    up to tokens computed x top-k (2). On the way, the loads the steps brought are
    consistent snapshots (every layer's total the same) that only grow."""
    monkeypatch.setattr("pagoda.engine.engine_core.EXPERT_LOAD_INTERVAL_S", 0.0)
    base, base_load, base_computed, _ = _expert_load_run(tiny_qwen3moe4_dir)
    got, load, computed, on_the_way = _expert_load_run(tiny_qwen3moe4_dir, tp=tp, pp=pp)
    _assert_same_greedy(base, got, f"TP={tp} x PP={pp}")
    assert computed == base_computed
    assert [sum(row) for row in base_load] == [2 * base_computed] * 3 and all(len(r) == 6 for r in base_load)
    assert load == base_load
    assert len(on_the_way) > 2, "no step brought the other stage's counts"
    totals = [{sum(row) for row in snap} for snap in on_the_way]
    assert all(len(t) == 1 for t in totals), totals
    totals = [t.pop() for t in totals]
    assert totals == sorted(totals) and 0 < totals[-1] <= 2 * computed, totals


# ---- weights kept in their blocks ---------------------------------------------------------


@pytest.fixture(scope="module")
def gguf3_path(tmp_path_factory) -> str:
    """A GGUF file of three layers (2 + 1 on two stages): Q8_0 blocks, layer 1's o_proj and
    down_proj and the LM head in Q4_K, an embedding of its own."""
    from gguf import GGMLQuantizationType as Q

    from pagoda.bench.gguf_files import ModelShape, write_model

    shape = ModelShape("llama", 512, 3, 8, 4, 1024, False, 10000.0)
    types = {"blk.1.attn_output.weight": Q.Q4_K, "blk.1.ffn_down.weight": Q.Q4_K, "output.weight": Q.Q4_K}
    path = tmp_path_factory.mktemp("pp-gguf") / "model.gguf"
    return write_model(str(path), shape, "Q8_0", show_progress=False, overrides=types, quantized=True)


@pytest.mark.skipif(cpu_kernels.kernels() is None, reason="blocks need pagoda's CPU kernels")
@pytest.mark.parametrize(("model", "mode"), [("gguf3_path", "none"), ("gguf3_path", "gguf"),
                                             ("tiny_llama_bf16_dir", "none")])
def test_pp2_keeps_the_weights_as_stored(model, mode, request):
    """A GGUF file at PP=2 in the exact and the gguf mode, and a bfloat16 checkpoint with a
    tied head: each stage keeps its own layers as stored (blocks, bfloat16; no float copy:
    the stages' weights add up to one process's, plus the tied matrix held on both ends),
    and the tokens are those of one process in the same mode."""
    from pagoda.model.layers.blocks import BlocksLinear
    from pagoda.model.loader import parameter_bytes

    path = request.getfixturevalue(model)
    base, base_again, one = _run(path, quantization=mode)
    got, again, engine = _run(path, pp=2, quantization=mode)
    _assert_same_greedy(base, got, f"{model}, {mode}")
    _assert_same_greedy([o.outputs[0] for o in base_again], [o.outputs[0] for o in again], f"{mode} again")
    layer = engine.loaded.model.model.layers[0].self_attn.o_proj
    assert isinstance(layer, BlocksLinear) and layer.int8_activations == (mode == "gguf")
    one_model = one.loaded.model
    full = parameter_bytes(one_model)
    twice = one_model.model.embed_tokens.blocks.nbytes if one_model.config.tie_word_embeddings else 0
    per_stage = engine.tp_driver.weight_bytes
    assert len(per_stage) == 2 and all(b < 0.8 * full for b in per_stage), (per_stage, full)
    assert abs(sum(per_stage) - full - twice) < 0.01 * full, (per_stage, full, twice)


# ---- a stage that dies ------------------------------------------------------------------


def test_pp_stage_killed_mid_load():
    """The last stage's worker killed (SIGKILL) while requests stream: they end with an
    error, /health turns 503 and the engine core exits, leaving no worker behind."""
    from tests.reliability.test_tp_faults import kill_worker_mid_load

    kill_worker_mid_load(pipeline_parallel_size=2)
