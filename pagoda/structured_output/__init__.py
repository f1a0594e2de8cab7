"""Structured output: grammars that constrain which tokens may come next."""

from pagoda.structured_output.backend import GrammarError, StructuredOutputBackend
from pagoda.structured_output.manager import StructuredOutputManager

__all__ = ["GrammarError", "StructuredOutputBackend", "StructuredOutputManager"]
