"""Embeddings: what an embedding engine pools, and what each embedding request asks for.

An engine runs one task (vLLM's ``--task``): ``generate`` (an LM head and a sampler) or
``embed`` (the final norm's hidden states of a prompt pooled into one vector). ``auto``,
the default, is ``embed`` for an embedding checkpoint and ``generate`` for anything else.
An embedding checkpoint is an HF folder whose architecture has no LM head (transformers'
base models: ``Qwen3Model``, ``LlamaModel``, ...) or a sentence-transformers layout
(``modules.json``).

``PoolerConfig`` is the engine's: the pooling (LAST / MEAN / CLS), whether vectors are
L2-normalised by default, and which truncated widths (Matryoshka) requests may ask for.
It comes from the checkpoint where it says (sentence-transformers' ``1_Pooling/config.json``
and ``Normalize`` module; ``is_matryoshka`` / ``matryoshka_dimensions`` in config.json),
else LAST pooling (vLLM's default for decoder models) with normalisation, and the user's
``PoolerOverrides`` (``--pooling-type``, ``--no-normalize``, ``--matryoshka-dimensions``;
offline ``LLM(..., override_pooler_config={...})``, vLLM's name) win over both.

``PoolingParams`` is a request's: ``dimensions`` (truncate, then re-normalise) and
``normalize`` (None: the engine's default). No torch here: the API process imports it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from pagoda.config.pooling import POOLING_TYPES, PoolerOverrides, _dimensions_tuple, _is_int

# sentence-transformers' Pooling config flag -> our pooling type.
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolerConfig:
    """An embedding engine's pooling: its kind, default normalisation and allowed widths."""

    pooling_type: str
    normalize: bool
    hidden_size: int
    # Requests may ask for a truncated width ("dimensions"): any up to hidden_size, or
    # only those listed (matryoshka_dimensions).
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not _is_int(self.hidden_size) or self.hidden_size < 1:
            raise ValueError(f"hidden_size must be a positive integer, got {self.hidden_size!r}")
        dims = _dimensions_tuple("matryoshka_dimensions", self.matryoshka_dimensions)
        if dims is not None and dims[-1] > self.hidden_size:
            raise ValueError(f"matryoshka_dimensions {list(dims)} go past the model's width {self.hidden_size}")
        object.__setattr__(self, "matryoshka_dimensions", dims)

    @property
    def needs_every_position(self) -> bool:
        """MEAN and CLS pooling read hidden states a prefix-cache hit would skip."""
        return self.pooling_type != "LAST"

    def check_dimensions(self, dimensions: int | None) -> None:
        """ValueError (its message for a 400) for a width this model does not offer."""
        if dimensions is None:
            return
        if not self.is_matryoshka and self.matryoshka_dimensions is None:
            raise ValueError(f"dimensions: this model does not support Matryoshka embeddings; it gives vectors "
                             f"of {self.hidden_size} only (start the server with --matryoshka-dimensions to "
                             f"allow truncated ones)")
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions must be one of {list(self.matryoshka_dimensions)}, got {dimensions}")
        if not 1 <= dimensions <= self.hidden_size:
            raise ValueError(f"dimensions must be between 1 and {self.hidden_size}, got {dimensions}")


@dataclass
class PoolingParams:
    """One embedding request's options: ``dimensions`` truncates the vector (then it is
    re-normalised, if normalised); ``normalize`` None means the engine's default."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")


def placeholder_sampling_params():
    """The SamplingParams an embedding request carries where the engine expects some: greedy,
    one token. Nothing is sampled for it; code that reads them sees valid values."""
    from pagoda.sampling_params import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0)


def truncate_prompt(token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep the last k tokens (-1: the context length); None
    keeps them all. ValueError for a k outside [1, max_model_len]."""
    k = truncate_prompt_tokens
    if k is None:
        return token_ids
    if k == -1:
        k = max_model_len
    if not _is_int(k) or not 1 <= k <= max_model_len:
        raise ValueError(f"truncate_prompt_tokens must be -1 or between 1 and max_model_len={max_model_len}, "
                         f"got {truncate_prompt_tokens!r}")
    return token_ids[-k:]


