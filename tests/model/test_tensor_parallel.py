"""Tensor parallelism on CPU (gloo, 2 processes) against one process.

Greedy outputs must match TP=1 token for token (all-reduce sums in another
order, so a genuine fp32 near-tie may flip: only that is excused, see
helpers.compare_greedy); each rank must hold about half the weights.
"""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.model.arch import ModelArchConfig
from pagoda.model.layers.parallel import ShardPlan, split_range
from pagoda.model.loader import parameter_bytes
from tests.conftest import _save_tiny
from tests.model.helpers import compare_greedy, logprob_gap


@pytest.fixture(autouse=True)
def _restore_threads():
    # Rank 0 of a TP engine runs in the test process and sets one thread per rank.
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_uneven_dir(tmp_path_factory) -> str:
    """Counts that 2 ranks do not split evenly: 3 KV heads (groups of 2 query heads),
    intermediate 99, vocabulary 509 (padded to 255 rows per rank)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=509, hidden_size=48, intermediate_size=99, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.3,
        architectures=["LlamaForCausalLM"],
    )
    return _save_tiny(tmp_path_factory, "tiny-uneven", config)


def _arch(heads: int, kv: int, inter: int = 128, vocab: int = 512) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 8 * heads, "intermediate_size": inter,
        "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv,
        "vocab_size": vocab, "max_position_embeddings": 128,
    })


def test_split_range_covers_exactly():
    for n in range(1, 12):
        for parts in range(1, 5):
            ranges = [split_range(n, parts, i) for i in range(parts)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1


@pytest.mark.parametrize(("heads", "kv", "world", "want"), [
    (4, 2, 2, [((0, 2), (0, 1)), ((2, 4), (1, 2))]),          # even
    (6, 3, 2, [((0, 4), (0, 2)), ((4, 6), (2, 3))]),          # uneven: whole GQA groups
    (4, 1, 2, [((0, 2), (0, 1)), ((2, 4), (0, 1))]),          # KV head replicated
    (8, 2, 4, [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]),
])
def test_shard_plan_heads(heads, kv, world, want):
    got = [(p.q_heads, p.kv_heads) for p in (ShardPlan.build(_arch(heads, kv), r, world) for r in range(world))]
    assert got == want


def test_shard_plan_rejects_impossible_splits():
    with pytest.raises(ValueError, match="multiple"):
        ShardPlan.build(_arch(6, 3), 0, 4)       # 3 KV heads on 4 ranks
    with pytest.raises(ValueError, match="attention heads"):
        ShardPlan.build(_arch(2, 1), 0, 4)       # more ranks than heads


def test_shard_plan_narrow_vocab_padding():
    plans = [ShardPlan.build(_arch(4, 2, vocab=509), r, 2) for r in range(2)]
    emb = torch.arange(509 * 2, dtype=torch.float32).reshape(509, 2)
    parts = [p.narrow("model.embed_tokens.weight", emb) for p in plans]
    assert [tuple(t.shape) for t in parts] == [(255, 2), (255, 2)]
    assert torch.equal(torch.cat(parts)[:509], emb)
    assert torch.count_nonzero(parts[1][254]) == 0   # the padding row


_PROMPTS = [list(range(3, 9)), list(range(20, 61)), [7] * 19, list(range(100, 133))]


def _greedy(path: str | None, tp: int, **kw):
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, ignore_eos=True)
    llm = LLM(path, tensor_parallel_size=tp, num_kv_blocks=96, max_model_len=256, show_progress=False,
              skip_tokenizer_init=True, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in _PROMPTS], params, use_tqdm=False)
        # (A GGUF file's weights stay in their blocks on every rank: tests/model/test_tensor_parallel_quant.py.)
        weights = [parameter_bytes(llm.engine.loaded.model)]
        if tp > 1:
            weights = llm.engine.tp_driver.weight_bytes
            assert len(weights) == tp
            assert weights[0] == parameter_bytes(llm.engine.loaded.model)
        return [o.outputs[0] for o in outs], weights
    finally:
        llm.shutdown()


def _assert_same_greedy(base, tp2, label: str) -> None:
    for i, (a, b) in enumerate(zip(tp2, base)):
        cmp = compare_greedy(
            a.token_ids, b.token_ids,
            lambda pos: min(logprob_gap(a, pos), logprob_gap(b, pos)), f"{label} prompt {i}")
        assert cmp.equal, cmp.excused


@pytest.mark.parametrize("model", [
    # The even split is also covered by the default model (slow) and by the uneven model's MLP.
    pytest.param("tiny_llama_dir", marks=pytest.mark.slow), "tiny_qwen2_dir", "tiny_uneven_dir",
    pytest.param("tiny_qwen3_dir", marks=pytest.mark.slow), "tiny_gemma3_dir", "tiny_phi3_dir", "tiny_olmo2_dir",
    pytest.param("tiny_olmo3_dir", marks=pytest.mark.slow), pytest.param("tiny_seedoss_dir", marks=pytest.mark.slow),
    pytest.param("tiny_exaone4_dir", marks=pytest.mark.slow), pytest.param("tiny_cohere2_dir", marks=pytest.mark.slow)])
def test_tp2_matches_tp1_tiny(model, request):
    """Even heads (4 q / 2 kv, tied embeddings), a replicated KV head (4 / 1, qkv bias),
    uneven counts (6 / 3 heads, intermediate 99, vocabulary 509), Qwen3's q/k norms
    per head (replicated on every rank), Gemma 3's windowed layers, Phi-3's checkpoint
    tensors stacked already (split part by part), OLMo 2's whole-width q/k norms (their
    mean square from every rank's sums; its one KV head replicated), OLMo 3's windows,
    Seed-OSS's biases (q/k/v and gate/up by rows; o and down added once), EXAONE 4's NoPE
    global layers and Command R7B's parallel blocks (its interleaved Q/K rows and biases
    put in rotate-half order before the split). A small token
    budget chunks the long prompts, so chunked prefill and mixed batches run under TP."""
    path = request.getfixturevalue(model)
    base, (full,) = _greedy(path, 1, max_num_batched_tokens=24)
    tp2, per_rank = _greedy(path, 2, max_num_batched_tokens=24)
    _assert_same_greedy(base, tp2, model)
    for b in per_rank:
        # Half of everything but the (replicated) norms; the KV-replicated model also
        # repeats its one KV head on both ranks.
        assert 0.4 * full < b < 0.7 * full, (b, full)
    assert sum(per_rank) >= full


@pytest.mark.slow
def test_tp2_matches_tp1_default_model(default_model_path):
    base, (full,) = _greedy(default_model_path, 1)
    tp2, per_rank = _greedy(default_model_path, 2)
    _assert_same_greedy(base, tp2, "SmolLM2-135M")
    for b in per_rank:
        assert 0.45 * full < b < 0.56 * full, (b, full)


def _child_pids() -> set[int]:
    import os

    pids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            pids.update(int(x) for x in f.read().split())
    return pids


def test_tp_startup_error_stops_the_workers(tiny_llama_dir):
    """A config error found after the group formed (KV pool smaller than the context)
    raises at once and leaves no worker behind."""
    before = _child_pids()
    with pytest.raises(ValueError, match="KV cache holds"):
        LLM(tiny_llama_dir, tensor_parallel_size=2, num_kv_blocks=2, max_model_len=512,
            show_progress=False, skip_tokenizer_init=True)
    assert _child_pids() - before == set()


@pytest.mark.parametrize("model,expert_parallel", [("tiny_mixtral_dir", True),
                                                   pytest.param("tiny_qwen3moe_dir", True, marks=pytest.mark.slow),
                                                   ("tiny_gptoss_dir", True), ("tiny_mixtral_dir", False),
                                                   pytest.param("tiny_gptoss_dir", False, marks=pytest.mark.slow),
                                                   ("tiny_glm4moe_dir", False),
                                                   pytest.param("tiny_ernie45moe_dir", False, marks=pytest.mark.slow),
                                                   pytest.param("tiny_minimaxm2_dir", False, marks=pytest.mark.slow),
                                                   ("tiny_llama4_dir", True)])
def test_tp2_moe_matches_tp1(model, expert_parallel, request):
    """--enable-expert-parallel: each rank holds half of every layer's experts; without it
    every expert is split by rows (gate/up rows, down columns, a down bias added once). With
    the ranks' shares of the attention heads, their partial sums give TP=1's tokens (a
    near-tie excepted: they add in another order). Llama 4: experts weighing their inputs,
    chunked attention built by every worker."""
    path = request.getfixturevalue(model)
    # (Llama 4's chunks of 16 need blocks that divide them: its chunked metadata per worker.)
    kw = {"block_size": 16} if "llama4" in model else {}
    base, (full,) = _greedy(path, 1, max_num_batched_tokens=24, **kw)
    tp2, per_rank = _greedy(path, 2, max_num_batched_tokens=24, enable_expert_parallel=expert_parallel, **kw)
    _assert_same_greedy(base, tp2, model)
    for b in per_rank:
        assert 0.4 * full < b < 0.7 * full, (b, full)


def test_expert_parallel_needs_tensor_parallelism(tiny_mixtral_dir):
    with pytest.raises(ValueError, match="needs --tensor-parallel-size > 1"):
        LLM(tiny_mixtral_dir, enable_expert_parallel=True, skip_tokenizer_init=True, show_progress=False)

