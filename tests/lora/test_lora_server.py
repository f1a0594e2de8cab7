"""LoRA over HTTP: the real server and engine-core process with the default model, the openai client."""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest

from pagoda.config import EngineConfig
from tests.e2e.server_utils import running_server

MODEL = "smollm2"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def lora_server(default_adapters):
    from pagoda.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_config(EngineConfig(show_progress=False, num_kv_blocks=256, max_model_len=1024,
                                               enable_lora=True, max_loras=2))
    # Runtime loading is off by default: allowed here, from the adapters' folder only.
    root = os.path.dirname(default_adapters["all"])
    with running_server(engine, served_model_name=MODEL, shutdown_engine=True, allow_runtime_lora=True,
                        lora_roots=(root,)) as running:  # fmt: skip
        running.call(engine.add_lora("all", default_adapters["all"]))   # what --lora-modules does
        yield engine, running


@pytest.fixture
def client(lora_server):
    _, running = lora_server
    with openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def _complete(client, model: str, max_tokens: int = 12) -> str:
    return _complete_lp(client, model, max_tokens)[0]


def _complete_lp(client, model: str, max_tokens: int = 12) -> tuple[str, list[float]]:
    """The text and its tokens' logprobs (an adapter always moves them, even where the text agrees)."""
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, logprobs=0)
    assert out.model == model
    return out.choices[0].text, out.choices[0].logprobs.token_logprobs


def _differ(a: tuple[str, list[float]], b: tuple[str, list[float]]) -> bool:
    return a[0] != b[0] or max(abs(x - y) for x, y in zip(a[1], b[1])) > 1e-3


def _wait_idle(running, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{running.base_url}/v1/engine/stats", timeout=10).json()
        if stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0 and stats["kv_cache_usage"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {stats}")
        time.sleep(0.1)


def test_models_list_adapters_with_their_parent(lora_server, client, default_adapters):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL, "all"}
    assert models["all"].parent == MODEL and models["all"].root == default_adapters["all"]
    assert client.models.retrieve("all").parent == MODEL


def test_load_use_unload_adapters(lora_server, client, default_adapters):
    _, running = lora_server
    base = _complete_lp(client, MODEL)
    with_all = _complete_lp(client, "all")
    assert _differ(with_all, base)
    r = client.post("/load_lora_adapter", cast_to=httpx.Response,
                    body={"lora_name": "mlp", "lora_path": default_adapters["mlp"]})
    assert r.status_code == 200 and "mlp" in r.text
    with_mlp = _complete_lp(client, "mlp")
    assert _differ(with_mlp, base) and _differ(with_mlp, with_all)
    chat = client.chat.completions.create(model="mlp", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == "mlp"
    # A third adapter with max_loras=2: it waits for a slot (LRU), then runs.
    r = client.post("/load_lora_adapter", cast_to=httpx.Response,
                    body={"lora_name": "attn", "lora_path": default_adapters["attn"]})
    assert r.status_code == 200
    with_attn = _complete_lp(client, "attn")
    assert all(_differ(with_attn, other) for other in (base, with_all, with_mlp))
    again = _complete_lp(client, "all")               # reloaded into a slot: the same numbers
    assert again[0] == with_all[0] and not _differ(again, with_all)
    assert {m.id for m in client.models.list().data} == {MODEL, "all", "mlp", "attn"}

    for name in ("mlp", "attn"):
        r = client.post("/unload_lora_adapter", cast_to=httpx.Response, body={"lora_name": name})
        assert r.status_code == 200
    assert {m.id for m in client.models.list().data} == {MODEL, "all"}
    with pytest.raises(openai.NotFoundError, match="mlp"):
        _complete(client, "mlp")
    with pytest.raises(openai.NotFoundError, match="not loaded"):
        client.post("/unload_lora_adapter", cast_to=httpx.Response, body={"lora_name": "mlp"})
    _wait_idle(running)


def test_load_errors(lora_server, client, default_adapters, tmp_path):
    with pytest.raises(openai.BadRequestError, match="already been loaded"):
        client.post("/load_lora_adapter", cast_to=httpx.Response,
                    body={"lora_name": "all", "lora_path": default_adapters["all"]})
    # Outside the --lora-root folders, missing or not a folder: one answer that tells nothing more.
    (tmp_path / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}')
    refused = set()
    for path in (str(tmp_path / "missing"), str(tmp_path), default_adapters["all"] + "/adapter_config.json"):
        with pytest.raises(openai.BadRequestError, match="must name an adapter folder inside") as info:
            client.post("/load_lora_adapter", cast_to=httpx.Response, body={"lora_name": "nope", "lora_path": path})
        refused.add(str(info.value))
    assert len(refused) == 1
    bad = os.path.join(os.path.dirname(default_adapters["all"]), "bad")
    os.makedirs(bad, exist_ok=True)
    with open(os.path.join(bad, "adapter_config.json"), "w") as f:
        f.write('{"r": 4, "lora_alpha": 8, "target_modules": ["lm_head"]}')
    with open(os.path.join(bad, "adapter_model.safetensors"), "wb"):
        pass
    with pytest.raises(openai.BadRequestError, match="unsupported target module 'lm_head'"):
        client.post("/load_lora_adapter", cast_to=httpx.Response, body={"lora_name": "bad", "lora_path": bad})
    with pytest.raises(openai.BadRequestError, match="lora_path"):
        client.post("/load_lora_adapter", cast_to=httpx.Response, body={"lora_name": "x"})
    assert {m.id for m in client.models.list().data} == {MODEL, "all"}
    assert _complete(client, MODEL)   # still serving


def test_unloading_an_adapter_in_use_is_refused(lora_server, client):
    _, running = lora_server
    stream = client.completions.create(model="all", prompt=PROMPT, max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.model == "all"
    with pytest.raises(openai.ConflictError, match="in use by 1 running or waiting request"):
        client.post("/unload_lora_adapter", cast_to=httpx.Response, body={"lora_name": "all"})
    assert "all" in {m.id for m in client.models.list().data}
    metrics = httpx.get(f"{running.base_url}/metrics", timeout=10).text
    assert 'running_lora_adapters="all"' in metrics and 'max_lora="2"' in metrics
    stream.close()
    _wait_idle(running)
    metrics = httpx.get(f"{running.base_url}/metrics", timeout=10).text
    line = next(ln for ln in metrics.splitlines() if ln.startswith('pagoda:lora_generation_tokens_total{') and '"all"' in ln)
    assert float(line.rsplit(" ", 1)[1]) > 0
    r = client.post("/unload_lora_adapter", cast_to=httpx.Response, body={"lora_name": "all"})
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "all")
