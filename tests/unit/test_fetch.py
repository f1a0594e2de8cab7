"""Model downloads (pagoda/hub/fetch.py) against fake registries (tests/hub_servers.py): a
Hub repository into the Hugging Face cache through huggingface_hub, an Ollama model into
Ollama's store, and what a failed download leaves (nothing that resolves)."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import pytest

fetch = pytest.importorskip("pagoda.hub.fetch")
hf_constants = pytest.importorskip("huggingface_hub.constants")

from pagoda.hub.paths import ModelLoadError  # noqa: E402
from pagoda.hub.stores import resolve_model  # noqa: E402
from tests.hub_servers import FakeHub, FakeOllamaRegistry  # noqa: E402


# ---------------------------------------------------------------------- tiny real files
def safetensors_bytes(n: int, seed: int = 0) -> bytes:
    """A safetensors file holding one float32 tensor of ``n`` values."""
    data = struct.pack(f"<{n}f", *(float((i * 7 + seed) % 13) for i in range(n)))
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, len(data)]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def gguf_bytes(tmp_path: Path, name: str, values: int = 16) -> bytes:
    """A GGUF file (header, metadata, one float32 tensor of ``values`` values)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / f"{name}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_uint32("llama.context_length", 64)
    writer.add_tensor("token_embd.weight", np.arange(values, dtype=np.float32).reshape(-1, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


SHARDS = {"model-00001-of-00002.safetensors": safetensors_bytes(2048, 1),   # 8 KiB: room to cut a download short
          "model-00002-of-00002.safetensors": safetensors_bytes(64, 2)}  # fmt: skip
ENGINE_FILES = {
    "config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}).encode(),
    "generation_config.json": b'{"eos_token_id": 2}',
    **SHARDS,
    "model.safetensors.index.json": json.dumps({"metadata": {}, "weight_map": {
        "w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}}).encode(),
    "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}',
    "tokenizer_config.json": b'{"bos_token": "<s>"}',
    "special_tokens_map.json": b'{"bos_token": "<s>"}',
    "vocab.json": b'{"<s>": 0}',
    "merges.txt": b"#version: 0.2\n",
    "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
}  # fmt: skip
# Files the engine does not read: never requested.
OTHER_FILES = {
    "README.md": b"# tiny", ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
    "pytorch_model.bin": b"pickled weights", "training_args.pt": b"pickled args",
    "original/consolidated.00.pth": b"meta weights",
}  # fmt: skip
QUANTS = ("Q4_K_M", "Q8_0", "F16")


# ---------------------------------------------------------------------- fixtures
@pytest.fixture
def stores(tmp_path, monkeypatch) -> Path:
    """Every store and huggingface_hub's paths under tmp_path (no token, online). huggingface_hub
    reads its environment once, at import, into huggingface_hub.constants: both are set."""
    root = tmp_path / "stores"
    env = {"PAGODA_MODELS": root / "models", "HF_HUB_CACHE": root / "hf", "HF_HOME": root / "hf-home",
           "OLLAMA_MODELS": root / "ollama"}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    for key in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT",
                "HF_OIDC_RESOURCE"):  # fmt: skip
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(env["HF_HUB_CACHE"]))
    monkeypatch.setattr(hf_constants, "HF_HOME", str(env["HF_HOME"]))
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(env["HF_HOME"] / "token"))
    monkeypatch.setattr(hf_constants, "HF_STORED_TOKENS_PATH", str(env["HF_HOME"] / "stored_tokens"))
    monkeypatch.setattr(hf_constants, "AGENT_HARNESSES_PATH", str(env["HF_HOME"] / ".agent_harnesses.json"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_PROGRESS_BARS", True)
    return root


@pytest.fixture
def hub(stores, monkeypatch):
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setattr(hf_constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        yield hub


@pytest.fixture
def registry(stores):
    with FakeOllamaRegistry() as registry:
        yield registry


def hf_repo_dir(stores: Path, repo: str) -> Path:
    return stores / "hf" / ("models--" + repo.replace("/", "--"))


def resolves(name: str) -> bool:
    try:
        resolve_model(name)
    except ModelLoadError:
        return False
    return True


# ---------------------------------------------------------------------- the Hub: HF repositories
def test_hf_repo_fetched_into_the_cache_then_served_from_it(hub, stores):
    commit = hub.add_repo("org/tiny", {**ENGINE_FILES, **OTHER_FILES})
    resolved = fetch.fetch_hf("org/tiny")

    snapshot = hf_repo_dir(stores, "org/tiny") / "snapshots" / commit
    assert Path(resolved.path) == snapshot
    for name, data in ENGINE_FILES.items():
        assert (snapshot / name).read_bytes() == data, name
    # Only what the engine reads: the rest is neither requested nor stored.
    for name in OTHER_FILES:
        assert not (snapshot / name).exists(), name
        assert not [r for r in hub.requests if name in r.path], name
    assert (hf_repo_dir(stores, "org/tiny") / "refs" / "main").read_text().strip() == commit

    # Cached: no request at all.
    hub.requests.clear()
    assert fetch.fetch_hf("org/tiny").path == resolved.path
    assert hub.model_requests() == []

    # Served from the cache with the Hub gone.
    hub.stop()
    found = resolve_model("org/tiny")
    assert (Path(found.path), found.source) == (snapshot, "huggingface")
    assert fetch.fetch_hf("org/tiny").path == resolved.path


def test_force_asks_the_hub_again(hub):
    hub.add_repo("org/tiny", ENGINE_FILES)
    first = fetch.fetch_hf("org/tiny")
    hub.requests.clear()
    assert fetch.fetch_hf("org/tiny", force=True).path == first.path
    assert hub.model_requests(), "a pull (force=True) asks the Hub"


# ---------------------------------------------------------------------- the Hub: GGUF repositories
@pytest.fixture
def gguf_repo(hub, tmp_path) -> dict[str, bytes]:
    files = {f"tiny.{q}.gguf": gguf_bytes(tmp_path, q, 16 * (i + 1)) for i, q in enumerate(QUANTS)}
    hub.add_repo("org/tiny-GGUF", {**files, "README.md": b"# quants"})
    return files


def _gguf_requests(hub) -> set[str]:
    return {q for q in QUANTS for r in hub.requests if f"tiny.{q}.gguf" in r.path}


def test_gguf_quant_fetches_that_file_only(hub, stores, gguf_repo):
    resolved = fetch.fetch_hf("org/tiny-GGUF:Q4_K_M")
    assert Path(resolved.path).name == "tiny.Q4_K_M.gguf"
    assert Path(resolved.path).read_bytes() == gguf_repo["tiny.Q4_K_M.gguf"]
    assert _gguf_requests(hub) == {"Q4_K_M"}
    assert not [r for r in hub.requests if "README.md" in r.path]
    assert Path(resolve_model("org/tiny-GGUF:Q4_K_M").path) == Path(resolved.path)

    # Another quant the cache lacks: fetched (QUANT matched case-insensitively), that one only.
    hub.requests.clear()
    q8 = fetch.fetch_hf("org/tiny-GGUF:q8_0")
    assert Path(q8.path).name == "tiny.Q8_0.gguf"
    assert Path(q8.path).read_bytes() == gguf_repo["tiny.Q8_0.gguf"]
    assert _gguf_requests(hub) == {"Q8_0"}
    assert Path(resolve_model("org/tiny-GGUF:Q8_0").path) == Path(q8.path)
    # The first is still there, served without a request.
    hub.requests.clear()
    assert fetch.fetch_hf("org/tiny-GGUF:Q4_K_M").path == resolved.path
    assert hub.model_requests() == []


def test_gguf_hf_file_picks_the_file(hub, gguf_repo):
    resolved = fetch.fetch_hf("org/tiny-GGUF", hf_file="tiny.F16.gguf")
    assert Path(resolved.path).read_bytes() == gguf_repo["tiny.F16.gguf"]
    assert _gguf_requests(hub) == {"F16"}


def test_gguf_no_such_quant_lists_the_files(hub, gguf_repo):
    with pytest.raises(ModelLoadError) as e:
        fetch.fetch_hf("org/tiny-GGUF:Q2_K")
    for name in gguf_repo:
        assert name in str(e.value)
    assert _gguf_requests(hub) == set()
    assert not resolves("org/tiny-GGUF:Q2_K")


def test_gguf_several_files_without_quant_is_an_error(hub, gguf_repo):
    with pytest.raises(ModelLoadError) as e:
        fetch.fetch_hf("org/tiny-GGUF")
    for name in gguf_repo:
        assert name in str(e.value)
    assert _gguf_requests(hub) == set()
    assert not resolves("org/tiny-GGUF")


def test_gguf_repo_with_one_file_needs_no_quant(hub, tmp_path):
    data = gguf_bytes(tmp_path, "one")
    hub.add_repo("org/one-GGUF", {"one.Q4_0.gguf": data, "README.md": b"#"})
    resolved = fetch.fetch_hf("org/one-GGUF")
    assert Path(resolved.path).read_bytes() == data
    assert Path(resolve_model("org/one-GGUF").path) == Path(resolved.path)


# ---------------------------------------------------------------------- the Hub: errors
def test_gated_repo_needs_a_token(hub, monkeypatch):
    hub.add_repo("org/gated", ENGINE_FILES, gated=True)
    with pytest.raises(ModelLoadError) as e:
        fetch.fetch_hf("org/gated")
    assert "gated" in str(e.value).lower() and "HF_TOKEN" in str(e.value)
    assert not resolves("org/gated")

    monkeypatch.setenv("HF_TOKEN", hub.token)
    resolved = fetch.fetch_hf("org/gated")
    assert (Path(resolved.path) / "config.json").read_bytes() == ENGINE_FILES["config.json"]
    assert [r for r in hub.requests if r.headers.get("authorization") == f"Bearer {hub.token}"]
    assert Path(resolve_model("org/gated").path) == Path(resolved.path)


def test_unknown_repo_is_named(hub):
    hub.add_repo("org/tiny", ENGINE_FILES)
    with pytest.raises(ModelLoadError) as e:
        fetch.fetch_hf("org/missing")
    assert "org/missing" in str(e.value)
    assert re.search(r"not found|no (such )?repo|does not exist", str(e.value), re.I)
    assert not resolves("org/missing")


def test_interrupted_download_resumes_with_a_range_request(hub, stores, monkeypatch):
    # huggingface_hub hands the body over in DOWNLOAD_CHUNK_SIZE pieces (10 MiB): what came
    # before the cut reaches the file, to be resumed, only in whole pieces.
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 256)
    hub.add_repo("org/tiny", ENGINE_FILES)
    shard = "model-00001-of-00002.safetensors"
    hub.fail_once("org/tiny", shard, after_bytes=3000)
    resolved = fetch.fetch_hf("org/tiny")
    assert (Path(resolved.path) / shard).read_bytes() == SHARDS[shard]
    sha = hashlib.sha256(SHARDS[shard]).hexdigest()
    gets = [r for r in hub.requests if r.method == "GET" and sha in r.path]
    assert len(gets) == 2 and gets[0].range is None
    m = re.fullmatch(r"bytes=(\d+)-", gets[1].range or "")
    assert m and 0 < int(m.group(1)) <= 3000, gets[1].range


@pytest.mark.parametrize("path", ["model-00001-of-00002.safetensors", "config.json"], ids=["lfs-file", "regular-file"])
def test_digest_mismatch_leaves_nothing_that_resolves(hub, path):
    hub.add_repo("org/tiny", ENGINE_FILES)
    hub.corrupt("org/tiny", path)
    with pytest.raises(ModelLoadError) as e:
        fetch.fetch_hf("org/tiny")
    assert path in str(e.value)
    assert re.search(r"digest|sha256|sha1|checksum|mismatch|corrupt", str(e.value), re.I)
    assert not resolves("org/tiny")

    # The next try gets the right bytes (the bad ones were not kept as the blob).
    hub.corrupt("org/tiny", path, on=False)
    resolved = fetch.fetch_hf("org/tiny")
    assert (Path(resolved.path) / path).read_bytes() == ENGINE_FILES[path]


def test_offline_with_an_empty_cache_is_a_clear_error(hub, monkeypatch):
    hub.add_repo("org/tiny", ENGINE_FILES)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError) as e:
        fetch.fetch_hf("org/tiny")
    assert re.search(r"offline|HF_HUB_OFFLINE", str(e.value), re.I)
    assert "org/tiny" in str(e.value)
    assert hub.model_requests() == []


def test_remove_hf_repo(hub, stores):
    hub.add_repo("org/tiny", ENGINE_FILES)
    fetch.fetch_hf("org/tiny")
    repo_dir = hf_repo_dir(stores, "org/tiny")
    removed = fetch.remove_model("org/tiny")
    assert removed and not repo_dir.exists()
    assert all(p.resolve() == repo_dir.resolve() or repo_dir.name in p.parts for p in map(Path, removed))
    assert not resolves("org/tiny")


# ---------------------------------------------------------------------- Ollama's registry
PARAMS = {"stop": ["<|im_end|>"], "temperature": 0.2, "num_ctx": 2048}
TEMPLATE = "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}{{ .Prompt }}"


@pytest.fixture
def tiny_gguf(tmp_path) -> bytes:
    return gguf_bytes(tmp_path, "tiny", 4096)   # 16 KiB: room to cut a download short


def _add_tiny(registry, gguf: bytes, tag: str = "latest", params: dict = PARAMS) -> str:
    registry.add_model("library/tiny", tag, layers={"model": gguf, "template": TEMPLATE, "system": "You are terse.",
                                                    "params": json.dumps(params), "license": "MIT"})
    return f"{registry.host}/library/tiny:{tag}"


def _blob(stores: Path, digest: str) -> Path:
    return stores / "ollama" / "blobs" / f"sha256-{digest.removeprefix('sha256:')}"


def _manifest(stores: Path, registry, tag: str = "latest") -> Path:
    return stores / "ollama" / "manifests" / registry.host / "library" / "tiny" / tag


def test_ollama_pull_stores_ollamas_layout(registry, stores, tiny_gguf):
    name = _add_tiny(registry, tiny_gguf)
    resolved = fetch.pull_ollama(name, insecure=True)

    manifest = registry.manifest("library/tiny")
    assert json.loads(_manifest(stores, registry).read_text()) == manifest
    for layer in [manifest["config"], *manifest["layers"]]:
        data = _blob(stores, layer["digest"]).read_bytes()
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (layer["digest"][7:], layer["size"])
    first = registry.requests[0]
    assert first.path == "/v2/library/tiny/manifests/latest"
    assert "application/vnd.docker.distribution.manifest.v2+json" in first.headers.get("accept", "")

    found = resolve_model(name)
    model_blob = _blob(stores, registry.layer("library/tiny", media="model")["digest"])
    assert Path(found.path) == Path(resolved.path) == model_blob
    assert found.source == "ollama"
    assert dict(found.defaults.sampling) == {"stop": ["<|im_end|>"], "temperature": 0.2}
    assert found.defaults.max_model_len == 2048
    assert (found.defaults.system, found.defaults.template) == ("You are terse.", TEMPLATE)


def test_ollama_corrupt_blob_stores_no_manifest(registry, stores, tiny_gguf):
    name = _add_tiny(registry, tiny_gguf)
    digest = registry.layer("library/tiny", media="model")["digest"]
    registry.corrupt(digest)
    with pytest.raises(ModelLoadError) as e:
        fetch.pull_ollama(name, insecure=True)
    assert digest[7:19] in str(e.value) or "application/vnd.ollama.image.model" in str(e.value)
    assert not _manifest(stores, registry).exists()
    assert not _blob(stores, digest).exists()
    assert not resolves(name)

    registry.corrupt(digest, on=False)
    assert Path(fetch.pull_ollama(name, insecure=True).path).read_bytes() == tiny_gguf


def test_ollama_interrupted_blob_resumes_with_a_range_request(registry, stores, tiny_gguf):
    name = _add_tiny(registry, tiny_gguf)
    digest = registry.layer("library/tiny", media="model")["digest"]
    registry.fail_once(digest, after_bytes=5000)
    try:
        resolved = fetch.pull_ollama(name, insecure=True)
    except ModelLoadError:   # resumed by the next pull rather than in this one
        assert not _manifest(stores, registry).exists()
        resolved = fetch.pull_ollama(name, insecure=True)
    assert Path(resolved.path).read_bytes() == tiny_gguf
    gets = registry.blob_requests(digest)
    assert len(gets) == 2 and gets[0].range is None
    m = re.fullmatch(r"bytes=(\d+)-", gets[1].range or "")
    assert m and 0 < int(m.group(1)) <= 5000, gets[1].range


def test_ollama_unknown_model_is_an_error(registry):
    with pytest.raises(ModelLoadError) as e:
        fetch.pull_ollama(f"{registry.host}/library/nothing:latest", insecure=True)
    assert "nothing" in str(e.value)


def test_remove_ollama_model_keeps_shared_blobs(registry, stores, tiny_gguf):
    latest = _add_tiny(registry, tiny_gguf)
    v2 = _add_tiny(registry, tiny_gguf, tag="v2", params={"stop": ["</s>"]})
    fetch.pull_ollama(latest, insecure=True)
    fetch.pull_ollama(v2, insecure=True)
    own = _blob(stores, registry.layer("library/tiny", "latest", "params")["digest"])
    shared = [_blob(stores, registry.layer("library/tiny", "latest", media)["digest"])
              for media in ("model", "license")]

    removed = {Path(p).resolve() for p in fetch.remove_model(latest)}
    assert {_manifest(stores, registry).resolve(), own.resolve()} <= removed
    assert not _manifest(stores, registry).exists() and not own.exists()
    assert all(p.exists() and p.resolve() not in removed for p in shared)
    assert not resolves(latest)
    assert Path(resolve_model(v2).path) == shared[0]
