"""Reasoning between a start and an end tag, the formats of most reasoning families:

| parser | models | tags | the template opens the reasoning |
|---|---|---|---|
| ``deepseek_r1`` | DeepSeek-R1 | ``<think>`` ``</think>`` | yes |
| ``qwen3`` | Qwen3 | ``<think>`` ``</think>`` | no |
| ``glm45`` | GLM-4.5, GLM-4.6 | ``<think>`` ``</think>`` | no |
| ``glm47`` | GLM-4.7 | ``<think>`` ``</think>`` | yes |
| ``minimax_m2`` | MiniMax-M2 | ``<think>`` ``</think>`` | yes |
| ``mistral`` | Magistral | ``[THINK]`` ``[/THINK]`` | no |
| ``seed_oss`` | Seed-OSS | ``<seed:think>`` ``</seed:think>`` | no |
| ``ernie45`` | ERNIE-4.5 Thinking | ``<think>`` ``</think>``, the answer in ``<response>`` | yes |
| ``hunyuan_a13b`` | Hunyuan-A13B | ``<think>`` ``</think>``, the answer in ``<answer>`` | no |
| ``granite`` | Granite 3.2 | ``Here is my thought process:`` ``Here is my response:`` (or ``Here's``) | no |

Where the reasoning may begin is what sets the two kinds apart:

- opened by the template (``deepseek_r1``...): the prompt ends with the start tag, so the
  output starts inside the reasoning. Everything up to the first end tag is reasoning (a
  leading start tag, if the model writes one anyway, is dropped); no end tag at all means the
  output was all reasoning (cut short while thinking).
- written by the model (``qwen3``...): reasoning only between an explicit start tag and the
  end tag; text without a start tag is all content (e.g. thinking switched off in the
  template). Text before the start tag stays content. An unclosed start tag (cut short while
  thinking) makes the rest reasoning, which is what the stream already sent by then, so
  streaming and the finished text always agree.

A format may have several spellings of a tag (Granite's); the first is the one written. Where a
family wraps its answer (ERNIE's ``<response>``, Hunyuan's ``<answer>``), a content that opens
with the wrapper's tag loses it, the whitespace inside it, and its closing tag at the end:
``</think>\\n\\n<response>\\nIt is 4.\\n</response>\\n`` -> content ``It is 4.``.

``minimax_m2_append_think`` is vLLM's other MiniMax-M2 parser: no reasoning split, the whole
output returned as content after the ``<think>`` the template opened, for clients that send the
model's thinking back in the next turn's content (MiniMax's interleaved thinking).

Streaming re-reads the text so far minus its longest end that could be the start of a tag
(and, with an answer wrapper, the whitespace and wrapper tags that may still be dropped), and
sends what the split gained since the last step. Whatever the chunk boundaries, the pieces add
up to ``extract`` of the whole text.
"""

from __future__ import annotations

import json
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
_WS = " \t\r\n"


