"""pagoda with LoRA adapters against transformers + peft, and batching invariance across adapters."""

from __future__ import annotations

import pytest

from pagoda import LoRARequest, SamplingParams
from tests.lora.helpers import with_adapter
from tests.model.helpers import compare_greedy, hf_greedy, logprob_gap, top2_gap

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
TINY_PROMPTS = [[1, 5, 9, 33, 100, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
                [2, 200, 300, 400, 17, 3, 99]]


def _assert_matches(got_outputs, want_and_logits, label: str) -> None:
    for i, (out, (want, want_logits)) in enumerate(zip(got_outputs, want_and_logits)):
        c = out.outputs[0]
        result = compare_greedy(c.token_ids, want,
                                lambda pos: min(top2_gap(want_logits[pos]), logprob_gap(c, pos)), f"{label}[{i}]")
        assert result.equal, result.excused


def _assert_same(outs, refs, label: str) -> None:
    """Same tokens; a divergence only at a genuine near-tie (either side's top-2 gap)."""
    for i, (a, b) in enumerate(zip(outs, refs)):
        ca, cb = a.outputs[0], b.outputs[0]
        result = compare_greedy(ca.token_ids, cb.token_ids,
                                lambda pos: min(logprob_gap(ca, pos), logprob_gap(cb, pos)), f"{label}[{i}]")
        assert result.equal, result.excused


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    from pagoda import LLM

    return LLM(tiny_llama_dir, enable_lora=True, max_loras=4, max_lora_rank=16, skip_tokenizer_init=True,
               show_progress=False, num_kv_blocks=128, max_model_len=256)


def _tiny_requests(tiny_adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(tiny_adapters.items()))}


@pytest.mark.parametrize("name", ["all", "kv-rslora", "mlp", "q-o"])
def test_tiny_adapter_greedy_matches_peft(tiny_llm, tiny_hf, tiny_adapters, name):
    lora = _tiny_requests(tiny_adapters)[name]
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    got = tiny_llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
    with with_adapter(tiny_hf, lora.lora_path) as reference:
        want = [hf_greedy(reference, p, 32) for p in TINY_PROMPTS]
    _assert_matches(got, want, name)
    base = tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in base] != [o.outputs[0].token_ids for o in got], "adapter changed nothing"
    tiny_llm.engine.check_integrity()
    assert tiny_llm.engine.kv_manager.num_free_blocks == tiny_llm.engine.num_blocks


@pytest.mark.parametrize("max_loras", [4, 2])
def test_tiny_mixed_batch_equals_alone(tiny_llama_dir, tiny_adapters, max_loras):
    """Base + 3 adapters in one batch; with max_loras=2 the third adapter's requests wait
    for a slot (LRU), and still get the tokens they get alone."""
    from pagoda import LLM

    llm = LLM(tiny_llama_dir, enable_lora=True, max_loras=max_loras, skip_tokenizer_init=True,
              show_progress=False, num_kv_blocks=128, max_model_len=256)
    loras = _tiny_requests(tiny_adapters)
    choice = [None, loras["all"], loras["kv-rslora"], loras["mlp"]]
    prompts, per_prompt = [], []
    for p in TINY_PROMPTS:
        for lora in choice:
            prompts.append({"prompt_token_ids": p})
            per_prompt.append(lora)
    batch = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt)
    alone = [llm.generate([p], GREEDY, use_tqdm=False, lora_request=lora)[0] for p, lora in zip(prompts, per_prompt)]
    _assert_same(batch, alone, f"max_loras={max_loras}")
    # Different adapters really gave different tokens for the same prompt.
    assert len({tuple(o.outputs[0].token_ids) for o in batch[:4]}) == 4
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks
    if max_loras == 2:
        assert llm.engine.lora.num_loads > 3  # adapters were evicted and loaded again


