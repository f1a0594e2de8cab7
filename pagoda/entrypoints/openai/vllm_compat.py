"""What the server adds for clients and tooling written against vLLM's server.

- ``LoRAPathPolicy``: where POST /v1/load_lora_adapter may read adapters from;
- ``orca_load_header`` / ``engine_load``: ORCA's ``endpoint-load-metrics`` response header;
- ``tokenizer_config``: GET /tokenizer_info's body;
- ``model_root``: the base model's ``root`` in /v1/models;
- ``parse_body``: a JSON body checked against a request model, with the server's 400s
  (POST /invocations picks the model after reading the body).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from pagoda.engine.client import EngineClient
from pagoda.entrypoints.openai.errors import validation_error_to_api_error
from pagoda.tokenizer import Tokenizer

M = TypeVar("M", bound=BaseModel)

# The one answer for every refused adapter path: whether the path is missing, a file, a
# folder without an adapter or outside the roots, a client learns nothing of the filesystem.
LORA_PATH_REFUSED = (
    "The LoRA adapter cannot be loaded from this path: it must name an adapter folder inside one of the "
    "folders the server allows (--lora-root)."
)


@dataclass(frozen=True)
class LoRAPathPolicy:
    """Runtime adapter loading: off unless ``allow_runtime_lora``; then only from folders
    under ``roots``. A path is resolved (symlinks followed, ``..`` collapsed) before the check,
    so neither a link nor a ``..`` leads out of a root; a relative path is taken relative to
    each root in turn."""

    allow_runtime_lora: bool = False
    roots: Sequence[str] = ()

    def resolve(self, lora_path: str) -> str | None:
        """The adapter folder ``lora_path`` names, resolved, if it is allowed; else None."""
        if not self.allow_runtime_lora or "\x00" in lora_path:
            return None
        for root in self.roots:
            real_root = os.path.realpath(root)
            candidate = os.path.realpath(os.path.join(real_root, os.path.expanduser(lora_path)))
            inside = candidate != real_root and os.path.commonpath([real_root, candidate]) == real_root
            if inside and os.path.isfile(os.path.join(candidate, "adapter_config.json")):
                return candidate
        return None


def engine_load(engine: EngineClient) -> dict[str, float]:
    """The load a balancer weighs endpoints by: vLLM's two ORCA named metrics, plus the
    running count."""
    stats = engine.latest_stats()
    return {
        "kv_cache_usage_perc": float(stats.kv_cache_usage),
        "num_requests_waiting": float(stats.num_waiting_reqs),
        "num_requests_running": float(stats.num_running_reqs),
    }


def orca_load_header(fmt: str, metrics: dict[str, float]) -> str:
    """The ``endpoint-load-metrics`` value in ORCA's native text or JSON form, as vLLM writes it:
    ``TEXT named_metrics.kv_cache_usage_perc=0.25, named_metrics.num_requests_waiting=2.0`` or
    ``JSON {"named_metrics": {"kv_cache_usage_perc": 0.25, ...}}``."""
    if fmt == "json":
        return "JSON " + json.dumps({"named_metrics": metrics})
    return "TEXT " + ", ".join(f"named_metrics.{name}={value}" for name, value in metrics.items())


def load_metrics_format(headers: dict[bytes, bytes]) -> str | None:
    """The request's ``endpoint-load-metrics-format`` (``text`` or ``json``), if any. Other
    values (ORCA's binary form) get no report, as in vLLM: the header is a load balancer's
    request for information, never a reason to fail the request."""
    raw = headers.get(b"endpoint-load-metrics-format")
    if raw is None:
        return None
    value = raw.decode("latin-1").strip().lower()
    return value if value in ("text", "json") else None


def tokenizer_config(tokenizer: Tokenizer, max_model_len: int) -> dict[str, Any]:
    """GET /tokenizer_info: the keys of a tokenizer_config.json, as vLLM returns them. The
    tokenizer is a ``tokenizers`` one, which transformers loads as PreTrainedTokenizerFast."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tokenizer.add_bos_token,
        "model_max_length": max_model_len,
        "vocab_size": tokenizer.vocab_size,
        "chat_template": tokenizer.chat_template,
        "added_tokens_decoder": {
            str(i): {"content": tokenizer.id_to_token(i), "special": True} for i in sorted(tokenizer.all_special_ids)
        },
    }
    for name in ("bos", "eos", "pad", "unk"):
        token_id = getattr(tokenizer, f"{name}_token_id")
        if token_id is not None:
            config[f"{name}_token"] = tokenizer.id_to_token(token_id)
    return config


def model_root(engine: EngineClient) -> str | None:
    """The base model's weights path, vLLM's ``root`` of the served model."""
    model = engine.config.model
    if model is not None:
        return str(model)
    from pagoda.hub.paths import ModelLoadError, default_model_path

    try:
        return default_model_path()
    except ModelLoadError:  # no bundled model on this machine: an engine built some other way
        return None


def parse_body(model: type[M], body: dict[str, Any]) -> M:
    """``body`` as ``model``, a bad one answered with the same 400 FastAPI's own parsing gives."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        raise validation_error_to_api_error(RequestValidationError(errors)) from None
