"""The grammar backend interface and its llguidance implementation.

A backend turns StructuredOutputsParams into a grammar, and a grammar into a
per-request matcher. A matcher follows the tokens a request generates: it
fills that request's row of a token bitmask (bit set = token allowed next),
accepts each sampled token, says when the grammar is complete, and can roll
back tokens (for speculative decoding).
"""

from __future__ import annotations

import json
from typing import Protocol, Sequence

import numpy as np

from pagoda.sampling_params import StructuredOutputsParams


class GrammarError(ValueError):
    """An invalid schema, regex or grammar, or one beyond the compiler's limits."""


class Matcher(Protocol):
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None: ...
    def accept_token(self, token_id: int) -> bool: ...
    def is_terminated(self) -> bool: ...
    def rollback(self, num_tokens: int) -> None: ...


class StructuredOutputBackend(Protocol):
    vocab_size: int

    def compile(self, params: StructuredOutputsParams) -> str:
        """Validate and compile to a grammar description; raises GrammarError."""

    def matcher(self, grammar: str) -> Matcher: ...


# One-line JSON with the usual separators. Flexible whitespace lets a sampled
# model pad with newlines and spaces until max_tokens cuts the document off.
# A schema's own "x-guidance" settings still override this.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _choice_to_lark(choices: Sequence[str]) -> str:
    alternatives = " | ".join(json.dumps(c) for c in choices)
    return f"start: {alternatives}\n"


class LLGuidanceMatcher:
    def __init__(self, matcher) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        view = bitmask[row]
        self._m.unsafe_compute_mask_ptr(view.ctypes.data, view.size * view.itemsize)

    def accept_token(self, token_id: int) -> bool:
        return self._m.consume_token(token_id)

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class LLGuidanceBackend:
    """llguidance: ~2 ms to compile a nested JSON schema on this vocabulary,
    tens of microseconds per mask, no heavy dependencies. Special tokens are
    never admitted inside strings."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import llguidance  # not llguidance.torch: its torch.compile costs seconds at import

        self._ll = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids) or None
        )

    def compile(self, params: StructuredOutputsParams) -> str:
        m = self._ll.LLMatcher
        try:
            if params.json is not None:
                grammar = m.grammar_from_json_schema(params.json, defaults=_JSON_LAYOUT)
            elif params.json_object:
                grammar = m.grammar_from_json_schema({"type": "object"}, defaults=_JSON_LAYOUT)
            elif params.regex is not None:
                grammar = m.grammar_from_regex(params.regex)
            elif params.choice is not None:
                grammar = m.grammar_from_lark(_choice_to_lark(params.choice))
            else:
                grammar = m.grammar_from_lark(str(params.grammar))
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid structured output specification: {e}") from e
        is_error, messages = m.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise GrammarError(f"invalid structured output specification: {messages[0] if messages else 'unknown error'}")
        return grammar

    def matcher(self, grammar: str) -> LLGuidanceMatcher:
        matcher = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid structured output specification: {matcher.get_error()}")
        return LLGuidanceMatcher(matcher)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    return np.full((rows, bitmask_width(vocab_size)), -1, dtype=np.int32)