def _find(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """Where the first of ``tags`` occurs in ``text`` at or after ``start`` (-1: none) and which."""
    found = [(at, -len(tag), tag) for tag in tags if (at := text.find(tag, start)) >= 0]
    if not found:
        return -1, ""
    at, _, tag = min(found)
    return at, tag


def _partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of one of ``tags``.
    E.g. "so </thi" -> 5: it may become "</think>" with the next piece."""
    for k in range(min(max(len(t) for t in tags) - 1, len(text)), 0, -1):
        end = text[-k:]
        if any(len(t) > k and t.startswith(end) for t in tags):
            return k
    return 0


class ThinkTagParser(ReasoningParser):
    """Every format in the table; class attributes set them apart."""

    opened_by_template: ClassVar[bool]
    start_tags: ClassVar[tuple[str, ...]] = (THINK_START,)
    end_tags: ClassVar[tuple[str, ...]] = (THINK_END,)
    answer_tags: ClassVar[tuple[str, str] | None] = None   # (open, close) around the answer
    # The templates write "<think>\n...\n</think>\n\n" before an answer.
    end_of_reasoning = f"\n{THINK_END}\n\n"

    def tags(self) -> tuple[str, ...]:
        return self.start_tags + self.end_tags + (self.answer_tags or ())

    def extract(self, text: str) -> ReasoningSplit:
        split = self._split_opened(text) if self.opened_by_template else self._split_explicit(text)
        if self.answer_tags is None or split.content is None:
            return split
        return ReasoningSplit(reasoning=split.reasoning, content=self._unwrap(split.content) or None)

    def _split_opened(self, text: str) -> ReasoningSplit:
        for tag in self.start_tags:
            if text.startswith(tag):
                text = text[len(tag):]
                break
        at, tag = _find(text, self.end_tags)
        if at < 0:
            return ReasoningSplit(reasoning=text or None, content=None)
        return ReasoningSplit(reasoning=text[:at] or None, content=text[at + len(tag):] or None)

    def _split_explicit(self, text: str) -> ReasoningSplit:
        opened, start = _find(text, self.start_tags)
        if opened < 0:
            return ReasoningSplit(reasoning=None, content=text or None)
        before, rest = text[:opened], text[opened + len(start):]
        closed, end = _find(rest, self.end_tags)
        if closed < 0:
            return ReasoningSplit(reasoning=rest or None, content=before or None)
        return ReasoningSplit(reasoning=rest[:closed] or None, content=(before + rest[closed + len(end):]) or None)

    def _unwrap(self, content: str) -> str:
        """The content without the answer wrapper, when it opens with it."""
        assert self.answer_tags is not None
        opening, closing = self.answer_tags
        body = content.lstrip(_WS)
        if not body.startswith(opening):
            return content
        body = body[len(opening):].lstrip(_WS)
        tail = body.rstrip(_WS)
        return tail[:-len(closing)].rstrip(_WS) if tail.endswith(closing) else body

    def reasoning_end(self, text: str) -> int | None:
        start = 0
        if not self.opened_by_template:
            opened, tag = _find(text, self.start_tags)
            if opened < 0:
                return None
            start = opened + len(tag)
        closed, tag = _find(text, self.end_tags, start)
        return None if closed < 0 else closed + len(tag)

    def in_reasoning(self, text: str) -> bool:
        opened = self.opened_by_template or _find(text, self.start_tags)[0] >= 0
        return opened and self.reasoning_end(text) is None

    def held_back(self, text: str) -> int:
        """How much of ``text``'s end a stream holds back: what may still become a tag, and
        with an answer wrapper, the whitespace and wrapper tags the content may still lose."""
        k = _partial_tag(text, self.start_tags + self.end_tags + (self.answer_tags or ()))
        if self.answer_tags is None:
            return k
        i = len(text) - k
        i = len(text[:i].rstrip(_WS))
        for tag in self.answer_tags:
            if text.endswith(tag, 0, i):
                i = len(text[:i - len(tag)].rstrip(_WS))
                break
        return len(text) - i

    def streamer(self) -> ReasoningStreamer:
        return ThinkTagStreamer(self)

    def constrain(self, constraint: StructuredOutputsParams) -> StructuredOutputsParams:
        # The reasoning is a lazy rule: it ends at the first end tag, after which the request's
        # own constraint applies (to the content, which is all it constrains).
        starts = " | ".join(json.dumps(t) for t in self.start_tags)
        ends = " | ".join(json.dumps(t) for t in self.end_tags)
        opening = f"({starts})?" if self.opened_by_template else f"({starts})"
        # The whitespace after the end tag is outside the lazy rule, which would end before it;
        # a model that writes its start tag may put whitespace before it (GLM-4.5: "\n<think>").
        reasoning = "reasoning THINK_WS" if self.opened_by_template else "(THINK_WS reasoning THINK_WS)?"
        answer, wrapper = "answer", ""
        if self.answer_tags is not None:   # the constraint inside the wrapper, or on its own
            answer = "content"
            opening_tag, closing_tag = (json.dumps(t) for t in self.answer_tags)
            wrapper = f"content: {opening_tag} THINK_WS answer THINK_WS {closing_tag} | answer\n"
        grammar = (
            f"start: {reasoning} {answer}\n"
            f"reasoning[lazy]: {opening} THINK_TEXT ({ends})\n"
            f"THINK_TEXT: {ANY_TEXT}\n"
            f"THINK_WS: {WHITESPACE}\n"
            f"{wrapper}"
            f"answer: {as_lark_expression(constraint)}\n"
        )
        return StructuredOutputsParams(grammar=grammar)


class ThinkTagStreamer(ReasoningStreamer):
    def __init__(self, parser: ThinkTagParser) -> None:
        self._parser = parser
        self._text = ""
        self._reasoning_sent = 0
        self._content_sent = 0

    def feed(self, delta_text: str, final: bool = False) -> ReasoningDelta:
        self._text += delta_text
        stable = self._text if final else self._text[: len(self._text) - self._parser.held_back(self._text)]
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


class Glm45ReasoningParser(ThinkTagParser):
    """GLM-4.5 / 4.6: the generation prompt is ``<|assistant|>`` (``\\n<think></think>`` with
    thinking off), the model opens ``\\n<think>`` itself."""

    name = "glm45"
    opened_by_template = False
    end_of_reasoning = f"\n{THINK_END}\n"   # (the template: "<think>...</think>\ncontent")


class Glm47ReasoningParser(ThinkTagParser):
    """GLM-4.7: the generation prompt ends ``<|assistant|><think>``."""

    name = "glm47"
    opened_by_template = True
    end_of_reasoning = THINK_END   # (the template: "<think>...</think>content")


class MiniMaxM2ReasoningParser(ThinkTagParser):
    """MiniMax-M2: the generation prompt ends ``]~b]ai\\n<think>\\n``."""

    name = "minimax_m2"
    opened_by_template = True


class MiniMaxM2AppendThinkReasoningParser(MiniMaxM2ReasoningParser):
    """The whole output as content, after the ``<think>`` the template opened; no reasoning.
    Where the reasoning ends (a thinking budget, the reasoning token count) is read as
    ``minimax_m2`` reads it."""

    name = "minimax_m2_append_think"

    def extract(self, text: str) -> ReasoningSplit:
        return ReasoningSplit(reasoning=None, content=THINK_START + text)

    def streamer(self) -> ReasoningStreamer:
        return _PrefixedStreamer(THINK_START)


class _PrefixedStreamer(ReasoningStreamer):
    """All content, ``prefix`` first."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix

    def feed(self, delta_text: str, final: bool = False) -> ReasoningDelta:
        prefix, self._prefix = self._prefix, ""
        return ReasoningDelta(content=prefix + delta_text)


