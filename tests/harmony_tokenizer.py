"""A tokenizer that has GPT-OSS's Harmony markers as special tokens, for tests: the bundled
model's vocabulary with the seven markers added (GPT-OSS's own vocabulary, o200k_harmony, is
not on this machine). ``<|return|>`` and ``<|call|>`` end generation, as in GPT-OSS's
generation_config.json."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import tokenizers
from tokenizers import AddedToken

from pagoda.reasoning.harmony import CALL, MARKERS, RETURN
from pagoda.tokenizer import Tokenizer

# What decides that a model speaks Harmony is its template writing <|channel|>; the prompt itself is
# rendered by pagoda's Harmony renderer, so this stand-in only needs to say so.
HARMONY_TEMPLATE = ("{# GPT-OSS #}{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>"
                    "{{ m.content }}<|end|>{% endfor %}<|start|>assistant")  # fmt: skip


@lru_cache(maxsize=4)
def harmony_tokenizer(eos: Sequence[str] = (RETURN, CALL), chat_template: str | None = HARMONY_TEMPLATE) -> Tokenizer:
    from pagoda.config import EngineConfig
    from pagoda.tokenizer import load_tokenizer

    base = load_tokenizer(EngineConfig())
    backend = tokenizers.Tokenizer.from_str(base.backend.to_str())
    backend.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    ids = [backend.token_to_id(t) for t in eos]
    return Tokenizer(backend, eos_token_id=ids[0], extra_eos_token_ids=ids[1:], chat_template=chat_template)
