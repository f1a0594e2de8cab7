"""The pooling options of an engine: its task, the user's overrides of the checkpoint's
pooler config, and the tokens a causal LM scores with when served as a classifier
(pagoda/pooling.py applies them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.json_options import json_object

# "score" is vLLM's older name of a cross-encoder's task: here the same engine as "classify".
TASKS = ("auto", "generate", "embed", "classify", "score")
POOLING_TYPES = ("LAST", "MEAN", "CLS")

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dimensions_tuple(name: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
        try:
            value = [int(v) for v in value]
        except ValueError:
            raise ValueError(f"{name} must be a comma-separated list of positive integers") from None
    if not isinstance(value, (list, tuple)) or not value or not all(_is_int(v) and v > 0 for v in value):
        raise ValueError(f"{name} must be a non-empty list of positive integers, got {value!r}")
    return tuple(sorted(set(value)))


def parse_token_list(name: str, value: Any) -> tuple[str, ...] | None:
    """``classifier_from_token``: a list of token strings, a JSON list, or "no,yes"."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            import json

            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{name} is not a valid JSON list: {e}") from None
        else:
            value = [t.strip() for t in text.split(",")]
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(t, str) and t for t in value):
        raise ValueError(f"{name} must be a non-empty list of token strings (e.g. no,yes), got {value!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"{name} names a token twice: {list(value)}")
    return tuple(value)


@dataclass(frozen=True)
class PoolerOverrides:
    """What the user sets over the checkpoint's pooler config (None: the checkpoint's word)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    is_matryoshka: bool | None = None
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            kind = str(self.pooling_type).upper()
            if kind not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
            object.__setattr__(self, "pooling_type", kind)
        for name in ("normalize", "is_matryoshka"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        object.__setattr__(self, "matryoshka_dimensions",
                           _dimensions_tuple("matryoshka_dimensions", self.matryoshka_dimensions))

    @property
    def is_empty(self) -> bool:
        return self == PoolerOverrides()

    @classmethod
    def parse(cls, value: PoolerOverrides | dict[str, Any] | str | None) -> PoolerOverrides | None:
        """A PoolerOverrides, or a dict / JSON object of its fields (vLLM's --override-pooler-config)."""
        if value is None or isinstance(value, PoolerOverrides):
            return value
        return cls(**json_object("override_pooler_config", value,
                                 ("pooling_type", "normalize", "is_matryoshka", "matryoshka_dimensions")))
