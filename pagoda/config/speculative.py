"""``--speculative-config``: which proposer drafts tokens, and how many per step.

The shape follows vLLM's JSON, e.g.
``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}``,
``{"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 8}`` or
``{"method": "draft_model", "num_speculative_tokens": 3, "model": "path/to/small"}`` (the method
implied where a model is given; a Gemma 4 assistant checkpoint drafts over the target's KV
cache, pagoda/spec_decode/gemma4_assistant.py) or
``{"method": "mtp", "num_speculative_tokens": 2}`` (the checkpoint's own MTP head).
Unknown keys are rejected, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagoda.json_options import json_object

METHODS = ("ngram", "layer_skip", "draft_model", "mtp")
# Keys each method accepts besides "method" and "num_speculative_tokens".
_METHOD_KEYS = {
    "ngram": {"prompt_lookup_min", "prompt_lookup_max"},
    "layer_skip": {"num_layers"},
    "draft_model": {"model"},
    "mtp": set(),   # the checkpoint's own multi-token-prediction head (pagoda/spec_decode/mtp.py)
}
MAX_SPECULATIVE_TOKENS = 16


def _int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ValueError(f"speculative_config: {name} must be an integer {bound}, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None   # ngram: shortest suffix to match (default 1)
    prompt_lookup_max: int | None = None   # ngram: longest suffix to match (default 4)
    num_layers: int | None = None          # layer_skip: the draft is the target's first L layers
    model: str | None = None               # draft_model: HF folder or .gguf, same tokenizer

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        _int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        allowed = _METHOD_KEYS[self.method]
        for f in fields(self):
            if f.name in ("method", "num_speculative_tokens"):
                continue
            if getattr(self, f.name) is not None and f.name not in allowed:
                raise ValueError(f"speculative_config: {f.name!r} does not apply to method {self.method!r}")
        if self.method == "ngram":
            lo = 1 if self.prompt_lookup_min is None else _int("prompt_lookup_min", self.prompt_lookup_min, 1)
            hi = max(lo, 4) if self.prompt_lookup_max is None else _int("prompt_lookup_max", self.prompt_lookup_max, 1)
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        elif self.method == "layer_skip":
            if self.num_layers is None:
                raise ValueError("speculative_config: layer_skip needs num_layers (the draft's depth)")
            _int("num_layers", self.num_layers, 1)
        elif self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config: draft_model needs model (a path to the draft model)")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, a dict or a JSON object string."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object("speculative_config", value, (f.name for f in fields(cls)))
        if "method" not in value and "model" in value:
            value = {**value, "method": "draft_model"}   # vLLM's default for a draft model
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative_config needs {required!r}")
        return cls(**value)
