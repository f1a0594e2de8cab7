"""8-bit KV cache (--kv-cache-dtype int8|fp8): accuracy, capacity, and swap of quantized blocks."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.attention import AttentionMetadata
from pagoda.attention.kv_quant import QuantizedKVCache
from pagoda.config import EngineConfig
from pagoda.engine.engine_core import EngineCore
from pagoda.engine.messages import EngineCoreRequest
from tests.model.helpers import compare_greedy
from tests.model.test_swap import poison
from tests.model.test_reference import CHATS


@pytest.mark.parametrize("dtype, tol", [(torch.int8, 0.5 / 127 + 1e-6), (torch.float8_e4m3fn, 0.07)])
def test_quantized_cache_round_trip(dtype: torch.dtype, tol: float) -> None:
    cache = QuantizedKVCache(4, 4, 2, 8, dtype, "cpu")
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(6, 2, 8, generator=gen) * torch.tensor([0.01, 30.0])[None, :, None]
    v = torch.randn(6, 2, 8, generator=gen)
    slots = torch.tensor([3, 0, 9, 10, 15, 4])
    cache.write(slots, k, v)
    for i, x in enumerate((k, v)):
        got = cache.read(i, slots, torch.float32)
        # Error relative to each vector's largest element (one scale per token and head).
        err = (got - x).abs() / x.abs().amax(-1, keepdim=True)
        assert err.max().item() <= tol
    # Small and large heads of the same token keep their own precision.
    assert ((cache.read(0, slots, torch.float32) - k)[:, 0].abs().max() < 1e-3)
    assert QuantizedKVCache.bytes_per_block(16, 2, 64) == 2 * 16 * 2 * 68


@pytest.fixture(scope="module")
def llm():
    return LLM(show_progress=False, num_kv_blocks=128, max_model_len=512)


def test_int8_kv_keeps_greedy_tokens_of_fp32_kv(llm):
    """Teacher-forced on the fp32-KV greedy continuation: at >= 95 % of positions, the next
    token with int8 KV (prompt written as one chunk, then one token per step through the
    decode path) is the one fp32 KV chose."""
    tok = llm.get_tokenizer()
    model = llm.engine.runner.model
    c = model.config
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True), add_special_tokens=False)
               for m in CHATS[:4]]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    same = total = 0
    for prompt, out in zip(prompts, outs):
        gen = list(out.outputs[0].token_ids)
        ids = prompt + gen
        num_blocks = -(-len(ids) // 16)
        caches = [QuantizedKVCache(num_blocks, 16, c.num_key_value_heads, c.head_dim, torch.int8, "cpu")
                  for _ in range(c.num_hidden_layers)]  # fmt: skip
        table = list(range(num_blocks))
        done, chunks = 0, [len(prompt)] + [1] * (len(gen) - 1)
        with torch.inference_mode():
            for n in chunks:
                meta = AttentionMetadata.build([n], [done], [table], 16, torch.device("cpu"))
                hidden = model(torch.tensor(ids[done:done + n]), torch.arange(done, done + n), caches, meta)
                done += n
                predicted = int(model.compute_logits(hidden[-1:])[0].argmax())
                same += predicted == ids[done]
                total += 1
    assert total == sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"int8 KV: {same}/{total} greedy positions as with fp32 KV")
    assert same / total >= 0.95, f"{same}/{total}"


def test_int8_kv_engine_capacity_and_swap(tiny_llama_dir):
    base = dict(model=tiny_llama_dir, show_progress=False, block_size=16, max_model_len=64, max_num_batched_tokens=64,
                enable_prefix_caching=False)  # fmt: skip
    fp32 = EngineCore(EngineConfig(**base, kv_cache_memory=1 << 20), collect_stats=False)
    int8 = EngineCore(EngineConfig(**base, kv_cache_memory=1 << 20, kv_cache_dtype="int8"), loaded=fp32.loaded,
                      collect_stats=False)  # fmt: skip
    # Same memory, at least twice the blocks (about 3.8x against float32 K/V).
    assert int8.num_blocks >= 2 * fp32.num_blocks
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (20,), generator=gen).tolist() for _ in range(4)]

    def run(core: EngineCore):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
        for i, p in enumerate(prompts):
            core.add_request(EngineCoreRequest(f"r{i}", p, params))
        tokens: dict[str, list[int]] = {}
        gaps: dict[str, list[float]] = {}
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                gaps.setdefault(out.request_id, []).extend(
                    lp.top_logprobs[0] - lp.top_logprobs[1] for lp in out.new_logprobs or [])
            core.check_integrity()
        core.scheduler.schedule()
        assert core.kv_manager.num_free_blocks == core.num_blocks
        return tokens, gaps

    want, want_gaps = run(poison(int8))
    # Forced swap preemptions move int8 blocks and their scales to the host pool and back.
    tight = EngineCore(EngineConfig(**base, num_kv_blocks=7, kv_cache_dtype="int8", preemption_mode="swap",
                                    swap_space=1 << 20), loaded=fp32.loaded, collect_stats=False)  # fmt: skip
    poison(tight)
    got, got_gaps = run(tight)
    assert tight.scheduler.num_swap_preemptions > 0
    assert tight.scheduler.host.num_free_blocks == tight.scheduler.host.num_blocks
    # Identical K/V bytes in and out: the same tokens (a divergence only at a near-tie).
    for rid in want:
        cmp = compare_greedy(got[rid], want[rid], lambda pos: min(got_gaps[rid][pos], want_gaps[rid][pos]), rid)
        assert cmp.equal, cmp.excused
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")


def test_a_long_float32_cache_gets_a_start_up_hint(tiny_llama_dir, caplog, monkeypatch):
    """The exact mode keeps float32 KV (transformers' numbers); with a long context the log
    says what float16 KV would trade, and says nothing where the choice was made already."""
    import logging

    from pagoda.engine.engine_core import LONG_CONTEXT_HINT

    # The tiny model was trained for 1,024 positions: a longer max_model_len needs the override.
    monkeypatch.setenv("PAGODA_ALLOW_LONG_MAX_MODEL_LEN", "1")

    base = dict(model=tiny_llama_dir, show_progress=False, max_model_len=LONG_CONTEXT_HINT,
                kv_cache_memory=4 << 20)  # fmt: skip
    first = None
    for kv, said in (("auto", True), ("float16", False)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pagoda.engine.engine_core"):
            first = EngineCore(EngineConfig(**base, kv_cache_dtype=kv), loaded=first.loaded if first else None,
                               collect_stats=False)  # fmt: skip
        assert ("--kv-cache-dtype float16 halves that" in caplog.text) is said, kv
