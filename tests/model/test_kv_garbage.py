"""The KV pool is allocated uninitialized: whatever its unused slots hold must not reach outputs."""

from __future__ import annotations

from pagoda import SamplingParams


def test_nan_in_unwritten_kv_slots_does_not_leak_into_decodes(tiny_llama_dir):
    from pagoda import LLM

    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=64, max_model_len=256,
              enable_prefix_caching=False)  # the poison below would also hit cached blocks
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": list(range(5, 30))}]
    clean = llm.generate(prompts, params, use_tqdm=False)
    for cache in llm.engine.runner.kv_caches:
        cache.fill_(float("nan"))   # what a reused allocation may hold
    # The short request decodes next to a long one: its padded positions read unwritten slots.
    dirty = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dirty] == [o.outputs[0].token_ids for o in clean]
