"""What /api/tags, /api/show and /api/ps say about a model, read from its files.

Ollama describes a model by its manifest (digest, size, details); pagoda has no
manifests, only the GGUF file or Hugging Face folder it loaded. So: ``size`` is the
bytes on disk, ``digest`` a sha256 of the path, size and modification time (it changes
when the file does; hashing gigabytes of weights on a listing request would not do),
``details`` and ``model_info`` come from the GGUF metadata or ``config.json``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pagoda.config import EngineConfig

# Metadata arrays longer than this (the vocabulary, merges) are listed as null unless
# the client asks for /api/show's verbose output, as Ollama does.
_SHORT_LIST = 64


@dataclass(frozen=True)
class ModelFacts:
    path: str
    format: str  # "gguf" or "safetensors"
    family: str
    parameter_count: int | None
    quantization_level: str
    size: int
    modified_at: datetime
    digest: str
    context_length: int | None
    model_info: dict[str, Any] = field(default_factory=dict)

    @property
    def parameter_size(self) -> str:
        return human_number(self.parameter_count) if self.parameter_count else ""

    def details(self, parent_model: str = "") -> dict[str, Any]:
        return {"parent_model": parent_model, "format": self.format, "family": self.family,
                "families": [self.family] if self.family else None, "parameter_size": self.parameter_size,
                "quantization_level": self.quantization_level}  # fmt: skip

    def info(self, verbose: bool) -> dict[str, Any]:
        """``model_info``: long arrays as null unless ``verbose``."""
        return {k: (v if verbose or not isinstance(v, list) or len(v) <= _SHORT_LIST else None)
                for k, v in self.model_info.items()}  # fmt: skip


def human_number(n: int) -> str:
    """134515008 -> "134.52M", 8030261248 -> "8.0B" (how Ollama writes parameter counts)."""
    for unit, scale, digits in (("B", 1e9, 1), ("M", 1e6, 2), ("K", 1e3, 0)):
        if n >= scale:
            return f"{n / scale:.{digits}f}{unit}"
    return str(n)


def _tree_size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def file_identity(path: str) -> tuple[int, datetime, str]:
    """Size on disk, modification time, and a digest that changes when either does."""
    stat = os.stat(path)
    size = _tree_size(path)
    digest = hashlib.sha256(f"{os.path.abspath(path)}:{size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return size, datetime.fromtimestamp(stat.st_mtime, UTC), digest


def read_model_facts(config: EngineConfig) -> ModelFacts:
    """The facts of the model ``config`` names (the bundled default when it names none)."""
    from pagoda.hub.stores import resolve_model_path

    path = resolve_model_path(config.model)
    if os.path.isfile(path):
        return _gguf_facts(path)
    return _hf_facts(path, config.quantization)


def _gguf_facts(path: str) -> ModelFacts:
    import gguf

    from pagoda.hub.gguf_file import GGUFFile

    with GGUFFile(path) as f:
        metadata = dict(f.metadata)
        count = sum(math.prod(t.shape) for t in f.tensors.values())
    arch = str(metadata.get("general.architecture", ""))
    try:
        quant = gguf.LlamaFileType(metadata["general.file_type"]).name.removeprefix("MOSTLY_")
    except (KeyError, ValueError):
        quant = ""
    metadata.pop("tokenizer.chat_template", None)  # /api/show gives it as ``template``
    metadata["general.parameter_count"] = count
    size, modified, digest = file_identity(path)
    context = metadata.get(f"{arch}.context_length")
    return ModelFacts(path, "gguf", arch, count, quant, size, modified, digest,
                      context if isinstance(context, int) else None, metadata)  # fmt: skip


def _hf_facts(path: str, quantization: str) -> ModelFacts:
    with open(os.path.join(path, "config.json")) as f:
        config: dict[str, Any] = json.load(f)
    family = str(config.get("model_type", ""))
    try:
        from pagoda.model.arch import ModelArchConfig

        count: int | None = ModelArchConfig.from_hf_config(config).num_params
    except (ValueError, KeyError, TypeError):  # a config pagoda cannot describe: count unknown
        count = None
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "")
    names = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
    quant = quantization.upper() if quantization not in ("none", "auto") else names.get(dtype, dtype.upper())
    info: dict[str, Any] = {"general.architecture": family, "general.parameter_count": count}
    info.update({f"{family}.{k}": v for k, v in config.items() if isinstance(v, (int, float, str, bool))})
    size, modified, digest = file_identity(path)
    context = config.get("max_position_embeddings")
    return ModelFacts(path, "safetensors", family, count, quant, size, modified, digest,
                      context if isinstance(context, int) else None, info)  # fmt: skip
