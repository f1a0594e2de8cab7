"""Tool-call formats that write each call's name apart from its JSON arguments, between
special tokens:

- ``deepseek_v3`` (DeepSeek-V3, R1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``
  then the arguments in a fenced ``json`` block, ``<｜tool▁call▁end｜>`` ... ``<｜tool▁calls▁end｜>``;
- ``deepseek_v31`` (DeepSeek-V3.1, V3.2): ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``
  in the same section;
- ``kimi_k2`` (Kimi K2): ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0``
  ``<|tool_call_argument_begin|>{...}<|tool_call_end|>`` ... ``<|tool_calls_section_end|>``.

Text before the section is the content. The arguments end where their JSON value ends (a
marker inside a string argument does not end them). An output whose section does not parse
is returned as content, with no calls. Streaming re-reads the text at each step: content
until the section (a partial marker held back), then each call's name once its header is
complete, and its arguments as they grow, as the model wrote them.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from pagoda.entrypoints.openai.tool_parsers.base import (
    JSON_LAYOUT,
    ExtractedToolCalls,
    ParsedToolCall,
    RereadingStreamer,
    StreamDelta,
    ToolParser,
    call_function,
)
from pagoda.entrypoints.openai.tool_parsers.json_calls import call_deltas, partial_suffix
from pagoda.entrypoints.openai.tool_parsers.partial_json import WS, InvalidJSON, PartialCall, value_end
from pagoda.sampling_params import StructuredOutputsParams


class DelimitedCallsParser(ToolParser):
    section_begin: ClassVar[str]
    section_end: ClassVar[str]
    call_begin: ClassVar[str]
    call_end: ClassVar[str]
    head_end: ClassVar[str]            # between a call's header (its name) and its arguments
    args_close: ClassVar[str] = ""     # after the arguments' JSON, before call_end

    def name_of(self, header: str) -> str | None:
        """The function name a call's header holds (None: not a header of this format)."""
        raise NotImplementedError

    def header(self, name: str, index: int) -> str:
        raise NotImplementedError

    def scan(self, text: str, final: bool) -> tuple[str, list[PartialCall], bool] | None:
        """(the content before the section, its calls as far as they go, whether the section
        is complete and valid), or None: the text has no section."""
        start = text.find(self.section_begin)
        if start < 0:
            return None
        calls: list[PartialCall] = []
        i, n = start + len(self.section_begin), len(text)
        try:
            while True:
                i = _skip(text, i)
                if text.startswith(self.section_end, i):
                    return text[:start], calls, bool(calls) and not text[i + len(self.section_end):].strip(WS)
                if i >= n:   # (stopped at EOS before the section's end: complete if its calls are)
                    return text[:start], calls, final and bool(calls) and all(c.done for c in calls)
                if not text.startswith(self.call_begin, i):
                    return text[:start], calls, False
                call, i = self._call(text, i + len(self.call_begin), final)
                calls.append(call)
                if i is None:
                    return text[:start], calls, False
        except InvalidJSON:
            return text[:start], calls, False

    def _call(self, text: str, i: int, final: bool) -> tuple[PartialCall, int | None]:
        call = PartialCall()
        head = text.find(self.head_end, i)
        if head < 0:
            return call, None
        call.name = self.name_of(text[i:head])
        if call.name is None:
            raise InvalidJSON(f"not a call header: {text[i:head]!r}")
        j = _skip(text, head + len(self.head_end))
        if j >= len(text):
            return call, None
        end = value_end(text, j, final)
        if end is None:
            if text[j] in "{[":
                call.arguments = text[j:]
            return call, None
        call.arguments, call.arguments_done = text[j:end], True
        k = end
        for tag in (self.args_close.strip(WS), self.call_end):   # (whitespace around them free)
            if not tag:
                continue
            k = _skip(text, k)
            if not text.startswith(tag, k):
                if tag.startswith(text[k:]) and not final:
                    return call, None   # (the tag is still coming)
                raise InvalidJSON(f"expected {tag!r} after a call's arguments")
            k += len(tag)
        call.done = True
        return call, k

    def extract(self, text: str, truncated: bool = False) -> ExtractedToolCalls:
        scanned = self.scan(text, final=True)
        if scanned is None:
            return ExtractedToolCalls(content=text or None)
        before, calls, complete = scanned
        if truncated and not complete:
            calls, complete = [c for c in calls if c.done], True
            if not calls:
                return ExtractedToolCalls(content=text)
        if not complete or any(not c.done for c in calls):
            return ExtractedToolCalls(content=text)
        content = before.strip(WS)
        return ExtractedToolCalls(content=content or None,
                                  calls=[ParsedToolCall(c.name, c.final_arguments()) for c in calls])  # type: ignore[arg-type]

    def extract_cut(self, text: str) -> ExtractedToolCalls:
        scanned = self.scan(text, final=False)
        calls = [] if scanned is None else scanned[1]
        return ExtractedToolCalls(content=None, calls=[
            ParsedToolCall(c.name, c.final_arguments() if c.done else c.arguments) for c in calls if c.name])

    def streamer(self) -> DelimitedStreamer:
        return DelimitedStreamer(self)

    def constraint(self, call_schema: dict[str, Any], multiple: bool) -> StructuredOutputsParams:
        alternatives = call_schema["anyOf"] if "anyOf" in call_schema else [call_schema]
        rules = []
        for k, alt in enumerate(alternatives):
            name = alt["properties"]["name"]["const"]
            # The arguments' schema on its own: references into it re-rooted.
            args = json.loads(re.sub(r'"#(?:/anyOf/\d+)?/properties/arguments', '"#',
                                     json.dumps(alt["properties"]["arguments"])))
            head = json.dumps(self.call_begin + self.header(name, 0) + self.head_end)
            tail = json.dumps(self.args_close + self.call_end)
            rules.append(f"call_{k}: {head} args_{k} {tail}\n"
                         f"args_{k}: %json {json.dumps({**args, 'x-guidance': JSON_LAYOUT})}\n")
        calls = "call call*" if multiple else "call"
        grammar = (f"start: {json.dumps(self.section_begin)} {calls} {json.dumps(self.section_end)}\n"
                   f"call: {' | '.join(f'call_{k}' for k in range(len(alternatives)))}\n" + "".join(rules))
        return StructuredOutputsParams(grammar=grammar)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        example = self.render_calls(None, [{"function": {"name": "<function-name>", "arguments": "{}"}}])
        return ("# Tools\n\nYou may call one or more functions to assist with the user query. "
                f"The functions:\n{listing}\n\nCall them as:\n{example}")

    def render_calls(self, content: str | None, tool_calls: list[dict[str, Any]]) -> str:
        parts = []
        for index, call in enumerate(tool_calls):
            name, arguments = call_function(call)
            parts.append(self.call_begin + self.header(name or "", index) + self.head_end
                         + json.dumps(arguments, ensure_ascii=False) + self.args_close + self.call_end)
        return (content or "") + self.section_begin + "".join(parts) + self.section_end

    def render_results(self, results: list[str]) -> str:
        return "\n".join(results)


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i


