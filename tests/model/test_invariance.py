"""The same greedy tokens whatever the batching, caching, chunking or preemption.

Every run computes the same 32 mixed-length chat requests (some share a long
system prompt, so prefix caching has something to hit) on the default model
and must give the baseline's tokens. A divergence is excused only at a genuine
near-tie (top-2 logits within 1e-4), and each excused case is reported.
"""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from tests.model.helpers import compare_greedy, logprob_gap

MAX_TOKENS = 24
SYSTEM = (
    "You are a careful assistant for a library. You answer questions about books, "
    "authors, opening hours and borrowing rules. Keep answers short and friendly, and "
    "never invent a book that does not exist."
)
TOPICS = [
    "a mystery novel", "the history of Rome", "how to bake bread", "black holes", "gardening",
    "chess openings", "learning Python", "the French revolution", "jazz music", "volcanoes",
    "a children's picture book", "poetry", "the Moon landing", "knitting", "sharks", "trains",
]


def _conversations() -> list[list[dict]]:
    convs = []
    for i, topic in enumerate(TOPICS * 2):
        question = f"Can you recommend a book about {topic}?" + " Please explain why." * (i % 5)
        if i % 2 == 0:
            convs.append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
        else:
            convs.append([{"role": "user", "content": question}])
    return convs


def _run(prompts, **engine_kwargs):
    llm = LLM(show_progress=False, **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks
    return llm, [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from pagoda.hub.gguf_file import GGUFFile
    from pagoda.hub.paths import default_model_path
    from pagoda.model.loader import LoadedModel
    from pagoda.tokenizer import build_tokenizer

    md = GGUFFile(default_model_path()).metadata
    tok = build_tokenizer(LoadedModel(None, None, "", gguf_metadata=md), None)  # type: ignore[arg-type]
    return [tok.encode(tok.apply_chat_template(c), add_special_tokens=False) for c in _conversations()]


@pytest.fixture(scope="module")
def baseline(prompts):
    # No prefix cache, one big batch, prompts computed whole.
    _, outs = _run(prompts, enable_prefix_caching=False, max_num_batched_tokens=8192, num_kv_blocks=1024)
    return outs


def _assert_same(outs, baseline, label) -> list[str]:
    excused = []
    for i, (got, want) in enumerate(zip(outs, baseline)):
        result = compare_greedy(
            got.token_ids, want.token_ids,
            lambda pos: min(logprob_gap(got, pos), logprob_gap(want, pos)),
            f"{label} request {i}",
        )
        assert result.equal, result.excused
        excused += result.excused
    for line in excused:
        print("excused:", line)
    return excused


@pytest.mark.slow
def test_prefix_caching_on_gives_same_tokens(prompts, baseline):
    # 16-token blocks: the chat prompts are shorter than one 64-token CPU block.
    llm, first = _run(prompts, enable_prefix_caching=True, max_num_batched_tokens=8192, num_kv_blocks=1024,
                      block_size=16)
    _assert_same(first, baseline, "prefix-cache cold")
    # Second pass: the whole prompts are now cached.
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in outs)
    stats = llm.engine.scheduler.make_stats()
    assert stats.prefix_cache_hits > 0
    _assert_same([o.outputs[0] for o in outs], baseline, "prefix-cache warm")


@pytest.mark.slow
def test_small_chunked_prefill_gives_same_tokens(prompts, baseline):
    llm, outs = _run(prompts, max_num_batched_tokens=32, num_kv_blocks=1024)
    _assert_same(outs, baseline, "budget 32")


@pytest.mark.slow
def test_batch_of_one_gives_same_tokens(prompts, baseline):
    llm = LLM(show_progress=False, num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    picks = list(range(0, len(prompts), 4))
    outs = [llm.generate({"prompt_token_ids": prompts[i]}, params, use_tqdm=False)[0].outputs[0] for i in picks]
    _assert_same(outs, [baseline[i] for i in picks], "batch of 1")


@pytest.mark.slow
def test_preemption_gives_same_tokens(prompts, baseline):
    # Room for only a few requests at once: the scheduler must preempt.
    llm, outs = _run(prompts, num_kv_blocks=24, max_model_len=256, max_num_batched_tokens=256)
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_same(outs, baseline, "preemption")
