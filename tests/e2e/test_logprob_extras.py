"""echo, prompt_logprobs, logprob_token_ids, best_of and beam search through the real server
and the official openai client (vLLM's fields through extra_body); logprobs checked against
transformers; clear 400s for what cannot be honoured; every KV block back afterwards."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import torch

from pagoda.config import EngineConfig
from tests.e2e.server_utils import real_engine_server

MODEL = "smollm2"
PROMPT = "The lighthouse keeper climbed the stairs every evening and lit the lamp that guided the boats home."
TOL = 1e-3


@pytest.fixture(scope="module")
def real_server():
    # Steps of 32 tokens: prompts are prefilled in chunks.
    config = EngineConfig(show_progress=False, num_kv_blocks=256, max_model_len=1024, block_size=16,
                          max_num_batched_tokens=32)  # fmt: skip
    with real_engine_server(config, served_model_name=MODEL) as (engine, running):
        yield engine, running


@pytest.fixture
def client(real_server):
    _, running = real_server
    with openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c
    _assert_all_blocks_free(running)


def _assert_all_blocks_free(running, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{running.base_url}/v1/engine/stats", timeout=10).json()
        if stats["num_running_reqs"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]:
            return
        assert time.monotonic() < deadline, f"KV blocks not all back: {stats}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def prompt_ids(real_server) -> list[int]:
    engine, _ = real_server
    return engine.tokenizer.encode(PROMPT, add_special_tokens=True)


@pytest.fixture(scope="module")
def hf_prompt_logprobs(hf_default_model, prompt_ids) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf_default_model(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)


def test_echo_with_logprobs_matches_transformers(client, prompt_ids, hf_prompt_logprobs):
    comp = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                                     temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    choice = comp.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    lp = choice.logprobs
    n = len(prompt_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(hf_prompt_logprobs[i - 1, prompt_ids[i]].item(), abs=TOL)
        top2 = sorted(lp.top_logprobs[i].values(), reverse=True)[:2]
        assert top2 == pytest.approx(hf_prompt_logprobs[i - 1].topk(2).values.tolist(), abs=TOL)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens[n:]) == plain.choices[0].text
    assert getattr(choice, "prompt_logprobs", None) is None  # not asked for: not in the response


def test_streamed_echo_with_logprobs_equals_the_whole_response(client, prompt_ids):
    kwargs = dict(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**kwargs).choices[0]
    text, tokens, token_logprobs, top, offsets = "", [], [], [], []
    chunks = list(client.completions.create(stream=True, **kwargs))
    first = chunks[0].choices[0]
    assert first.text == PROMPT and len(first.logprobs.tokens) == len(prompt_ids)  # the prompt comes first
    for chunk in chunks:
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                token_logprobs += c.logprobs.token_logprobs
                top += c.logprobs.top_logprobs
                offsets += c.logprobs.text_offset
    lp = whole.logprobs
    assert text == whole.text
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert token_logprobs[0] is None and top[0] is None
    assert token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert [sorted(t) for t in top[1:]] == [sorted(t) for t in lp.top_logprobs[1:]]


def test_prompt_logprobs_on_completions_and_chat(client, prompt_ids, hf_prompt_logprobs):
    comp = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 1})  # fmt: skip
    plp = comp.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(prompt_ids) and plp[0] is None
    for i in range(1, len(prompt_ids)):
        entry = plp[i][str(prompt_ids[i])]
        assert entry["logprob"] == pytest.approx(hf_prompt_logprobs[i - 1, prompt_ids[i]].item(), abs=TOL)
        assert entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)
        assert 1 <= len(plp[i]) <= 2  # the prompt token and the top 1 (the same token when it is the top)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                          max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0})  # fmt: skip
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == chat.usage.prompt_tokens
    assert all(len(p) == 1 and next(iter(p.values()))["logprob"] <= 0 for p in plp[1:])


def test_logprob_token_ids_in_top_logprobs(client):
    tracked = [11, 260, 30]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to three"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=1,
                                          extra_body={"logprob_token_ids": tracked})  # fmt: skip
    positions = chat.choices[0].logprobs.content
    assert len(positions) == 3
    for position in positions:
        # The top 1, then each tracked token not already the top one.
        assert 3 <= len(position.top_logprobs) <= 4
        assert all(t.logprob <= position.top_logprobs[0].logprob + 1e-6 for t in position.top_logprobs)


def test_best_of_returns_the_highest_cumulative_logprob(client):
    common = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 5}
    every = client.completions.create(n=3, logprobs=0, **common)
    sums = [sum(c.logprobs.token_logprobs) for c in every.choices]
    assert len({c.text for c in every.choices}) > 1
    best = client.completions.create(n=1, best_of=3, **common)
    assert len(best.choices) == 1
    assert best.choices[0].text == every.choices[max(range(3), key=lambda i: sums[i])].text


def test_beam_search_width_one_is_greedy_and_wider_beams_differ(client):
    common = {"model": MODEL, "prompt": "The best way to learn to cook is", "max_tokens": 5, "temperature": 0}
    greedy = client.completions.create(**common, extra_body={"ignore_eos": True})
    one = client.completions.create(n=1, **common, extra_body={"use_beam_search": True, "ignore_eos": True})
    assert one.choices[0].text == greedy.choices[0].text
    three = client.completions.create(n=3, **common, extra_body={"use_beam_search": True, "ignore_eos": True,
                                                                 "length_penalty": 0.5})  # fmt: skip
    assert len({c.text for c in three.choices}) == 3
    assert [c.index for c in three.choices] == [0, 1, 2]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                          n=2, max_tokens=6, temperature=0,
                                          extra_body={"use_beam_search": True, "early_stopping": True})  # fmt: skip
    assert len(chat.choices) == 2 and all(c.message.content for c in chat.choices)


@pytest.mark.parametrize(("call", "kwargs", "needle"), [
    ("completions", {"n": 3, "best_of": 2}, "best_of"),
    ("completions", {"best_of": 2, "stream": True, "temperature": 1.0}, "stream"),
    ("completions", {"stream": True, "extra_body": {"use_beam_search": True}}, "stream"),
    ("completions", {"logprobs": 21}, "20"),
    ("completions", {"extra_body": {"prompt_logprobs": 25}}, "20"),
    ("completions", {"logprobs": -1}, "whole vocabulary"),
    ("completions", {"extra_body": {"length_penalty": 2.0}}, "beam"),
    ("completions", {"top_p": 0.5, "extra_body": {"use_beam_search": True}}, "top_p"),
    ("completions", {"extra_body": {"logprob_token_ids": [1]}}, "logprob_token_ids"),
    ("completions", {"logprobs": 0, "extra_body": {"logprob_token_ids": [10**7]}}, "logprob_token_ids"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "whole vocabulary"),
    ("chat", {"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ("chat", {"logprobs": True, "extra_body": {"use_beam_search": True}}, "logprobs"),
])  # fmt: skip
def test_clear_400s(client, call, kwargs, needle):
    with pytest.raises(openai.BadRequestError) as info:
        if call == "chat":
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                           max_tokens=2, **kwargs)  # fmt: skip
        else:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, **kwargs)
    assert needle in info.value.body["message"] if isinstance(info.value.body, dict) else needle in str(info.value)
    assert info.value.status_code == 400


def test_streamed_echo_sends_the_prompt_first(client):
    """After the 400s above the server still serves; a streamed echo starts with the prompt."""
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                            stream=True))  # fmt: skip
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT + plain.choices[0].text
