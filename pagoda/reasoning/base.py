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
from collections.abc import Callable, Sequence
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
    # What a thinking budget appends, as if the model wrote it, to end a reasoning section it
    # cut short, so that the model goes on to the answer (see thinking_budget.py).
    end_of_reasoning: ClassVar[str]

    @abstractmethod
    def extract(self, text: str) -> ReasoningSplit: ...

    @abstractmethod
    def reasoning_end(self, text: str) -> int | None:
        """Where ``text``'s reasoning section ends (just after its closing tag); None while
        it is open, or when there is none."""

    @abstractmethod
    def in_reasoning(self, text: str) -> bool:
        """Whether ``text`` ends inside an open reasoning section."""

    @abstractmethod
    def streamer(self) -> ReasoningStreamer: ...

    def tags(self) -> tuple[str, ...]:
        """The strings the parser looks for in the text (its tags): where the vocabulary makes
        them special tokens, the server keeps special tokens in the decoded text."""
        return ()

    def for_tools(self, active: bool) -> ReasoningParser:
        """The parser for one request; ``active``: a tool parser reads calls out of the content.
        A format whose calls are messages of their own (GPT-OSS's Harmony) leaves them in the
        content only then (see pagoda/reasoning/gpt_oss.py); for the others it changes nothing."""
        return self

    @abstractmethod
    def constrain(self, constraint: StructuredOutputsParams) -> StructuredOutputsParams:
        """A grammar for "the reasoning section, then text matching ``constraint``"."""


def count_reasoning_tokens(parser: ReasoningParser, token_ids: Sequence[int],
                           decode: Callable[[Sequence[int]], str]) -> int:  # fmt: skip
    """How many of the generated ``token_ids`` belong to the reasoning section, its tags
    included: all of them if the output ended while reasoning, none without reasoning,
    else the shortest prefix whose text holds the closed section. The prefix is found by
    bisection (closing is monotone: once a prefix holds the closing tag, longer ones do), so
    this decodes O(log n) prefixes. E.g. ["<think>", "hm", "</think>", "Yes"] -> 3."""
    text = decode(token_ids)
    if parser.in_reasoning(text):
        return len(token_ids)
    if parser.reasoning_end(text) is None:
        return 0
    lo, hi = 0, len(token_ids)  # the prefix of hi tokens closes the section; lo's does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if parser.reasoning_end(decode(token_ids[:mid])) is None:
            lo = mid
        else:
            hi = mid
    return hi
