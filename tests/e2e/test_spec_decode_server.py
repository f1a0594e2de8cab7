"""The server with --speculative-config: completions work and spec_decode_* reach /metrics."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.config import EngineConfig
from tests.e2e.server_utils import running_server

MODEL = "smollm2-spec"


@pytest.fixture(scope="module")
def http():
    from pagoda.engine.async_llm import AsyncLLM

    config = EngineConfig(show_progress=False, num_kv_blocks=64, max_model_len=512,
                          speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    engine = AsyncLLM.from_config(config)
    with running_server(engine, served_model_name=MODEL, shutdown_engine=True) as running:
        with httpx.Client(base_url=running.base_url, timeout=300) as client:
            yield client


def _counters(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(http.get("/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def test_speculative_completion_and_metrics(http):
    before = _counters(http)
    prompt = "one two three four five six seven eight, one two three four five six seven eight, one two"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    spec = r.json()["choices"][0]["text"]
    # Logprobs turn speculation off for the request: the same text the plain way.
    r = http.post("/v1/completions", json={**body, "logprobs": 1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == spec
    after = _counters(http)

    def delta(name: str, **labels: str) -> float:
        key = (f"pagoda:{name}", tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    drafts = delta("spec_decode_num_drafts_total")
    draft_tokens = delta("spec_decode_num_draft_tokens_total")
    accepted = delta("spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and draft_tokens >= drafts
    assert 0 < accepted <= draft_tokens
    per_pos = [delta("spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
