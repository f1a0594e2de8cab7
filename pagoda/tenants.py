"""Tenants: who a request belongs to, their fair-share weight and their limits.

An ``--api-keys-file`` maps API keys to tenants, in JSON or TOML::

    {"sk-alice-123": {"tenant": "alice", "weight": 2, "max_running": 8, "max_queued": 32},
     "sk-bob-456":   {"tenant": "bob"}}

    # or, TOML
    ["sk-alice-123"]
    tenant = "alice"
    weight = 2

``weight`` (default 1) is the tenant's share of each step's token budget under
``--scheduling-policy fair``; ``max_running`` bounds its requests in the running
batch (the engine core holds the rest back); ``max_queued`` bounds its requests
waiting for their first token (the server answers 429 beyond it). Several keys may
name the same tenant; they must then agree on its settings.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass

DEFAULT_TENANT = "default"
_FIELDS = {"tenant", "weight", "max_running", "max_queued"}


@dataclass(frozen=True)
class TenantSpec:
    name: str
    weight: float = 1.0
    max_running: int | None = None
    max_queued: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a tenant name must be a non-empty string, got {self.name!r}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not self.weight > 0:
            raise ValueError(f"tenant {self.name!r}: weight must be a number > 0, got {self.weight!r}")
        for field in ("max_running", "max_queued"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"tenant {self.name!r}: {field} must be a positive integer, got {value!r}")


def load_api_keys_file(path: str) -> dict[str, TenantSpec]:
    """API key -> TenantSpec. Raises ValueError naming the problem for a malformed file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"api keys file not found: {path}")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        if path.endswith(".toml"):
            data = tomllib.loads(raw.decode())
        else:
            data = json.loads(raw)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: not valid {'TOML' if path.endswith('.toml') else 'JSON'}: {e}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path}: expected a non-empty mapping of API key -> tenant settings")
    keys: dict[str, TenantSpec] = {}
    by_name: dict[str, TenantSpec] = {}
    for key, entry in data.items():
        if not key:
            raise ValueError(f"{path}: an API key must not be empty")
        if isinstance(entry, str):
            entry = {"tenant": entry}
        if not isinstance(entry, dict) or "tenant" not in entry:
            raise ValueError(f"{path}: the entry of a key must be a tenant name or a table with 'tenant'")
        unknown = set(entry) - _FIELDS
        if unknown:
            raise ValueError(f"{path}: unknown tenant setting(s) {sorted(unknown)}; allowed: {sorted(_FIELDS)}")
        spec = TenantSpec(entry["tenant"], entry.get("weight", 1.0), entry.get("max_running"),
                          entry.get("max_queued"))  # fmt: skip
        if by_name.setdefault(spec.name, spec) != spec:
            raise ValueError(f"{path}: keys of tenant {spec.name!r} disagree on its settings")
        keys[key] = spec
    return keys


def tenants_of(keys: dict[str, TenantSpec]) -> dict[str, TenantSpec]:
    """Tenant name -> spec."""
    return {spec.name: spec for spec in keys.values()}