class DelimitedStreamer(RereadingStreamer):
    def __init__(self, parser: DelimitedCallsParser) -> None:
        super().__init__()
        self.parser = parser

    def feed(self, delta_text: str, final: bool = False) -> StreamDelta:
        self._text += delta_text
        scanned = self.parser.scan(self._text, final)
        if scanned is None:
            stable = self._text
            if not final:
                stable = stable[:len(stable) - partial_suffix(stable, self.parser.section_begin)]
            return StreamDelta(content=self._content(stable))
        before, calls, _ = scanned
        out = StreamDelta(content=self._content(before.rstrip(WS)))
        out.calls = call_deltas(calls, self._names_sent, self._args_sent)
        return out


class DeepSeekV3ToolParser(DelimitedCallsParser):
    name = "deepseek_v3"
    section_begin, section_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, call_end = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    head_end, args_close = "\n```json\n", "\n```"
    SEP = "<｜tool▁sep｜>"

    def name_of(self, header: str) -> str | None:
        kind, sep, name = header.partition(self.SEP)
        return name.strip(WS) or None if sep and kind.strip(WS) == "function" else None

    def header(self, name: str, index: int) -> str:
        return f"function{self.SEP}{name}"


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    name = "deepseek_v31"
    head_end, args_close = DeepSeekV3ToolParser.SEP, ""

    def name_of(self, header: str) -> str | None:
        return header.strip(WS) or None

    def header(self, name: str, index: int) -> str:
        return name


class KimiK2ToolParser(DelimitedCallsParser):
    name = "kimi_k2"
    section_begin, section_end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    call_begin, call_end = "<|tool_call_begin|>", "<|tool_call_end|>"
    head_end = "<|tool_call_argument_begin|>"
    _HEADER = re.compile(r"\s*(?:functions\.)?(.+?)(?::\d+)?\s*")

    def name_of(self, header: str) -> str | None:
        m = self._HEADER.fullmatch(header)
        return m.group(1) if m else None

    def header(self, name: str, index: int) -> str:
        return f"functions.{name}:{index}"
