"""vLLM's allowed_token_ids and bad_words on the bundled model, offline and over HTTP: greedy
tokens only from the list, and a bad word the model would write never written (its tokens
after a space too), the rest of the output unchanged up to it."""

from __future__ import annotations

import httpx
import pytest

from pagoda import LLM, SamplingParams
from pagoda.validation import InvalidRequestError

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm():
    return LLM(show_progress=False, num_kv_blocks=64, block_size=16)


def _greedy(llm, **kwargs) -> list[int]:
    [out] = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **kwargs),
                         use_tqdm=False)
    return out.outputs[0].token_ids


def test_allowed_token_ids(llm) -> None:
    free = _greedy(llm)
    allowed = sorted(set(free[1:]) | {42, 1000})   # not the first token the model wants
    got = _greedy(llm, allowed_token_ids=allowed)
    assert set(got) <= set(allowed) and got[0] != free[0]
    with pytest.raises(InvalidRequestError, match="out of range"):
        _greedy(llm, allowed_token_ids=[10**7])


def test_bad_words(llm) -> None:
    free = _greedy(llm)
    tok = llm.get_tokenizer()
    word = tok.decode(free[:2]).strip()   # the model's first words
    got = _greedy(llm, bad_words=[word])
    banned = [tok.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    text_ids = got
    for seq in banned:
        assert not any(text_ids[i:i + len(seq)] == seq for i in range(len(text_ids))), (word, got)
    assert got != free


def test_over_http(llm) -> None:
    from pagoda.config import EngineConfig
    from tests.e2e.server_utils import real_engine_server

    config = EngineConfig(show_progress=False, num_kv_blocks=64, block_size=16, max_model_len=512)
    free = _greedy(llm)
    with real_engine_server(config, served_model_name="m") as (_, running):
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        r = httpx.post(f"{running.base_url}/v1/completions", json={**body, "allowed_token_ids": [42, 1000]},
                       timeout=60)
        assert r.status_code == 200 and set(r.json()["choices"][0]["token_ids"]) <= {42, 1000}
        r = httpx.post(f"{running.base_url}/v1/completions",
                       json={**body, "bad_words": [llm.get_tokenizer().decode(free[:1]).strip()]}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"][0] != free[0]
        r = httpx.post(f"{running.base_url}/v1/completions", json={**body, "allowed_token_ids": []}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"