def test_prefix_cache_is_isolated_across_adapters(tiny_llama_dir, tiny_adapters):
    from pagoda import LLM

    def engine():
        return LLM(tiny_llama_dir, enable_lora=True, max_loras=2, skip_tokenizer_init=True,
                   show_progress=False, num_kv_blocks=128, max_model_len=256, block_size=4)

    loras = _tiny_requests(tiny_adapters)
    a, b = loras["all"], loras["q-o"]
    prompt = [{"prompt_token_ids": [3 + i for i in range(21)]}]
    llm = engine()
    first_a = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)[0]
    assert first_a.num_cached_tokens == 0
    then_b = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=b)[0]
    then_base = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again_a = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)[0]
    # A's KV is never reused for B or the base model, but is for A again.
    assert then_b.num_cached_tokens == 0
    assert then_base.num_cached_tokens == 0
    assert again_a.num_cached_tokens == 20
    assert again_a.outputs[0].token_ids == first_a.outputs[0].token_ids
    fresh_b = engine().generate(prompt, GREEDY, use_tqdm=False, lora_request=b)[0]
    assert then_b.outputs[0].token_ids == fresh_b.outputs[0].token_ids


def test_bad_adapter_and_lora_off_are_rejected(tiny_llama_dir, tiny_llm, tiny_adapters, tmp_path):
    from pagoda import LLM
    from pagoda.lora.adapter import LoRAAdapterError

    prompt = [{"prompt_token_ids": TINY_PROMPTS[0]}]
    with pytest.raises(LoRAAdapterError, match="not a directory"):
        tiny_llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 99, str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="already used by adapter"):
        tiny_llm.generate(prompt, GREEDY, use_tqdm=False,
                          lora_request=LoRARequest("other", 1, tiny_adapters["mlp"]))
    # The engine keeps serving and every block is back.
    assert tiny_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert tiny_llm.engine.kv_manager.num_free_blocks == tiny_llm.engine.num_blocks
    plain = LLM(tiny_llama_dir, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=32, max_model_len=256)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, tiny_adapters["all"]))


# ---- the default model (SmolLM2-135M GGUF) -----------------------------------------------

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="module")
def default_llm():
    from pagoda import LLM

    return LLM(enable_lora=True, max_loras=3, max_lora_rank=16, show_progress=False,
               num_kv_blocks=256, max_model_len=1024)


@pytest.fixture(scope="module")
def chat_prompts(default_llm) -> list[list[int]]:
    tok = default_llm.get_tokenizer()
    return [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True), add_special_tokens=False)
            for m in CHATS]


def _default_requests(default_adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(default_adapters.items()))}


# 16 tokens on the default model (30 layers, and transformers + peft's greedy run beside it):
# each of its adapters moves a greedy answer within the first 8 tokens (all: both at the first).
DEFAULT_GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)


# (attn and mlp: parts of "all", run under make test-all)
@pytest.mark.parametrize("name", ["all", pytest.param("attn", marks=pytest.mark.slow),
                                  pytest.param("mlp", marks=pytest.mark.slow)])
def test_default_model_adapter_greedy_matches_peft(default_llm, hf_default_model, default_adapters,
                                                   chat_prompts, name):
    lora = _default_requests(default_adapters)[name]
    prompts = [{"prompt_token_ids": p} for p in chat_prompts]
    got = default_llm.generate(prompts, DEFAULT_GREEDY, use_tqdm=False, lora_request=lora)
    with with_adapter(hf_default_model, lora.lora_path) as reference:
        want = [hf_greedy(reference, p, DEFAULT_GREEDY.max_tokens) for p in chat_prompts]
    _assert_matches(got, want, name)
    base = default_llm.generate(prompts, DEFAULT_GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in base] != [o.outputs[0].token_ids for o in got], "adapter changed nothing"


