"""The embedding options of an engine: its task and the user's overrides of the checkpoint's
pooler config (pagoda/pooling.py applies them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.json_options import json_object

TASKS = ("auto", "generate", "embed")
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
