"""Packages whose names are imported on first use (PEP 562), so that importing a light
part of them does not import torch: `pagoda serve` starts its engine core before the
API process has imported torch, and the two processes' start-up overlaps."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``name`` comes from the submodule
    ``where[name]``, imported the first time it is asked for."""

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
