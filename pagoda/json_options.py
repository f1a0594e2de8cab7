"""Options given as JSON objects (``--speculative-config``, ``--override-pooler-config``,
``--kv-transfer-config``, a request's ``kv_transfer_params``): one reading of the text."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def json_object(name: str, value: Any, known: Iterable[str] | None = None) -> dict[str, Any]:
    """``value`` (a dict, or the JSON text of an object) as a dict; ValueError naming ``name``,
    also for keys not in ``known`` (when given): unknown options are refused, never ignored."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    if known is not None:
        known = list(known)
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"{name}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    return value
