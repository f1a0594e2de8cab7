"""GPT-OSS's reasoning (``--reasoning-parser openai_gptoss``, vLLM's name): the Harmony format's
``analysis`` channel (see pagoda/reasoning/harmony.py for the format).

The split of an output, message by message:

- ``analysis`` messages (without a recipient) are the reasoning, joined with newlines;
- ``final`` messages, ``commentary`` messages without a recipient (preambles, text for the
  user) and malformed ones (the text as written) are the content, joined with newlines;
- messages with a recipient are tool calls (``to=functions.get_weather``, or a built-in tool's
  ``to=python`` on ``analysis``). Where a tool parser reads the content (``for_tools(True)``:
  the request has tools), each stays in it as a block the ``openai`` tool parser reads::

      <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"city":"Paris"}<|end|>

  (``<|end|>`` once the call is complete). Without tools there is no one to give them to, and
  they are left out (vLLM's and llama.cpp's choice too), so that the content is the answer's
  text alone, never Harmony markup.

E.g. ``<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4``
-> reasoning ``Easy.``, content ``4``. The stream gives the same pieces in every chunking
(it is built on ``HarmonyStreamParser``, and ``extract`` is the stream fed the whole text).

The reasoning section that ``reasoning_end`` / ``in_reasoning`` locate (what a thinking budget
cuts and the reasoning tokens count) is the analysis message an output opens with, GPT-OSS's
way of reasoning; ``end_of_reasoning`` closes it and opens the final answer. The grammar of a
constrained request (``constrain``) lets analysis messages come freely, then puts the constraint
in the final message; a grammar the ``openai`` tool parser wrote for a forced call is already
one of whole outputs, and is kept as it is.
"""

from __future__ import annotations

from typing import ClassVar

from pagoda.reasoning.harmony import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    MESSAGE,
    RETURN,
    START,
    HarmonyMessage,
    HarmonyStreamParser,
    MessageDelta,
    message_header,
    parse,
)
from pagoda.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningSplit, ReasoningStreamer
from pagoda.reasoning.grammar import ANY_TEXT, as_lark_expression
from pagoda.sampling_params import StructuredOutputsParams

# The first line of a grammar that admits whole Harmony outputs (the openai tool parser's): constrain()
# leaves it as it is. (A Lark comment: it changes nothing in the grammar.)
WHOLE_OUTPUT_GRAMMAR = "// harmony: whole output\n"
# The Harmony markers are special tokens of GPT-OSS's vocabulary: a grammar names them as such (<|end|>,
# not "<|end|>", which would be the text spelled out), and free text cannot contain one.
ANALYSIS_RULES = (
    'analysis: <|channel|> "analysis" <|message|> HARMONY_TEXT\n'
    f"HARMONY_TEXT: {ANY_TEXT}\n"
)


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    end_of_reasoning: ClassVar[str] = f"{END}{START}assistant{CHANNEL}final{MESSAGE}"

    def __init__(self, keep_calls: bool = False) -> None:
        self.keep_calls = keep_calls

    def for_tools(self, active: bool) -> GptOssReasoningParser:
        return self if active == self.keep_calls else GptOssReasoningParser(keep_calls=active)

    def tags(self) -> tuple[str, ...]:
        return (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)

    def extract(self, text: str) -> ReasoningSplit:
        delta = self.streamer().feed(text, final=True)
        return ReasoningSplit(reasoning=delta.reasoning or None, content=delta.content or None)

    def _opening(self, text: str) -> HarmonyMessage | None:
        """The analysis message ``text`` opens with, if it does."""
        messages = parse(text)
        return messages[0] if messages and messages[0].is_reasoning else None

    def reasoning_end(self, text: str) -> int | None:
        first = self._opening(text)
        return first.end if first is not None and first.closed else None

    def in_reasoning(self, text: str) -> bool:
        first = self._opening(text)
        return first is not None and not first.closed

    def streamer(self) -> GptOssReasoningStreamer:
        return GptOssReasoningStreamer(self.keep_calls)

    def constrain(self, constraint: StructuredOutputsParams) -> StructuredOutputsParams:
        if constraint.grammar is not None and str(constraint.grammar).startswith(WHOLE_OUTPUT_GRAMMAR):
            return constraint
        grammar = (
            'start: (analysis <|end|> <|start|> "assistant")* <|channel|> "final" <|message|> answer\n'
            f"{ANALYSIS_RULES}"
            f"answer: {as_lark_expression(constraint)}\n"
        )
        return StructuredOutputsParams(grammar=grammar)


class GptOssReasoningStreamer(ReasoningStreamer):
    """The split as the messages come: each message's kind is known once its header is, and
    its text goes to the reasoning or the content as it grows (a newline before each further
    text of the same part, once that text has begun)."""

    def __init__(self, keep_calls: bool) -> None:
        self._messages = HarmonyStreamParser()
        self._keep_calls = keep_calls
        self._kinds: list[str] = []          # per message: "reasoning", "content" or "call"
        self._begun = {"reasoning": False, "content": False}   # a text of that part has been sent
        self._pending: dict[int, bool] = {}  # messages whose text has not begun yet

    def feed(self, delta_text: str, final: bool = False) -> ReasoningDelta:
        parts = {"reasoning": "", "content": ""}
        for d in self._messages.feed(delta_text, final):
            self._take(d, parts)
        return ReasoningDelta(reasoning=parts["reasoning"], content=parts["content"])

    def _take(self, d: MessageDelta, parts: dict[str, str]) -> None:
        if d.opened is not None:
            kind = "call" if d.opened.is_call else "reasoning" if d.opened.is_reasoning else "content"
            self._kinds.append(kind)
            self._pending[d.index] = True
            if kind == "call" and self._keep_calls:
                parts["content"] += f"{START}assistant{message_header(d.opened)}{MESSAGE}"
        kind = self._kinds[d.index]
        if kind == "call":
            if self._keep_calls:
                parts["content"] += d.text + (END if d.closed else "")
            return
        if d.text and self._pending.pop(d.index, False):
            if self._begun[kind]:
                parts[kind] += "\n"
            self._begun[kind] = True
        parts[kind] += d.text
