"""Speculative decoding end to end: the same greedy tokens with and without drafts.

Every run steps the engine core by hand and checks the KV pool's integrity after
each step, and that every block is free at the end. Tiny random models cover the
proposers, mixed batches, prefix caching and preemption quickly; the default model
(real weights, a repetitive prompt, so ngram lookup finds matches) checks the same
with acceptance > 0. A divergence on the real model is excused only at a genuine
near-tie of the baseline's top-2 logits.
"""

from __future__ import annotations

import json

import pytest

from pagoda.config import EngineConfig
from pagoda.engine.engine_core import EngineCore
from pagoda.engine.messages import EngineCoreRequest
from pagoda.sampling_params import SamplingParams
from tests.model.helpers import compare_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def run(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]):
    """All requests at once; returns (token ids, logprobs entries) per request."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(EngineCoreRequest(f"r{i}", p, sp))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    logprobs: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    steps = 0
    while core.has_unfinished_requests():
        out = core.step()
        core.check_integrity()
        steps += 1
        assert steps < 10_000
        for o in out.outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.new_logprobs:
                logprobs[o.request_id] += o.new_logprobs
    core.check_integrity()
    assert core.kv_manager.num_free_blocks == core.num_blocks
    assert not core.kv_manager.req_to_blocks
    keys = [f"r{i}" for i in range(len(prompts))]
    return [tokens[k] for k in keys], [logprobs[k] for k in keys]


def engine(loaded, spec=None, **kwargs) -> EngineCore:
    kwargs.setdefault("num_kv_blocks", 256)
    config = EngineConfig(model=loaded.path, show_progress=False, speculative_config=spec, **kwargs)
    return EngineCore(config, loaded=loaded, collect_stats=True)


def spec_stats(core: EngineCore):
    s = core.scheduler.make_stats()
    return s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens


# ---- tiny random model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    import torch

    from pagoda.model.loader import load_model

    return load_model(tiny_llama_dir, torch.float32, torch.device("cpu"), show_progress=False)


def _tiny_prompts() -> list[list[int]]:
    loop = [5, 17, 42, 99, 7, 300, 12, 64]
    return [
        loop * 4,                                   # repetitive: lookups hit
        list(range(100, 137)),                      # 37 tokens, crosses block boundaries
        loop * 2 + [1, 2, 3],
        [400, 401, 402, 403, 404, 405] * 3,
    ]


def _tiny_params() -> list[SamplingParams]:
    greedy = dict(temperature=0, max_tokens=20, ignore_eos=True)
    return [
        SamplingParams(**greedy),
        SamplingParams(**greedy, logprobs=1),                         # never speculates
        SamplingParams(**greedy, repetition_penalty=1.3, logit_bias={5: 2.0}),
        SamplingParams(**greedy, min_tokens=5, stop_token_ids=[7]),
    ]


@pytest.mark.parametrize(
    "spec",
    [
        NGRAM,
        {"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 1},
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 2},
    ],
    ids=["ngram", "layer_skip", "ngram-k5"],
)
def test_tiny_same_tokens_mixed_batch(tiny, spec):
    prompts, params = _tiny_prompts(), _tiny_params()
    want, _ = run(engine(tiny), prompts, params)
    core = engine(tiny, spec)
    got, _ = run(core, prompts, params)
    assert got == want
    drafts, draft_tokens, accepted = spec_stats(core)
    assert drafts > 0 and draft_tokens >= drafts
    assert 0 <= accepted <= draft_tokens


def test_tiny_draft_model_same_model_accepts_everything(tiny, tiny_llama_dir):
    """A draft identical to the target proposes the target's own greedy tokens."""
    prompts, params = _tiny_prompts()[:1], [SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)]
    want, _ = run(engine(tiny), prompts, params)
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "model": tiny_llama_dir}
    core = engine(tiny, spec)
    got, _ = run(core, prompts, params)
    assert got == want
    drafts, draft_tokens, accepted = spec_stats(core)
    assert accepted == draft_tokens > 0
    # 20 tokens after the first in rounds of 4 drafts + 1: four full rounds.
    assert core.scheduler.make_stats().spec_accepted_per_pos == [drafts] * 4


def test_tiny_separate_draft_model(tiny, tiny_qwen2_dir):
    """Another model (same vocabulary) as the draft, with its own KV cache: mostly wrong
    drafts, the same tokens."""
    prompts, params = _tiny_prompts(), _tiny_params()
    want, _ = run(engine(tiny), prompts, params)
    core = engine(tiny, {"method": "draft_model", "num_speculative_tokens": 2, "model": tiny_qwen2_dir},
                  num_kv_blocks=24, block_size=4)
    got, _ = run(core, prompts, params)
    assert got == want
    assert spec_stats(core)[1] > 0
    # The draft's cache is sized like the target's, over the same block ids.
    assert core.runner.proposer.kv_caches[0].shape[1] == core.num_blocks


@pytest.mark.parametrize("spec", [NGRAM, {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 1}],
                         ids=["ngram", "layer_skip"])