class MistralReasoningParser(ThinkTagParser):
    """Magistral: ``[THINK]...[/THINK]`` (control tokens in Mistral's tokenizers), written by
    the model when its system prompt asks it to think."""

    name = "mistral"
    opened_by_template = False
    start_tags, end_tags = ("[THINK]",), ("[/THINK]",)
    end_of_reasoning = "[/THINK]"


class SeedOssReasoningParser(ThinkTagParser):
    """Seed-OSS: the model opens ``<seed:think>`` itself (the template closes a block in the
    prompt only for a thinking budget of 0)."""

    name = "seed_oss"
    opened_by_template = False
    start_tags, end_tags = ("<seed:think>",), ("</seed:think>",)
    end_of_reasoning = "</seed:think>\n"


class Ernie45ReasoningParser(ThinkTagParser):
    """ERNIE-4.5 Thinking: ``reasoning\\n</think>\\n\\n<response>\\nanswer\\n</response>\\n``
    (or the answer bare after ``</think>``)."""

    name = "ernie45"
    opened_by_template = True
    answer_tags = ("<response>", "</response>")


class HunyuanA13BReasoningParser(ThinkTagParser):
    """Hunyuan-A13B: ``<think>\\nreasoning\\n</think>\\n<answer>\\nanswer\\n</answer>``."""

    name = "hunyuan_a13b"
    opened_by_template = False
    answer_tags = ("<answer>", "</answer>")
    end_of_reasoning = f"\n{THINK_END}\n<answer>\n"


class GraniteReasoningParser(ThinkTagParser):
    """Granite 3.2 (with ``thinking`` on in its template): plain-text headings."""

    name = "granite"
    opened_by_template = False
    start_tags = ("Here is my thought process:", "Here's my thought process:")
    end_tags = ("Here is my response:", "Here's my response:")
    end_of_reasoning = "\n\nHere is my response:\n"
