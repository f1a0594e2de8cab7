"""The offline API on the default model: outputs, n > 1, stops, logprobs, bad input."""

from __future__ import annotations

import json
import math
import os

import pytest

from pagoda import LLM, SamplingParams
from pagoda.hub.gguf_file import GGUFError
from pagoda.hub.paths import ModelLoadError
from pagoda.model.arch import UnsupportedModelError


@pytest.fixture(scope="module")
def llm():
    # PAGODA_TEST_QUANTIZATION=int8|q4 runs this module in a quantized mode (none by default).
    quantization = os.environ.get("PAGODA_TEST_QUANTIZATION", "none")
    return LLM(show_progress=False, num_kv_blocks=512, max_model_len=2048, quantization=quantization)


def _all_free(llm):
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


def test_generate_strings_and_token_ids(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(["The capital of France is", {"prompt_token_ids": [1, 4093, 198]}], params, use_tqdm=False)
    assert len(outs) == 2
    first = outs[0]
    assert first.prompt == "The capital of France is"
    assert first.prompt_token_ids == llm.get_tokenizer().encode("The capital of France is")
    assert len(first.outputs[0].token_ids) == 8
    assert first.outputs[0].finish_reason == "length"
    assert first.outputs[0].text == llm.get_tokenizer().decode(first.outputs[0].token_ids)
    assert outs[1].prompt_token_ids == [1, 4093, 198]
    _all_free(llm)


def test_chat_stops_at_eos(llm):
    out = llm.chat([{"role": "user", "content": "Say just the word hello."}],
                   SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert len(out.token_ids) < 64
    assert out.token_ids[-1] in llm.get_tokenizer().eos_token_ids
    assert "hello" in out.text.lower()


def test_n_samples_share_prompt_blocks_and_are_reproducible(llm):
    prompt = "Once upon a time, in a land far away, there lived a dragon who " * 4
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    hits_before = llm.engine.scheduler.make_stats().prefix_cache_hits
    out1 = llm.generate(prompt, params, use_tqdm=False)[0]
    hits_after = llm.engine.scheduler.make_stats().prefix_cache_hits
    assert [o.index for o in out1.outputs] == [0, 1, 2]
    # Samples 1 and 2 reuse the full prompt blocks computed for sample 0.
    full_blocks = (len(out1.prompt_token_ids) - 1) // 16 * 16
    assert hits_after - hits_before >= 2 * full_blocks
    texts = [o.token_ids for o in out1.outputs]
    assert len({tuple(t) for t in texts}) > 1
    out2 = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [o.token_ids for o in out2.outputs] == texts
    _all_free(llm)


def test_stop_string_truncates_and_stop_token_ids(llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = "List the days of the week: Monday, Tuesday,"
    full = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    stop = full.text[8:12]
    assert stop.strip()
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]
    token = full.token_ids[5]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[token]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(token) + 1]
    assert out.stop_reason == token
    _all_free(llm)


def test_logprobs_are_consistent(llm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    out = llm.generate("The quick brown fox", params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry
        assert entry[token].rank == 1          # greedy picks the top token
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
        assert all(lp.logprob <= 0 for lp in entry.values())
        total += entry[token].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-6)


def test_bad_requests_raise_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 2048}, SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**6]}, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    _all_free(llm)
    out = llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


def test_bad_model_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="not found; looked for it at"):
        LLM(str(tmp_path / "missing"))
    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 7)
    with pytest.raises(GGUFError):
        LLM(str(corrupt))
    folder = tmp_path / "gpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        LLM(str(folder))
