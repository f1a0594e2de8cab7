"""A --max-model-len past the context a checkpoint was trained for: refused as vLLM refuses it,
unless PAGODA_ALLOW_LONG_MAX_MODEL_LEN=1 (or vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) asks for it."""
import logging

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.engine_core import ALLOW_LONG_ENV
from pagoda.model.arch import ModelArchConfig


def _llm(path: str, max_model_len: int | None) -> LLM:
    return LLM(path, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=160, max_model_len=max_model_len)


def test_past_the_trained_context_is_refused_unless_asked(tiny_llama_dir, monkeypatch, caplog):
    for name in ALLOW_LONG_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"max_model_len 1025 is past 1024, the context LlamaForCausalLM was "
                                         r"trained for .* Set PAGODA_ALLOW_LONG_MAX_MODEL_LEN=1"):
        _llm(tiny_llama_dir, 1025)
    assert _llm(tiny_llama_dir, 1024).engine.max_model_len == 1024   # up to it: served
    assert _llm(tiny_llama_dir, None).engine.max_model_len == 1024   # the default: the trained context
    for name in ALLOW_LONG_ENV:
        monkeypatch.setenv(name, "1")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pagoda.engine.engine_core"):
            llm = _llm(tiny_llama_dir, 2048)
        assert llm.engine.max_model_len == 2048
        assert "max_model_len 2048 is past 1024" in caplog.text
        prompt = [3 + i % 500 for i in range(1200)]                                      # past 1024
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 2
        monkeypatch.delenv(name)


def _arch(rope_scaling: dict | None, max_positions: int = 4096) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=rope_scaling))


def test_trained_context_follows_the_rope_scaling():
    """vLLM's rule: linear and YaRN scalings stretch the context (YaRN from its original
    length, Qwen3's 32,768 x 4), Llama 3's config states the stretched length already; a
    max_position_embeddings longer than the stretch wins."""
    assert _arch(None).trained_context == 4096
    assert _arch({"rope_type": "linear", "factor": 2.0}).trained_context == 8192
    assert _arch({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
                 max_positions=40960).trained_context == 131072
    assert _arch({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}).trained_context == 4096
    assert _arch({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}, max_positions=131072).trained_context == 131072
