"""Structured output: grammars that constrain which tokens may come next."""

from __future__ import annotations

from pagoda.lazy import lazy_exports

__all__ = ["GrammarError", "StructuredOutputBackend", "StructuredOutputManager"]

# The manager needs torch; the API process imports only GrammarError.
__getattr__ = lazy_exports(__name__, {
    "GrammarError": "backend", "StructuredOutputBackend": "backend", "StructuredOutputManager": "manager",
})
