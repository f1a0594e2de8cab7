"""Reasoning between ``<think>`` and ``</think>``: the DeepSeek-R1 and Qwen3 formats.

They differ in where the reasoning may begin:

- ``deepseek_r1``: the chat template already opened ``<think>`` in the prompt, so the output
  starts inside the reasoning. Everything up to the first ``</think>`` is reasoning (a
  leading ``<think>``, if the model writes one anyway, is dropped); no ``</think>`` at all
  means the output was all reasoning (cut short while thinking).
- ``qwen3``: reasoning only between an explicit ``<think>`` and ``</think>``; text without
  ``<think>`` is all content (e.g. thinking switched off in the template). Text before
  ``<think>`` stays content. An unclosed ``<think>`` (cut short while thinking) makes the
  rest reasoning, which is what the stream already sent by then, so streaming and the
  finished text always agree.

Streaming re-reads the text so far minus its longest end that could be the start of a
tag, and sends what the split gained since the last step. Whatever the chunk boundaries,
the pieces add up to ``extract`` of the whole text.
"""

from __future__ import annotations

from typing import ClassVar

from pagoda.reasoning.base import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningSplit,
    ReasoningStreamer,
)
from pagoda.reasoning.grammar import ANY_TEXT, WHITESPACE, as_lark_expression
from pagoda.sampling_params import StructuredOutputsParams

THINK_START, THINK_END = "<think>", "</think>"


def _held_back(text: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of either tag.
    E.g. "so </thi" -> 5: it may become "</think>" with the next piece."""
    for k in range(min(len(THINK_END) - 1, len(text)), 0, -1):
        end = text[-k:]
        if THINK_START.startswith(end) or THINK_END.startswith(end):
            return k
    return 0


class ThinkTagParser(ReasoningParser):
    """The two formats in one class; ``opened_by_template`` is what sets them apart."""

    opened_by_template: ClassVar[bool]
    # The templates write "<think>\n...\n</think>\n\n" before an answer.
    end_of_reasoning = f"\n{THINK_END}\n\n"

    def extract(self, text: str) -> ReasoningSplit:
        if self.opened_by_template:
            return _split_opened(text)
        return _split_explicit(text)

    def reasoning_end(self, text: str) -> int | None:
        start = 0
        if not self.opened_by_template:
            opened = text.find(THINK_START)
            if opened < 0:
                return None
            start = opened + len(THINK_START)
        closed = text.find(THINK_END, start)
        return None if closed < 0 else closed + len(THINK_END)

    def in_reasoning(self, text: str) -> bool:
        opened = self.opened_by_template or THINK_START in text
        return opened and self.reasoning_end(text) is None

    def streamer(self) -> ThinkTagStreamer:
        return ThinkTagStreamer(self)

    def constrain(self, constraint: StructuredOutputsParams) -> StructuredOutputsParams:
        # The reasoning is a lazy rule: it ends at the first "</think>", after which the
        # request's own constraint applies (to the content, which is all it constrains).
        opening = f'"{THINK_START}"?' if self.opened_by_template else f'"{THINK_START}"'
        # The whitespace after "</think>" is outside the lazy rule, which would end before it.
        reasoning = "reasoning THINK_WS" if self.opened_by_template else "(reasoning THINK_WS)?"
        grammar = (
            f"start: {reasoning} answer\n"
            f'reasoning[lazy]: {opening} THINK_TEXT "{THINK_END}"\n'
            f"THINK_TEXT: {ANY_TEXT}\n"
            f"THINK_WS: {WHITESPACE}\n"
            f"answer: {as_lark_expression(constraint)}\n"
        )
        return StructuredOutputsParams(grammar=grammar)


def _split_opened(text: str) -> ReasoningSplit:
    text = text.removeprefix(THINK_START)
    reasoning, found, content = text.partition(THINK_END)
    if not found:
        return ReasoningSplit(reasoning=text or None, content=None)
    return ReasoningSplit(reasoning=reasoning or None, content=content or None)


def _split_explicit(text: str) -> ReasoningSplit:
    before, found, rest = text.partition(THINK_START)
    if not found:
        return ReasoningSplit(reasoning=None, content=text or None)
    reasoning, closed, after = rest.partition(THINK_END)
    if not closed:
        return ReasoningSplit(reasoning=rest or None, content=before or None)
    return ReasoningSplit(reasoning=reasoning or None, content=(before + after) or None)


class ThinkTagStreamer(ReasoningStreamer):
    def __init__(self, parser: ThinkTagParser) -> None:
        self._parser = parser
        self._text = ""
        self._reasoning_sent = 0
        self._content_sent = 0

    def feed(self, delta_text: str, final: bool = False) -> ReasoningDelta:
        self._text += delta_text
        stable = self._text if final else self._text[: len(self._text) - _held_back(self._text)]
        split = self._parser.extract(stable)
        reasoning, content = split.reasoning or "", split.content or ""
        delta = ReasoningDelta(reasoning=reasoning[self._reasoning_sent:], content=content[self._content_sent:])
        self._reasoning_sent = max(self._reasoning_sent, len(reasoning))
        self._content_sent = max(self._content_sent, len(content))
        return delta


class DeepSeekR1ReasoningParser(ThinkTagParser):
    name = "deepseek_r1"
    opened_by_template = True


class Qwen3ReasoningParser(ThinkTagParser):
    name = "qwen3"
    opened_by_template = False