def test_tiny_preemption_and_prefix_caching(tiny, spec):
    """A pool too small for the batch forces preemption; a shared prefix makes
    prefix-cache hits. Tokens stay the same as a roomy run without caching."""
    shared = [5, 17, 42, 99, 7, 300, 12, 64] * 3
    prompts = [shared + [i, i + 1, i + 2] for i in range(1, 6)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    want, _ = run(engine(tiny, num_kv_blocks=256, enable_prefix_caching=False), prompts, params)
    core = engine(tiny, spec, num_kv_blocks=14, block_size=4, max_model_len=56)
    got, _ = run(core, prompts, params)
    assert got == want
    stats = core.scheduler.make_stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.spec_num_draft_tokens > 0


def test_tiny_sampled_requests_speculate_and_finish(tiny):
    """Random sampling goes through rejection sampling; lengths and the pool hold."""
    prompts = _tiny_prompts()
    params = [SamplingParams(temperature=0.8, top_k=50, max_tokens=16, ignore_eos=True, seed=i) for i in range(4)]
    core = engine(tiny, {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 1})
    got, _ = run(core, prompts, params)
    assert [len(t) for t in got] == [16] * 4
    assert spec_stats(core)[1] > 0


# ---- the default model -----------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(default_model_path):
    import torch

    from pagoda.model.loader import load_model

    return load_model(default_model_path, torch.float32, torch.device("cpu"), show_progress=False)


@pytest.fixture(scope="module")
def smol_prompts(smol) -> list[list[int]]:
    from pagoda.tokenizer import build_tokenizer

    tok = build_tokenizer(smol, None)
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    texts = [
        f"Copy this code exactly.\n\n{code}\nCopy:\n\n{code[:20]}",
        "The days of the week are Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. "
        "Again: Monday, Tuesday,",
        "The capital of France is",
    ]
    return [tok.encode(t) for t in texts]


def _assert_same_greedy(got, want, want_logprobs, label):
    for i, (g, w) in enumerate(zip(got, want)):
        result = compare_greedy(
            g, w,
            lambda pos: want_logprobs[i][pos].top_logprobs[0] - want_logprobs[i][pos].top_logprobs[1],
            f"{label} request {i}",
        )
        assert result.equal, result.excused
        for line in result.excused:
            print("excused:", line)


MAX_TOKENS = 16


@pytest.fixture(scope="module")
def smol_baseline(smol, smol_prompts):
    # Plain decoding, prefix caching off; logprobs give the near-tie excuse.
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)] * 3
    return run(engine(smol, enable_prefix_caching=False), smol_prompts, params)


def _mixed_params() -> list[SamplingParams]:
    # The last request asks logprobs, so it decodes plainly in the same batch.
    greedy = dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [SamplingParams(**greedy), SamplingParams(**greedy), SamplingParams(**greedy, logprobs=2)]


@pytest.mark.parametrize(
    "spec",
    [NGRAM, {"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 20}],
    ids=["ngram", "layer_skip"],
)
def test_default_model_same_greedy_tokens(smol, smol_prompts, smol_baseline, spec):
    want, want_lp = smol_baseline
    core = engine(smol, spec)
    got, _ = run(core, smol_prompts, _mixed_params())
    _assert_same_greedy(got, want, want_lp, spec["method"])
    drafts, draft_tokens, accepted = spec_stats(core)
    assert draft_tokens > 0
    assert accepted > 0, "the repetitive prompts should let drafts through"


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec",
    [NGRAM, {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 24}],
    ids=["ngram", "layer_skip"],
)
def test_default_model_preemption_prefix_caching(smol, smol_prompts, smol_baseline, spec):
    """A small pool (preemption) and prefix caching on, with a repeated prompt to hit."""
    want, want_lp = smol_baseline
    prompts = smol_prompts + [smol_prompts[0]]
    params = _mixed_params() + [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)]
    core = engine(smol, spec, num_kv_blocks=8, block_size=16, max_model_len=128)  # a pool of 128 tokens
    got, _ = run(core, prompts, params)
    _assert_same_greedy(got, want + [want[0]], want_lp + [want_lp[0]], spec["method"])
    stats = core.scheduler.make_stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.spec_num_accepted_tokens > 0


@pytest.mark.slow
def test_bench_spec_runs_on_tiny_numbers(tmp_path, capsys):
    from pagoda.entrypoints.cli import main

    out = tmp_path / "spec.json"
    argv = ["bench", "spec", "--num-prompts", "1", "--output-len", "6", "--num-warmup", "0",
            "--workloads", "repetitive", "--num-kv-blocks", "64", "--save-result", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    labels = [r["label"] for r in report["results"]]
    assert labels[0] == "none" and labels[1].startswith("ngram") and labels[2].startswith("layer_skip")
    for r in report["results"][1:]:
        assert r["repetitive"]["num_draft_tokens"] > 0
    assert "tok/s" in capsys.readouterr().out
    # Both ways of naming configurations at once is an error, not a silent choice.
    assert main(argv + ["--spec", '{"method": "ngram", "num_speculative_tokens": 2}',
                        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']) == 2


def test_offline_llm_accepts_speculative_config(tiny_llama_dir):
    from pagoda import LLM

    prompt = {"prompt_token_ids": [5, 17, 42, 99] * 4}
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = LLM(tiny_llama_dir, show_progress=False, skip_tokenizer_init=True, num_kv_blocks=64)
    spec = LLM(tiny_llama_dir, show_progress=False, skip_tokenizer_init=True, num_kv_blocks=64,
               speculative_config={"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 1})
    want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert spec.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert spec.engine.scheduler.make_stats().spec_num_draft_tokens > 0
    spec.engine.check_integrity()


def test_layer_skip_must_be_shallower_than_the_target(tiny):
    with pytest.raises(ValueError, match="num_layers=2 must be smaller than the target's 2 layers"):
        engine(tiny, {"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 2})