@pytest.mark.slow  # the tiny-model version runs in the default suite
def test_default_model_mixed_batch_equals_alone(default_llm, default_adapters, chat_prompts):
    loras = _default_requests(default_adapters)
    choice = [None, loras["all"], loras["attn"], loras["mlp"]]
    prompts = [{"prompt_token_ids": chat_prompts[0]}] * 4
    batch = default_llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=choice)
    alone = [default_llm.generate([p], GREEDY, use_tqdm=False, lora_request=lora)[0]
             for p, lora in zip(prompts, choice)]
    _assert_same(batch, alone, "default mixed")
    assert len({tuple(o.outputs[0].token_ids) for o in batch}) == 4
    default_llm.engine.check_integrity()
    assert default_llm.engine.kv_manager.num_free_blocks == default_llm.engine.num_blocks


@pytest.mark.parametrize("fixture,targets", [
    # Phi-3's adapters name the checkpoint's stacked projections: split row-wise on load.
    ("tiny_phi3_dir", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    # A MoE model: adapters on its attention (its experts' projections are refused).
    ("tiny_mixtral_dir", ("q_proj", "k_proj", "v_proj", "o_proj")),
    # GPT-OSS: biased projections, sinks, windowed and global layers.
    ("tiny_gptoss_dir", ("q_proj", "k_proj", "v_proj", "o_proj")),
])
def test_family_adapters_match_peft(fixture, targets, request, tmp_path):
    import transformers

    from pagoda import LLM
    from tests.lora.helpers import make_adapter

    path = request.getfixturevalue(fixture)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    adapter = make_adapter(hf, str(tmp_path / "adapter"), seed=3, targets=targets)
    llm = LLM(path, enable_lora=True, max_lora_rank=16, skip_tokenizer_init=True, show_progress=False,
              num_kv_blocks=64, max_model_len=256)
    lora = LoRARequest("a", 1, adapter)
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    got = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
    with with_adapter(hf, adapter) as reference:
        want = [hf_greedy(reference, p, 32) for p in TINY_PROMPTS]
    _assert_matches(got, want, fixture)
    base = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in base] != [o.outputs[0].token_ids for o in got], "adapter changed nothing"


def test_adapter_on_experts_is_refused(tiny_mixtral_dir, tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    from pagoda import LLM
    from pagoda.lora.errors import LoRAAdapterError

    adapter = tmp_path / "experts"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                             "target_modules": ["gate_proj"]}))
    prefix = "base_model.model.model.layers.0.mlp.gate_proj"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(4, 64), f"{prefix}.lora_B.weight": torch.zeros(128, 4)},
              str(adapter / "adapter_model.safetensors"))
    llm = LLM(tiny_mixtral_dir, enable_lora=True, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=32)
    with pytest.raises(LoRAAdapterError, match="mixture of experts"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("experts", 1, str(adapter)))
    assert llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_adapter_on_interleaved_rope_qk_matches_peft(tiny_cohere2_dir, tmp_path):
    """Command R7B rotates interleaved pairs: its Q/K rows are put in rotate-half order at
    load, and so are an adapter's q/k B rows (an adapter left in the checkpoint's order
    would rotate the wrong pairs)."""
    import torch
    import transformers

    from pagoda import LLM
    from tests.lora.helpers import make_adapter

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_cohere2_dir, dtype=torch.float32).eval()
    path = make_adapter(hf, str(tmp_path / "qk"), seed=5, rank=4, alpha=8, b_std=0.3, targets=("q_proj", "k_proj"))
    llm = LLM(tiny_cohere2_dir, enable_lora=True, max_loras=1, max_lora_rank=8, skip_tokenizer_init=True,
              show_progress=False, num_kv_blocks=64, max_model_len=256)
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    got = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("qk", 1, path))
    with with_adapter(hf, path) as reference:
        want = [hf_greedy(reference, p, 32) for p in TINY_PROMPTS]
    _assert_matches(got, want, "cohere2 q/k adapter")
    base = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in base] != [o.outputs[0].token_ids for o in got], "adapter changed nothing"
