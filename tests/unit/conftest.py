"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def grammar_acceptor(tok: Any) -> Callable[[str, str], bool]:
    """accepts(grammar, text): whether a Lark grammar (llguidance) accepts ``text``, tokenized
    by the pagoda Tokenizer ``tok`` (special tokens matched whole)."""
    llguidance = pytest.importorskip("llguidance")
    ll_tok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_token_ids))

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        assert not m.is_error(), m.get_error()
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    return accepts


@pytest.fixture(scope="module")
def matcher_factory():
    """accepts(grammar, text) over the bundled model's tokenizer (``grammar_acceptor``)."""
    from pagoda.config import EngineConfig
    from pagoda.tokenizer import load_tokenizer

    return grammar_acceptor(load_tokenizer(EngineConfig()))
