"""The interface of a reasoning parser: reasoning models write their thinking between
``<think>`` and ``</think>`` before the answer, and the API returns the two apart
(``reasoning_content`` in chat completions, ``thinking`` blocks in Anthropic's Messages).

A parser reads a finished text (``extract``) or follows one as it streams
(``streamer().feed``); both must agree, whatever the chunk boundaries. It also says how
to let a constrained request think first (``constrain``): the grammar admits the reasoning
section as free text and applies the request's constraint to what follows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from pagoda.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class ReasoningSplit:
    """A finished text split: None where that part is absent."""

    reasoning: str | None
    content: str | None


@dataclass(frozen=True)
class ReasoningDelta:
    """What one streamed step adds to each part ("" for nothing)."""

    reasoning: str = ""
    content: str = ""


class ReasoningStreamer(ABC):
    """Follows one choice's text as it grows."""

    @abstractmethod
    def feed(self, delta_text: str, final: bool = False) -> ReasoningDelta:
        """Take the next piece of generated text (``final``: it is the last one, so nothing is
        held back waiting to see whether a tag is starting)."""


class ReasoningParser(ABC):
    name: ClassVar[str]

    @abstractmethod
    def extract(self, text: str) -> ReasoningSplit: ...

    @abstractmethod
    def streamer(self) -> ReasoningStreamer: ...

    @abstractmethod
    def constrain(self, constraint: StructuredOutputsParams) -> StructuredOutputsParams:
        """A grammar for "the reasoning section, then text matching ``constraint``"."""
