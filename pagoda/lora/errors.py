"""The LoRA errors the API process catches (no torch here)."""

from __future__ import annotations


class LoRAAdapterError(ValueError):
    """The adapter cannot be loaded: missing files, unsupported settings or
    target modules, shapes that do not fit the base model."""


class LoRAInUseError(ValueError):
    """An adapter cannot be unloaded while requests use it."""
