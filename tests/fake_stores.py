"""Model stores as their tools write them, around the bundled GGUF and tiny HF checkpoints,
for the tests of pagoda/hub/stores.py, ``pagoda run`` / ``list`` / ``ps``.

- Ollama (``ollama pull``): ``manifests/<host>/<namespace>/<name>/<tag>`` is a Docker
  distribution v2 manifest whose layers are content-addressed files ``blobs/sha256-<hex>``.
- Hugging Face (``huggingface_hub``): ``models--org--name/blobs/<hash>``,
  ``refs/main`` holding the commit, ``snapshots/<commit>/<file>`` relative symlinks
  into ``blobs``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

# A typical Ollama ChatML template (the shape of Ollama's qwen2 / smollm2 templates).
CHATML_MESSAGES_TEMPLATE = """{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 -}}
{{- if eq .Role "user" }}<|im_start|>user
{{ .Content }}<|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ .Content }}{{ if not $last }}<|im_end|>
{{ end }}
{{- end }}
{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant
{{ end }}
{{- end }}"""

# The older form, without .Messages: rendered once per turn.
CHATML_LEGACY_TEMPLATE = """{{ if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}{{ if .Prompt }}<|im_start|>user
{{ .Prompt }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ .Response }}<|im_end|>
"""

OLLAMA_SYSTEM = "You are a terse geography teacher. Answer in one sentence."
OLLAMA_PARAMS = {"stop": ["."], "temperature": 0, "top_k": 1, "num_ctx": 1024, "num_predict": 40,
                 "num_thread": 2}  # fmt: skip

_MEDIA = "application/vnd.ollama.image."
_SHA_CACHE: dict[str, str] = {}


def _sha256_file(path: str) -> str:
    if path not in _SHA_CACHE:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _SHA_CACHE[path] = h.hexdigest()
    return _SHA_CACHE[path]


@dataclass
class OllamaStore:
    root: Path

    def blob(self, data: bytes | None = None, link_to: str | None = None, old_name: bool = False) -> dict:
        """Store a blob (bytes, or the file ``link_to`` by a symlink); its layer descriptor."""
        if link_to is not None:
            digest, size = _sha256_file(link_to), os.path.getsize(link_to)
        else:
            assert data is not None
            digest, size = hashlib.sha256(data).hexdigest(), len(data)
        path = self.root / "blobs" / (f"sha256:{digest}" if old_name else f"sha256-{digest}")
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            if link_to is not None:
                path.symlink_to(link_to)
            else:
                path.write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": size}

    def add(self, name: str, gguf: str, *, template: str | None = None, system: str | None = None,
            params: dict | None = None, extra_layers: list[dict] = (), old_blob_names: bool = False,
            host: str = "registry.ollama.ai", namespace: str = "library", tag: str = "latest") -> Path:  # fmt: skip
        layers = [{"mediaType": _MEDIA + "model", **self.blob(link_to=gguf, old_name=old_blob_names)}]
        for kind, content in (("template", template), ("system", system),
                              ("params", json.dumps(params) if params is not None else None)):  # fmt: skip
            if content is not None:
                layers.append({"mediaType": _MEDIA + kind, **self.blob(content.encode())})
        layers.append({"mediaType": _MEDIA + "license", **self.blob(b"Apache-2.0")})
        layers += list(extra_layers)
        config = self.blob(json.dumps({"model_format": "gguf", "model_family": "llama"}).encode())
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **config},
            "layers": layers,
        }
        path = self.root / "manifests" / host / namespace / name / tag
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(manifest))
        return path


@dataclass
class HFCache:
    root: Path

    def add(self, repo: str, files: dict[str, str | bytes], revision: str = "0123456789abcdef" * 2 + "01234567"
            ) -> Path:  # fmt: skip
        """A repo snapshot: file name -> a path to link to, or the bytes. Returns the snapshot."""
        repo_dir = self.root / ("models--" + repo.replace("/", "--"))
        snapshot = repo_dir / "snapshots" / revision
        for name, source in files.items():
            data_id = hashlib.sha256(source if isinstance(source, bytes) else source.encode()).hexdigest()
            blob = repo_dir / "blobs" / data_id
            blob.parent.mkdir(parents=True, exist_ok=True)
            if not blob.exists():
                if isinstance(source, bytes):
                    blob.write_bytes(source)
                else:
                    os.symlink(source, blob)  # a large file, linked instead of copied
            link = snapshot / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / "main").write_text(revision)
        return snapshot


@dataclass
class FakeStores:
    models: Path
    hf: HFCache
    ollama: OllamaStore

    def env(self) -> dict[str, str]:
        return {"PAGODA_MODELS": str(self.models), "HF_HUB_CACHE": str(self.hf.root),
                "OLLAMA_MODELS": str(self.ollama.root)}  # fmt: skip


def build_stores(root: Path, gguf: str, hf_folder: str) -> FakeStores:
    """The three stores with: ``mine`` (a GGUF) and ``tinyhf`` (an HF folder) in the models
    folder; ``org/tiny`` (an HF checkpoint) and ``org/smol-GGUF`` (two quantizations) in the
    HF cache; ``smollm2`` (with template, system and params layers), ``myns/plain:v1`` and ``example.com/team/thing:q4`` in Ollama's store."""
    models = root / "models"
    models.mkdir(parents=True)
    (models / "mine.gguf").symlink_to(gguf)
    shutil.copytree(hf_folder, models / "tinyhf")
    hf = HFCache(root / "hf")
    hf.add("org/tiny", {name: (Path(hf_folder) / name).read_bytes() for name in os.listdir(hf_folder)})
    hf.add("org/smol-GGUF", {"smol.Q4_1.gguf": gguf, "smol.Q8_0.gguf": b"GGUF not really",
                             "README.md": b"# smol"})  # fmt: skip
    ollama = OllamaStore(root / "ollama")
    ollama.add("smollm2", gguf, template=CHATML_MESSAGES_TEMPLATE, system=OLLAMA_SYSTEM, params=OLLAMA_PARAMS)
    ollama.add("plain", gguf, namespace="myns", tag="v1")
    ollama.add("thing", gguf, host="example.com", namespace="team", tag="q4")
    return FakeStores(models, hf, ollama)
