"""The interface every tool-call format implements, and what parsing gives back.

A format (Hermes/Qwen's ``<tool_call>{...}</tool_call>``, ...) covers both directions:
reading calls out of generated text, in one go or while it streams, and writing
tools, earlier calls and their results into a prompt when the chat template cannot.
It also says how to constrain generation so that only valid calls can come out
(``tool_choice`` "required" or a named function).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagoda.sampling_params import StructuredOutputsParams


# How the formats' forcing grammars lay out constrained JSON: one line, with the separators
# json.dumps writes (so a forced call reads as the same text an unforced one would).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments


@dataclass
class ExtractedToolCalls:
    content: str | None
    calls: list[ParsedToolCall] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    """One piece of a streamed call: the name comes once, first; then argument fragments."""

    index: int
    name: str | None = None  # set on the first delta of a call
    arguments: str = ""


@dataclass
class StreamDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallStreamer(ABC):
    """Follows one choice's text as it grows and says what is new in each step."""

    @abstractmethod
    def feed(self, delta_text: str, final: bool = False) -> StreamDelta:
        """Take the next piece of generated text (``final``: it is the last one)."""

    @property
    @abstractmethod
    def num_calls(self) -> int:
        """How many calls have been started (had their name sent) so far."""


def call_function(call: dict[str, Any]) -> tuple[Any, Any]:
    """An OpenAI tool call's (function name, arguments): the arguments as the value their JSON
    string holds, or the string itself where it holds none."""
    function = call.get("function") or {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass   # written as the string it is
    return function.get("name"), arguments


class RereadingStreamer(ToolCallStreamer):
    """A streamer that re-reads the whole text at each step (outputs are short) and sends
    what is new: the text so far, the content sent, each call's name and arguments sent."""

    def __init__(self) -> None:
        self._text = ""
        self._content_sent = 0  # characters of the stable content already sent
        self._names_sent: list[str] = []
        self._args_sent: list[int] = []

    @property
    def num_calls(self) -> int:
        return len(self._names_sent)

    def _content(self, stable: str) -> str:
        """What of ``stable`` (the content known not to change) has not been sent yet."""
        new = stable[self._content_sent:]
        self._content_sent = max(self._content_sent, len(stable))
        return new


class ToolParser(ABC):
    name: ClassVar[str]

    @abstractmethod
    def extract(self, text: str, truncated: bool = False) -> ExtractedToolCalls:
        """The calls in an output, and the text around them (None if there is none).
        ``truncated``: the output was cut short; a call left incomplete at its end is dropped
        (rather than the whole output being taken as text)."""

    @abstractmethod
    def extract_cut(self, text: str) -> ExtractedToolCalls:
        """The calls in the output of a forced call that max_tokens cut short: every call whose
        name was written, the last one with its arguments as far as they got (unfinished JSON
        text, as vLLM returns them); no content (the grammar allowed none)."""

    @abstractmethod
    def streamer(self) -> ToolCallStreamer: ...

    def for_tools(self, tools: list[dict[str, Any]] | None) -> ToolParser:
        """The parser for one request offering ``tools`` (OpenAI tool objects): a format that
        types the values it reads by the tools' schemas (Qwen3-Coder's) binds them; the others
        are the same parser."""
        return self

    @abstractmethod
    def constraint(self, call_schema: dict[str, Any], multiple: bool) -> StructuredOutputsParams:
        """A grammar admitting one call (``multiple``: one or more) whose JSON
        ``{"name", "arguments"}`` matches ``call_schema``, written in this format."""

    @abstractmethod
    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """Instructions describing ``tools`` (OpenAI tool objects) and how to call them."""

    @abstractmethod
    def render_calls(self, content: str | None, tool_calls: list[dict[str, Any]]) -> str:
        """An assistant turn that made ``tool_calls`` (OpenAI's shape), as text."""

    @abstractmethod
    def render_results(self, results: list[str]) -> str:
        """The results of one or more calls, as the text of one user turn."""
