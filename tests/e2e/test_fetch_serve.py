"""Models fetched as users fetch them (#47), end to end against local servers that speak the
Hub's and Ollama's registry protocols (tests/hub_servers.py): `pagoda serve ORG/NAME:QUANT`
from an empty cache answers its first chat completion with no other step, and a second start
with the Hub gone serves from the cache; `pagoda pull` of an Ollama-registry model, then
`pagoda run` of it, then `pagoda rm`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from pagoda.entrypoints.cli import main
from pagoda.hub.paths import default_model_path
from tests.e2e.server_utils import serve_process
from tests.hub_servers import FakeHub, FakeOllamaRegistry

REPO = Path(__file__).resolve().parents[2]
QUESTION = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def smol_bytes() -> bytes:
    return Path(default_model_path()).read_bytes()   # the bundled chat model, ~100 MB


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PAGODA_", "OLLAMA_"))}
    env.update(HF_HUB_CACHE=str(tmp_path / "hf"), HF_HOME=str(tmp_path / "hf-home"),
               PAGODA_MODELS=str(tmp_path / "models"), OLLAMA_MODELS=str(tmp_path / "ollama"),
               PYTHONPATH=str(REPO), **extra)
    return env


def _serve_and_chat(name: str, env: dict[str, str]) -> str:
    with serve_process([name, "--num-kv-blocks", "32", "--max-model-len", "1024"], env) as (_, base), \
            openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120) as client:
        assert [m.id for m in client.models.list().data] == [name]   # served under its Hub name
        reply = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=8, temperature=0)
    return reply.choices[0].message.content


def test_serve_a_hub_name_from_an_empty_cache_then_from_the_cache(tmp_path, smol_bytes):
    with FakeHub() as hub:
        hub.add_repo("org/SmolLM2-GGUF", files={"README.md": "# a model card", "smol.Q4_1.gguf": smol_bytes,
                                                "smol.Q8_0.gguf": b"GGUF not this one"})
        env = _env(tmp_path, HF_ENDPOINT=hub.url)
        first = _serve_and_chat("org/SmolLM2-GGUF:Q4_1", env)
        fetched = {r.path.rsplit("/", 1)[-1] for r in hub.model_requests() if "/resolve/" in r.path}
    assert first and fetched == {"smol.Q4_1.gguf"}   # one quant, no model card
    # The Hub is gone: the second start serves the cached file, and says the same.
    assert _serve_and_chat("org/SmolLM2-GGUF:Q4_1", env) == first


def test_pull_from_an_ollama_registry_then_run_then_rm(tmp_path, smol_bytes, monkeypatch, capsys):
    with FakeOllamaRegistry() as registry:
        registry.add_model("library/smol", "latest", layers={
            "model": smol_bytes, "params": '{"stop": ["<|im_end|>"], "num_ctx": 1024}',
            "system": "You answer in one word.",
        })
        name = f"{registry.host}/library/smol:latest"
        for key, value in _env(tmp_path).items():
            if key.startswith(("HF_", "PAGODA_", "OLLAMA_")):
                monkeypatch.setenv(key, value)
        assert main(["pull", name, "--insecure"]) == 0
    assert "pulled" in capsys.readouterr().out
    store = tmp_path / "ollama"
    assert (store / "manifests" / registry.host / "library" / "smol" / "latest").is_file()
    assert len(list((store / "blobs").glob("sha256-*"))) == 4   # config, model, params, system
    assert not list((store / "blobs").glob("*-partial"))
    # The registry is gone: `pagoda run` answers from the store, with the model's layers.
    out = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli", "run", name, "Name a color.",
                          "--max-tokens", "8", "--temperature", "0", "--num-kv-blocks", "32"],
                         env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip()
    assert main(["list"]) == 0
    assert f"{registry.host}/library/smol:latest" in capsys.readouterr().out
    assert main(["rm", name]) == 0
    assert not list((store / "blobs").glob("sha256-*"))
    assert main(["rm", name]) == 2
    assert "not in Ollama's store" in capsys.readouterr().err
