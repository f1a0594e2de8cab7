"""Pooling: what an embedding or classifying engine pools, and what each of its requests asks for.

An engine runs one task (vLLM's ``--task``): ``generate`` (an LM head and a sampler),
``embed`` (the final norm's hidden states of a prompt pooled into one vector) or
``classify`` (that vector through a classification head: one logit per label). ``auto``,
the default, is ``classify`` for a classification checkpoint, ``embed`` for an embedding
checkpoint and ``generate`` for anything else. An embedding checkpoint is an HF folder
whose architecture has no LM head (transformers' base models: ``Qwen3Model``,
``LlamaModel``, ...) or a sentence-transformers layout (``modules.json``); a classification
checkpoint is a ``*ForSequenceClassification`` one (a score head: ``num_labels`` rows), or
a causal LM with ``classifier_from_token`` (its LM head's logits of those tokens:
Qwen3-Reranker's "no" / "yes").

``ClassifierConfig`` says what a classifier's logits mean: its labels and the activation
each route applies (the engine returns raw logits; ``activate`` turns them into
probabilities or scores in the API process).

``PoolerConfig`` is the engine's: the pooling (LAST / MEAN / CLS), whether vectors are
L2-normalised by default, and which truncated widths (Matryoshka) requests may ask for.
It comes from the checkpoint where it says (sentence-transformers' ``1_Pooling/config.json``
and ``Normalize`` module; ``is_matryoshka`` / ``matryoshka_dimensions`` in config.json),
else LAST pooling (vLLM's default for decoder models) with normalisation, and the user's
``PoolerOverrides`` (``--pooling-type``, ``--no-normalize``, ``--matryoshka-dimensions``;
offline ``LLM(..., override_pooler_config={...})``, vLLM's name) win over both.

``PoolingParams`` is a request's: its ``task`` (it must be the engine's), ``dimensions``
(truncate, then re-normalise), ``normalize`` (None: the engine's default) and, for a
cross-encoder pair, where the second text begins (BERT's token types). No torch here: the
API process imports it.
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

# A classifier's activations: "softmax" over the labels, "sigmoid" or "tanh" of each, "identity" (raw logits).
ACTIVATIONS = ("softmax", "sigmoid", "tanh", "identity")
# sentence-transformers' CrossEncoder names its activation by class path (config.json's
# ``sentence_transformers.activation_fn`` / ``sbert_ce_default_activation_function``).
_ST_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.Softmax": "softmax",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.linear.Identity": "identity",
}


@dataclass(frozen=True)
class ClassifierConfig:
    """A classifying engine's head and what its logits mean.

    ``labels``: one name per logit (config.json's ``id2label``; "LABEL_i" where it has none).
    ``classify_activation``: what /classify applies (transformers' rule by ``problem_type``:
    regression raw, multi-label sigmoid, else sigmoid for one label and softmax for more, as
    vLLM). ``score_activation``: what /score and /rerank apply, a cross-encoder's
    (sentence-transformers' CrossEncoder: its configured activation, else sigmoid for one
    label). ``from_token_ids``: a causal LM's LM-head rows that are the logits (None: the
    checkpoint's own score head); with ``two_way`` the two make one label, the logit
    difference (vLLM's from_2_way_softmax: sigmoid of it is the second token's probability
    of the two). ``token_types``: the model reads token type ids (BERT): a pair's second
    text is type 1."""

    labels: tuple[str, ...]
    classify_activation: str
    score_activation: str
    from_token_ids: tuple[int, ...] | None = None
    two_way: bool = False
    token_types: bool = False

    def __post_init__(self) -> None:
        if not self.labels:
            raise ValueError("a classifier needs at least one label")
        for name in ("classify_activation", "score_activation"):
            if getattr(self, name) not in ACTIVATIONS:
                raise ValueError(f"{name} must be one of {', '.join(ACTIVATIONS)}, got {getattr(self, name)!r}")
        if self.two_way and (self.from_token_ids is None or len(self.from_token_ids) != 2 or len(self.labels) != 1):
            raise ValueError("a two-way classifier reads two tokens into one label")

    @property
    def num_labels(self) -> int:
        return len(self.labels)


def activate(logits: list[float], activation: str) -> list[float]:
    """E.g. softmax [0.0, 0.0] -> [0.5, 0.5]; sigmoid [0.0] -> [0.5]; tanh [0.0] -> [0.0];
    identity as it is."""
    if activation == "sigmoid":
        return [_sigmoid(x) for x in logits]
    if activation == "softmax":
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        total = sum(exps)
        return [e / total for e in exps]
    if activation == "tanh":
        return [math.tanh(x) for x in logits]
    if activation == "identity":
        return list(logits)
    raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")


def _sigmoid(x: float) -> float:
    # Written both ways so that neither exp overflows.
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


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
    # A classifying engine's head (task classify): the pooled vector goes through it, and
    # requests get its logits; None: an embedding engine.
    classifier: ClassifierConfig | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not _is_int(self.hidden_size) or self.hidden_size < 1:
            raise ValueError(f"hidden_size must be a positive integer, got {self.hidden_size!r}")
        dims = _dimensions_tuple("matryoshka_dimensions", self.matryoshka_dimensions)
        if dims is not None and dims[-1] > self.hidden_size:
            raise ValueError(f"matryoshka_dimensions {list(dims)} go past the model's width {self.hidden_size}")
        object.__setattr__(self, "matryoshka_dimensions", dims)
        if self.classifier is not None and (self.normalize or self.is_matryoshka or dims is not None):
            raise ValueError("a classifier's logits are not normalised or truncated (normalize, matryoshka "
                             "dimensions apply to --task embed)")

    @property
    def task(self) -> str:
        return "embed" if self.classifier is None else "classify"

    @property
    def needs_every_position(self) -> bool:
        """MEAN and CLS pooling read hidden states a prefix-cache hit would skip."""
        return self.pooling_type != "LAST"

    def check_pair(self, pair_start: int | None, prompt_len: int) -> None:
        """ValueError (its message for a 400) for a pair this model cannot read as one."""
        if pair_start is None:
            return
        if self.classifier is None or not self.classifier.token_types:
            raise ValueError("pair_start: this model reads no token type ids (only a BERT-style cross-encoder "
                             "does); give the pair's tokens as one prompt")
        if not 0 < pair_start < prompt_len:
            raise ValueError(f"pair_start must be between 1 and {prompt_len - 1} (the prompt's length less "
                             f"one), got {pair_start}")

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
    """One pooling request's options: ``task`` what it wants ("embed": a vector; "classify":
    the logits of a classifier), which must be the engine's; ``dimensions`` truncates the
    vector (then it is re-normalised, if normalised); ``normalize`` None means the engine's
    default; ``pair_start``: a cross-encoder pair's second text begins at this token (BERT's
    token type ids: 0 before it, 1 from it; vLLM sends them compressed the same way)."""

    dimensions: int | None = None
    normalize: bool | None = None
    task: str = "embed"
    pair_start: int | None = None

    def __post_init__(self) -> None:
        if self.task not in ("embed", "classify"):
            raise ValueError(f"task must be embed or classify, got {self.task!r}")
        if self.task == "classify" and (self.dimensions is not None or self.normalize is not None):
            raise ValueError("dimensions and normalize apply to embeddings, not to a classifier's logits")
        if self.pair_start is not None and (not _is_int(self.pair_start) or self.pair_start < 1):
            raise ValueError(f"pair_start must be a positive integer, got {self.pair_start!r}")
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


def resolve_task(task: str, model_path: str, has_lm_head: bool, classifier: bool = False) -> str:
    """``auto`` made concrete (``classifier``: the checkpoint has a classification head, or
    tokens to classify with were given); ValueError for a task the checkpoint cannot run."""
    if task == "score":
        task = "classify"
    embedding = is_embedding_checkpoint(model_path, has_lm_head)
    if task == "auto":
        return "classify" if classifier else "embed" if embedding else "generate"
    if task == "generate" and classifier:
        raise ValueError(f"{model_path} is served as a classifier (a *ForSequenceClassification checkpoint, or "
                         f"--classifier-from-token): it cannot generate; serve it with --task classify")
    if task == "generate" and not has_lm_head:
        raise ValueError(f"{model_path} is an embedding model (its architecture has no LM head): it cannot "
                         f"generate; serve it with --task embed")
    if task == "classify" and not classifier:
        raise ValueError(f"{model_path} has no classification head: --task classify needs a "
                         f"*ForSequenceClassification checkpoint, or a causal LM with --classifier-from-token")
    return task


def classifier_from_config(hf: dict[str, Any], num_labels: int, from_tokens: tuple[str, ...] | None = None,
                           from_token_ids: tuple[int, ...] | None = None,
                           token_types: bool = False) -> ClassifierConfig:  # fmt: skip
    """A classifier's labels and activations from its config.json (``hf``), as the module
    docstring and ``ClassifierConfig`` say; ``from_tokens`` (their ids ``from_token_ids``):
    a causal LM's tokens, each a label named by itself, except that two make one label,
    named by the second (vLLM's from_2_way_softmax: "yes" of "no", "yes")."""
    two_way = from_token_ids is not None and len(from_token_ids) == 2
    if from_tokens is not None:
        num_labels = 1 if two_way else len(from_tokens)
    id2label = hf.get("id2label")
    if from_tokens is not None:
        labels = (from_tokens[1],) if two_way else tuple(from_tokens)
    elif isinstance(id2label, dict) and len(id2label) == num_labels:
        labels = tuple(str(id2label.get(str(i), f"LABEL_{i}")) for i in range(num_labels))   # JSON keys are strings
    else:
        labels = tuple(f"LABEL_{i}" for i in range(num_labels))
    default = "sigmoid" if num_labels == 1 else "softmax"
    problem = hf.get("problem_type")
    classify = {"regression": "identity", "multi_label_classification": "sigmoid"}.get(problem, default)
    st = hf.get("sentence_transformers")
    fn = st.get("activation_fn") if isinstance(st, dict) else None
    fn = fn or hf.get("sbert_ce_default_activation_function")
    if fn is not None and fn not in _ST_ACTIVATIONS:
        raise ValueError(f"the checkpoint's cross-encoder activation {fn!r} is not supported (supported: "
                         f"{', '.join(_ST_ACTIVATIONS)})")
    score = _ST_ACTIVATIONS[fn] if fn is not None else default
    if score in ("sigmoid", "softmax"):   # as vLLM reads either: sigmoid of one logit, softmax over more
        score = default
    return ClassifierConfig(labels, classify, score, from_token_ids, two_way, token_types)


def read_hf_config(model_path: str) -> dict[str, Any]:
    """An HF folder's config.json ({} for a GGUF file or a folder without one)."""
    config_file = os.path.join(model_path, "config.json")
    if os.path.isdir(model_path) and os.path.isfile(config_file):
        return _read_json(config_file)
    return {}


def resolve_classifier_pooler(hidden_size: int, classifier: ClassifierConfig, default_pooling: str,
                              overrides: PoolerOverrides | None) -> PoolerConfig:
    """A classifier's pooling: the family's (LAST for a decoder, CLS for BERT) unless
    ``--pooling-type`` says otherwise; never normalised or truncated."""
    o = overrides or PoolerOverrides()
    if o.normalize is not None or o.is_matryoshka is not None or o.matryoshka_dimensions is not None:
        raise ValueError("--normalize and --matryoshka-dimensions apply to --task embed, not to a classifier "
                         "(its logits are neither normalised nor truncated)")
    return PoolerConfig(pooling_type=o.pooling_type or default_pooling, normalize=False, hidden_size=hidden_size,
                        classifier=classifier)


def resolve_pooler_config(model_path: str, hidden_size: int, overrides: PoolerOverrides | None) -> PoolerConfig:
    """The checkpoint's pooling (see the module docstring) with the user's overrides on top."""
    st_type, st_normalize = sentence_transformers_pooling(model_path)
    hf = read_hf_config(model_path)
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