def finish_embedding(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """Truncate to ``dimensions`` (Matryoshka), then L2-normalise if asked. Pure Python: the
    runner does the same in torch; this serves the tests and tools that hold a list."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        norm = math.sqrt(sum(v * v for v in vector))
        vector = [v / max(norm, 1e-12) for v in vector]
    return vector


# ---- resolving an engine's task and pooler ------------------------------------------------


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def sentence_transformers_pooling(model_path: str) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) of a sentence-transformers folder: its Pooling module's
    config and whether a Normalize module follows; (None, None) for any other model."""
    modules_file = os.path.join(model_path, "modules.json")
    if not os.path.isdir(model_path) or not os.path.isfile(modules_file):
        return None, None
    modules = _read_json(modules_file)
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    normalize = any(t.endswith(".Normalize") for t in types)
    pooling_type = None
    for m in modules:
        if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling"):
            config_file = os.path.join(model_path, m.get("path", ""), "config.json")
            if os.path.isfile(config_file):
                pooling_type = _pooling_from_st_config(_read_json(config_file), config_file)
    return pooling_type, normalize


def _pooling_from_st_config(config: dict[str, Any], where: str) -> str:
    """E.g. {"pooling_mode_mean_tokens": true, ...} -> "MEAN"; others are refused, not guessed."""
    if isinstance(config.get("pooling_mode"), str):   # newer sentence-transformers spell it once
        mode = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}.get(config["pooling_mode"])
        if mode is None:
            raise ValueError(f"{where}: pooling mode {config['pooling_mode']!r} is not supported (LAST, MEAN, CLS)")
        return mode
    unsupported = [k for k in _ST_UNSUPPORTED if config.get(k)]
    chosen = [kind for key, kind in _ST_MODES.items() if config.get(key)]
    if unsupported or len(chosen) != 1:
        raise ValueError(f"{where}: pagoda pools with exactly one of {', '.join(_ST_MODES)}; the config sets "
                         f"{[k for k, v in config.items() if k.startswith('pooling_mode_') and v]}")
    return chosen[0]


def is_embedding_checkpoint(model_path: str, has_lm_head: bool) -> bool:
    """A base model without an LM head, or a sentence-transformers layout."""
    return not has_lm_head or (os.path.isdir(model_path) and os.path.isfile(os.path.join(model_path, "modules.json")))


def resolve_task(task: str, model_path: str, has_lm_head: bool) -> str:
    """``auto`` made concrete; ValueError for generating from a checkpoint with no LM head."""
    embedding = is_embedding_checkpoint(model_path, has_lm_head)
    if task == "auto":
        return "embed" if embedding else "generate"
    if task == "generate" and not has_lm_head:
        raise ValueError(f"{model_path} is an embedding model (its architecture has no LM head): it cannot "
                         f"generate; serve it with --task embed")
    return task


def resolve_pooler_config(model_path: str, hidden_size: int, overrides: PoolerOverrides | None) -> PoolerConfig:
    """The checkpoint's pooling (see the module docstring) with the user's overrides on top."""
    st_type, st_normalize = sentence_transformers_pooling(model_path)
    hf: dict[str, Any] = {}
    config_file = os.path.join(model_path, "config.json")
    if os.path.isdir(model_path) and os.path.isfile(config_file):
        hf = _read_json(config_file)
    o = overrides or PoolerOverrides()
    dims = o.matryoshka_dimensions if o.matryoshka_dimensions is not None else hf.get("matryoshka_dimensions")
    matryoshka = o.is_matryoshka if o.is_matryoshka is not None else bool(hf.get("is_matryoshka") or dims)
    return PoolerConfig(
        pooling_type=o.pooling_type or st_type or "LAST",
        normalize=o.normalize if o.normalize is not None else (st_normalize if st_normalize is not None else True),
        hidden_size=hidden_size,
        is_matryoshka=matryoshka,
        matryoshka_dimensions=dims,
    )
