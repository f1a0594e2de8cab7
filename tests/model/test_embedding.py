"""Embeddings (pagoda/pooling.py, pagoda/worker/pooler.py) against transformers on a tiny random
embedding checkpoint: a Qwen3Model (no LM head) saved in the sentence-transformers layout.

pagoda's vectors must equal transformers' final hidden states pooled (LAST / MEAN / CLS) and
L2-normalised, within 1e-4, when prompts are split over steps (chunked prefill) and when
prompts of different lengths share a step; and every KV block must be free afterwards.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from pagoda.engine.llm import LLM
from pagoda.pooling import PoolingParams
from pagoda.validation import InvalidRequestError, WrongTaskError

PROMPT_LENS = (5, 23, 40, 61)


def _write_st_layout(path: str, mode: str, normalize: bool) -> None:
    """sentence-transformers' files around a transformers checkpoint: modules.json and the
    Pooling module's config (and a Normalize module when ``normalize``)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    flags = {f"pooling_mode_{m}": m == mode for m in
             ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")}
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, **flags}, f)


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory) -> str:
    """A tiny Qwen3Model (what Qwen3-Embedding is) with mean pooling and a Normalize module."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, head_dim=32, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=1024, initializer_range=0.3,
        rope_theta=1e6, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3Model(config).eval()
    path = str(tmp_path_factory.mktemp("tiny-qwen3-embed"))
    model.save_pretrained(path, safe_serialization=True)
    _write_st_layout(path, "mean_tokens", normalize=True)
    return path


@pytest.fixture(scope="module")
def hf_model(embed_dir):
    import transformers

    return transformers.AutoModel.from_pretrained(embed_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


@torch.inference_mode()
def hf_embedding(model, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    hidden = model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=32, block_size=16, **kwargs)


def _assert_all_free(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("budget", [16, 512], ids=["chunked", "one-step"])
def test_matches_transformers(embed_dir, hf_model, prompts, pooling, budget):
    """budget 16: every prompt but the first is split over steps, chunks of several prompts
    share steps; 512: all four prompts in one step, a mixed batch."""
    llm = _llm(embed_dir, override_pooler_config={"pooling_type": pooling}, max_num_batched_tokens=budget)
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out.prompt_token_ids == ids and out.finished
        got = torch.tensor(out.outputs.embedding)
        want = hf_embedding(hf_model, ids, pooling)
        assert got.shape == want.shape == (64,)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    _assert_all_free(llm)


def test_checkpoint_config_and_request_options(embed_dir, hf_model, prompts):
    """No task given: the checkpoint's layout makes it an embedding engine with its own pooling
    (MEAN) and normalisation; a request may turn normalisation off; generating is refused."""
    llm = _llm(embed_dir, max_num_batched_tokens=32)
    pooler = llm.engine.pooler_config
    assert (pooler.pooling_type, pooler.normalize, pooler.hidden_size) == ("MEAN", True, 64)
    # MEAN pools every position: the prefix cache is off, so a repeated prompt recomputes all of it.
    assert not llm.engine.kv_manager.enable_caching
    first, again, raw = llm.embed([{"prompt_token_ids": prompts[2]}] * 2 + [{"prompt_token_ids": prompts[2]}],
                                  [PoolingParams(), PoolingParams(), PoolingParams(normalize=False)], use_tqdm=False)
    torch.testing.assert_close(torch.tensor(first.outputs.embedding), torch.tensor(again.outputs.embedding))
    want_raw = hf_embedding(hf_model, prompts[2], "MEAN", normalize=False)
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), want_raw, atol=1e-4, rtol=1e-4)
    assert abs(float(torch.tensor(raw.outputs.embedding).norm()) - 1.0) > 1e-2  # really not normalised
    with pytest.raises(WrongTaskError):
        llm.generate([{"prompt_token_ids": prompts[0]}], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        llm.embed([{"prompt_token_ids": prompts[0]}], PoolingParams(dimensions=16), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        llm.embed([{"prompt_token_ids": [1] * (llm.engine.max_model_len + 1)}], use_tqdm=False)
    # A prompt of exactly the context length fits: nothing is generated after it.
    n = llm.engine.max_model_len
    assert len(llm.embed([{"prompt_token_ids": [7] * n}], use_tqdm=False)[0].outputs.embedding) == 64
    _assert_all_free(llm)


def test_matryoshka_dimensions(embed_dir, hf_model, prompts):
    """Truncated then re-normalised; only the listed widths are offered."""
    llm = _llm(embed_dir, override_pooler_config={"matryoshka_dimensions": [16, 32]})
    out = llm.embed([{"prompt_token_ids": prompts[1]}], PoolingParams(dimensions=16), use_tqdm=False)[0]
    full = hf_embedding(hf_model, prompts[1], "MEAN", normalize=False)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding),
                               torch.nn.functional.normalize(full[:16], dim=-1), atol=1e-4, rtol=0)
    with pytest.raises(InvalidRequestError, match=r"one of \[16, 32\]"):
        llm.embed([{"prompt_token_ids": prompts[1]}], PoolingParams(dimensions=8), use_tqdm=False)
    _assert_all_free(llm)


def test_tasks_are_kept_apart(tiny_llama_dir, embed_dir):
    """A causal LM generates unless told to embed; a checkpoint with no LM head cannot generate."""
    llm = _llm(tiny_llama_dir)
    assert llm.engine.pooler_config is None
    with pytest.raises(WrongTaskError):
        llm.embed([{"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)
    with pytest.raises(ValueError, match="no LM head"):
        _llm(embed_dir, task="generate")
    with pytest.raises(ValueError, match="apply to an embedding engine"):
        _llm(tiny_llama_dir, task="generate", override_pooler_config={"pooling_type": "MEAN"})
