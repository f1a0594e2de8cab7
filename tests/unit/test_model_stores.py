"""Models found by name: the models folder, the Hugging Face cache and Ollama's store
(pagoda/hub/stores.py), written here as their tools write them (tests/fake_stores.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pagoda.config import EngineConfig
from pagoda.entrypoints.cli import main
from pagoda.entrypoints.openai.launch import default_served_model_name
from pagoda.hub.paths import ModelLoadError
from pagoda.hub.stores import resolve_model_path
from pagoda.hub.stores import ResolvedModel, list_models, resolve_model
from tests.fake_stores import (
    CHATML_MESSAGES_TEMPLATE,
    OLLAMA_PARAMS,
    OLLAMA_SYSTEM,
    OllamaStore,
    build_stores,
)


@pytest.fixture(scope="module")
def stores(tmp_path_factory, default_model_path, tiny_llama_dir):
    return build_stores(tmp_path_factory.mktemp("stores"), default_model_path, tiny_llama_dir)


@pytest.fixture
def env(stores, monkeypatch, tmp_path):
    for key, value in stores.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)  # no file here shares a model's name
    return stores


def _snapshot(stores, repo: str) -> Path:
    repo_dir = stores.hf.root / ("models--" + repo.replace("/", "--"))
    return repo_dir / "snapshots" / (repo_dir / "refs" / "main").read_text()


def _ollama_model_blob(stores, manifest: Path) -> Path:
    layer = next(x for x in json.loads(manifest.read_text())["layers"] if x["mediaType"].endswith(".model"))
    return stores.ollama.root / "blobs" / layer["digest"].replace(":", "-")


# ---------------------------------------------------------------------- each name form
def test_models_folder_names(env):
    assert resolve_model("mine") == ResolvedModel(str(env.models / "mine.gguf"), "mine", "models folder")
    tiny = resolve_model("tinyhf")
    assert (tiny.path, tiny.source) == (str(env.models / "tinyhf"), "models folder")
    assert resolve_model_path("mine.gguf") == str(env.models / "mine.gguf")


def test_hf_cache_folder_and_gguf_quant(env):
    tiny = resolve_model("org/tiny")
    assert tiny.path == str(_snapshot(env, "org/tiny"))
    assert os.path.islink(os.path.join(tiny.path, "config.json"))  # resolved through the snapshot's links
    assert json.loads(Path(tiny.path, "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    snapshot = _snapshot(env, "org/smol-GGUF")
    for quant, file_name in (("Q4_1", "smol.Q4_1.gguf"), ("q8_0", "smol.Q8_0.gguf"), ("q4", "smol.Q4_1.gguf")):
        found = resolve_model(f"org/smol-GGUF:{quant}")
        assert (found.path, found.name, found.source) == (str(snapshot / file_name), f"org/smol-GGUF:{quant}",
                                                          "huggingface")


def test_ollama_names_and_layers(env, default_model_path):
    manifests = env.ollama.root / "manifests"
    smol = resolve_model("smollm2")
    blob = _ollama_model_blob(env, manifests / "registry.ollama.ai/library/smollm2/latest")
    assert (smol.path, smol.name, smol.source) == (str(blob), "smollm2:latest", "ollama")
    assert os.path.samefile(smol.path, default_model_path)
    assert resolve_model("smollm2:latest") == smol
    assert resolve_model("registry.ollama.ai/library/smollm2:latest").path == smol.path
    # Each layer became a default; runtime-only parameters (num_thread) change nothing.
    d = smol.defaults
    assert d.sampling == {"stop": ["."], "temperature": 0, "top_k": 1, "max_tokens": OLLAMA_PARAMS["num_predict"]}
    assert d.max_model_len == OLLAMA_PARAMS["num_ctx"]
    assert d.system == OLLAMA_SYSTEM and d.template == CHATML_MESSAGES_TEMPLATE
    assert resolve_model("myns/plain:v1").name == "myns/plain:v1"
    assert resolve_model("myns/plain:v1").defaults.sampling == {}
    thing = resolve_model("example.com/team/thing:q4")
    assert (thing.name, thing.path) == ("example.com/team/thing:q4", smol.path)
    assert default_served_model_name(EngineConfig(model="smollm2")) == "smollm2:latest"
    assert default_served_model_name(EngineConfig(model="org/smol-GGUF:Q4_1")) == "org/smol-GGUF:Q4_1"


def test_ollama_old_blob_names(tmp_path, monkeypatch, default_model_path):
    store = OllamaStore(tmp_path / "ollama")
    store.add("old", default_model_path, old_blob_names=True, system="hi")
    monkeypatch.setenv("OLLAMA_MODELS", str(store.root))
    monkeypatch.setenv("PAGODA_MODELS", str(tmp_path / "none"))
    found = resolve_model("old")
    assert Path(found.path).name.startswith("sha256:") and found.defaults.system == "hi"


def test_default_model_and_explicit_paths(env, default_model_path):
    assert resolve_model(None).path == default_model_path
    assert resolve_model(default_model_path).source == "path"


# ---------------------------------------------------------------------- precedence
def test_precedence_path_then_models_folder_then_hf_then_ollama(env, tmp_path, default_model_path):
    # An Ollama model and a models-folder file of the same name: the folder wins.
    (env.models / "smollm2.gguf").symlink_to(default_model_path)
    try:
        assert resolve_model("smollm2").source == "models folder"
        # A path in the working directory wins over every store.
        (tmp_path / "smollm2").write_bytes(b"x")
        assert resolve_model("smollm2").source == "path"
    finally:
        (env.models / "smollm2.gguf").unlink()
        (tmp_path / "smollm2").unlink(missing_ok=True)
    # org/name in the HF cache and namespace/name in Ollama's store: the HF cache wins.
    manifest = env.ollama.add("tiny", default_model_path, namespace="org")
    try:
        assert resolve_model("org/tiny").source == "huggingface"
    finally:
        manifest.unlink()


# ---------------------------------------------------------------------- errors
def test_unknown_name_lists_every_place(env):
    with pytest.raises(ModelLoadError) as e:
        resolve_model("nowhere/to-be:found")
    message = str(e.value)
    for place in (env.models / "nowhere/to-be:found", env.models / "nowhere/to-be:found.gguf",
                  env.hf.root / "models--nowhere--to-be" / "refs" / "main",
                  env.ollama.root / "manifests/registry.ollama.ai/nowhere/to-be/found"):  # fmt: skip
        assert str(place) in message, place
    with pytest.raises(ModelLoadError, match="pagoda pull NAME"):
        resolve_model("../escape")


def test_gguf_repo_choices(env):
    with pytest.raises(ModelLoadError, match=r"matches 2 GGUF files.*smol.Q4_1.gguf, smol.Q8_0.gguf"):
        resolve_model("org/smol-GGUF")
    with pytest.raises(ModelLoadError, match=r"no GGUF file whose name contains 'Q5_K_M'.*smol.Q4_1.gguf"):
        resolve_model("org/smol-GGUF:Q5_K_M")
    with pytest.raises(ModelLoadError, match="HF model folder"):
        resolve_model("org/tiny:Q4_1")


@pytest.mark.parametrize("params,message", [
    ({"mirostat": 1}, "'mirostat' is not supported"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_p": 7.0}, "invalid value: top_p"),
    ({"num_ctx": 0}, "num_ctx must be an integer >= 1"),
    ({"stop": [1]}, "stop must be a string or a list of strings"),
])  # fmt: skip
def test_bad_params_layer(tmp_path, monkeypatch, default_model_path, params, message):
    store = OllamaStore(tmp_path / "ollama")
    store.add("bad", default_model_path, params=params)
    monkeypatch.setenv("OLLAMA_MODELS", str(store.root))
    monkeypatch.setenv("PAGODA_MODELS", str(tmp_path / "none"))
    with pytest.raises(ModelLoadError, match=message):
        resolve_model("bad")


def test_unsupported_layer_and_missing_blob(tmp_path, monkeypatch, default_model_path):
    store = OllamaStore(tmp_path / "ollama")
    adapter = {"mediaType": "application/vnd.ollama.image.adapter", **store.blob(b"lora")}
    store.add("adapted", default_model_path, extra_layers=[adapter])
    manifest = store.add("broken", default_model_path, system="s")
    monkeypatch.setenv("OLLAMA_MODELS", str(store.root))
    monkeypatch.setenv("PAGODA_MODELS", str(tmp_path / "none"))
    with pytest.raises(ModelLoadError, match=r"layer 'application/vnd.ollama.image.adapter'.* not supported"):
        resolve_model("adapted")
    system = next(x for x in json.loads(manifest.read_text())["layers"] if x["mediaType"].endswith(".system"))
    (store.root / "blobs" / system["digest"].replace(":", "-")).unlink()
    with pytest.raises(ModelLoadError, match=f"blob of layer {system['digest']}.* is missing"):
        resolve_model("broken")


# ---------------------------------------------------------------------- pagoda list
def test_list_models_and_command(env, capsys):
    found = {(m.name, m.where.split(" ")[0]) for m in list_models()}
    assert found == {
        ("SmolLM2-135M-Instruct", "bundled"),
        ("mine", "models"), ("tinyhf", "models"), ("org/tiny", "huggingface"),
        ("org/smol-GGUF:Q4_1", "huggingface"), ("org/smol-GGUF:Q8_0", "huggingface"),
        ("smollm2:latest", "ollama"), ("myns/plain:v1", "ollama"), ("example.com/team/thing:q4", "ollama"),
    }  # fmt: skip
    sizes = {m.name: m.size for m in list_models()}
    assert sizes["mine"] == os.path.getsize(env.models / "mine.gguf")
    # Every name listed resolves to a model (the Q8_0 "file" is a stand-in, but it resolves).
    for name in sizes:
        assert resolve_model(name).name
    assert main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "SIZE", "MODIFIED", "WHERE"]
    assert {line.split()[0] for line in out[1:]} == set(sizes)


def test_list_with_empty_stores(tmp_path, monkeypatch, capsys):
    for key in ("PAGODA_MODELS", "HF_HUB_CACHE", "OLLAMA_MODELS"):
        monkeypatch.setenv(key, str(tmp_path / key))
    assert [(m.name, m.where.split(" ")[0]) for m in list_models()] == [("SmolLM2-135M-Instruct", "bundled")]
    assert main(["list"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[0] == "SmolLM2-135M-Instruct"
