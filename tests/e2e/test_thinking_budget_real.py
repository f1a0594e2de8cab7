"""The two-phase thinking budget over the real engine and the default model: phase 2 continues
phase 1 exactly. SmolLM2 never writes ``<think>``, so with the qwen3 parser a budget that
binds splits the generation without forcing anything, and greedy decoding must give the text
one request gives; every KV block comes back after both phases."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from pagoda.config import EngineConfig
from tests.e2e.server_utils import RunningServer, real_engine_server

MODEL = "smollm2"
ASK = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def real_server() -> Iterator[RunningServer]:
    config = EngineConfig(show_progress=False, num_kv_blocks=256, max_model_len=1024)
    with real_engine_server(config, served_model_name=MODEL, reasoning_parser="qwen3") as (_, running):
        yield running


def test_continuation_equals_one_request(real_server: RunningServer) -> None:
    with openai.OpenAI(base_url=f"{real_server.base_url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0)
        split = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0,
                                               extra_body={"thinking_token_budget": 8})  # fmt: skip
        streamed = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0,
                                                  extra_body={"thinking_token_budget": 8}, stream=True)  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert whole.usage.completion_tokens > 8, "the budget must bind for this test to mean anything"
    assert split.choices[0].message.content == whole.choices[0].message.content == text
    assert split.usage.completion_tokens == whole.usage.completion_tokens
    assert split.choices[0].finish_reason == whole.choices[0].finish_reason
    assert split.usage.prompt_tokens == whole.usage.prompt_tokens
    deadline = time.monotonic() + 30
    while True:
        stats = httpx.get(f"{real_server.base_url}/v1/engine/stats", timeout=10).json()
        if stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0 and stats["kv_cache_usage"] == 0:
            break
        assert time.monotonic() < deadline, f"engine not idle: {stats}"
        time.sleep(0.1)
    assert stats["num_free_blocks"] == stats["num_blocks"]
