"""Tool-call formats whose calls are JSON after a marker, with no closing tag:

- ``mistral`` (Mistral's tokenizers up to v7: Mistral 7B v0.3, Nemo, Small 3.x, Large 2):
  ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, text before the marker the content;
- ``granite`` (Granite 3.x): ``<|tool_call|>[{...}, ...]``;
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3's JSON tool calling): ``{"name": ..., "parameters":
  {...}}``, the whole output, optionally after ``<|python_tag|>``, several calls separated by
  ``;``.

Everything after the marker must be calls (an output whose calls do not parse is returned as
content, with no calls, as with Hermes). Streaming re-reads the text at each step: content
until the marker (a partial marker at the end held back), then each call's name once complete
and its arguments as they grow, as the model wrote them.
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
    ToolCallDelta,
    ToolParser,
    call_function,
)
from pagoda.entrypoints.openai.tool_parsers.partial_json import WS, InvalidJSON, PartialCall, scan_calls, scan_object
from pagoda.sampling_params import StructuredOutputsParams


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def scan_body(body: str, separator: str, final: bool) -> tuple[list[PartialCall], bool]:
    """The calls after the marker: an array of call objects, or call objects one after
    another (``separator`` between them, when the format has one); and whether the body is
    complete and valid."""
    i, n = len(body) - len(body.lstrip(WS)), len(body)
    if i < n and body[i] == "[":
        return scan_calls(body, final)
    calls: list[PartialCall] = []
    try:
        while True:
            while i < n and body[i] in WS:
                i += 1
            if i >= n or body[i] != "{":
                return calls, False
            call, end = scan_object(body, i, final)
            calls.append(call)
            if end is None:
                return calls, False
            i = end
            while i < n and body[i] in WS:
                i += 1
            if i == n:
                return calls, True
            if not separator or body[i] != separator:
                return calls, False
            i += 1
    except InvalidJSON:
        return calls, False


def call_deltas(calls: list[PartialCall], names_sent: list[str], args_sent: list[int]) -> list[ToolCallDelta]:
    """What is new in ``calls`` since the last step: each call's name once (in order), then
    its arguments text as it grows (``names_sent`` / ``args_sent``: updated in place)."""
    out: list[ToolCallDelta] = []
    for index, call in enumerate(calls):
        if index == len(names_sent):
            if call.name is None:
                break   # calls go out in order: wait for this one's name
            names_sent.append(call.name)
            args_sent.append(0)
            out.append(ToolCallDelta(index=index, name=call.name))
        arguments = call.arguments if call.arguments_done or not call.done else "{}"
        new = arguments[args_sent[index]:]
        if not new:
            continue
        args_sent[index] = len(arguments)
        if out and out[-1].index == index:
            out[-1].arguments += new
        else:
            out.append(ToolCallDelta(index=index, arguments=new))
    return out


class JsonCallsParser(ToolParser):
    marker: ClassVar[str]
    bare: ClassVar[bool] = False        # calls may also open the output without the marker ("{")
    separator: ClassVar[str] = ""       # between call objects written one after another
    arguments_key: ClassVar[str] = "arguments"

    def split(self, text: str) -> tuple[str, str] | None:
        """(the content before the calls, the calls' text), or None: no calls."""
        at = text.find(self.marker)
        if at >= 0:
            return text[:at], text[at + len(self.marker):]
        if self.bare and text.lstrip(WS).startswith("{"):
            return "", text
        return None

    def extract(self, text: str, truncated: bool = False) -> ExtractedToolCalls:
        parts = self.split(text)
        if parts is None:
            return ExtractedToolCalls(content=text or None)
        before, body = parts
        calls, complete = scan_body(body, self.separator, final=True)
        if truncated and not complete:
            done = [c for c in calls if c.done and c.name is not None]
            if not done:
                return ExtractedToolCalls(content=text)
            calls, complete = done, True
        if not complete or any(c.name is None or not c.done for c in calls):
            return ExtractedToolCalls(content=text)
        content = before.strip(WS)
        return ExtractedToolCalls(content=content or None,
                                  calls=[ParsedToolCall(c.name, c.final_arguments()) for c in calls])  # type: ignore[arg-type]

    def extract_cut(self, text: str) -> ExtractedToolCalls:
        parts = self.split(text)
        if parts is None:
            return ExtractedToolCalls(content=None)
        calls, _ = scan_body(parts[1], self.separator, final=False)
        return ExtractedToolCalls(content=None, calls=[
            ParsedToolCall(c.name, c.final_arguments() if c.done else c.arguments) for c in calls if c.name is not None])

    def streamer(self) -> JsonCallsStreamer:
        return JsonCallsStreamer(self)

    def constraint(self, call_schema: dict[str, Any], multiple: bool) -> StructuredOutputsParams:
        schema = {**_renamed_arguments(call_schema, self.arguments_key), "x-guidance": JSON_LAYOUT}
        grammar = self.grammar(multiple) + f"call_json: %json {json.dumps(schema)}\n"
        return StructuredOutputsParams(grammar=grammar)

    def grammar(self, multiple: bool) -> str:
        """The Lark rules of one call (``multiple``: one or more) around ``call_json``."""
        raise NotImplementedError

    def call_json(self, call: dict[str, Any]) -> str:
        name, arguments = call_function(call)
        return json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)


def _renamed_arguments(schema: dict[str, Any], key: str) -> dict[str, Any]:
    """A call schema (``{"name", "arguments"}``, or an anyOf of them) with the arguments under
    ``key`` (Llama 3 writes "parameters"), its rebased references moved with them."""
    if key == "arguments":
        return schema
    text = json.dumps(schema)
    text = re.sub(r'"(#(?:/anyOf/\d+)?/properties/)arguments', rf'"\1{key}', text)
    out = json.loads(text)

    def rename(call: dict[str, Any]) -> dict[str, Any]:
        props = dict(call["properties"])
        props[key] = props.pop("arguments")
        return {**call, "properties": props, "required": ["name", key]}

    return {"anyOf": [rename(c) for c in out["anyOf"]]} if "anyOf" in out else rename(out)


class JsonCallsStreamer(RereadingStreamer):
    def __init__(self, parser: JsonCallsParser) -> None:
        super().__init__()
        self.parser = parser

    def feed(self, delta_text: str, final: bool = False) -> StreamDelta:
        self._text += delta_text
        parts = self.parser.split(self._text)
        if parts is None:
            stable = self._text
            if not final:
                stable = stable[:len(stable) - partial_suffix(stable, self.parser.marker)]
                if self.parser.bare and not stable.strip(WS):
                    stable = ""   # only whitespace yet: the calls may still open the output
            return StreamDelta(content=self._content(stable))
        before, body = parts
        out = StreamDelta(content=self._content(before.rstrip(WS)))
        calls, _ = scan_body(body, self.parser.separator, final)
        out.calls = call_deltas(calls, self._names_sent, self._args_sent)
        return out


class ArrayCallsParser(JsonCallsParser):
    """The calls as one JSON array after the marker (Mistral's, Granite's)."""

    def grammar(self, multiple: bool) -> str:
        more = ' (", " call_json)*' if multiple else ""
        return f'start: "{self.marker}[" call_json{more} "]"\n'

    def render_calls(self, content: str | None, tool_calls: list[dict[str, Any]]) -> str:
        return (content or "") + self.marker + "[" + ", ".join(self.call_json(c) for c in tool_calls) + "]"


class MistralToolParser(ArrayCallsParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return f"[AVAILABLE_TOOLS]{json.dumps(tools, ensure_ascii=False)}[/AVAILABLE_TOOLS]"

    def render_results(self, results: list[str]) -> str:
        return "".join(f'[TOOL_RESULTS]{{"content": {json.dumps(r, ensure_ascii=False)}}}[/TOOL_RESULTS]'
                       for r in results)


class Llama3JsonToolParser(JsonCallsParser):
    name = "llama3_json"
    marker = "<|python_tag|>"
    bare = True
    separator = ";"
    arguments_key = "parameters"

    def grammar(self, multiple: bool) -> str:
        more = ' ("; " call_json)*' if multiple else ""
        return f"start: call_json{more}\n"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n\n".join(json.dumps(t, ensure_ascii=False, indent=4) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
                "value}. Do not use variables.\n\n" + listing)

    def render_calls(self, content: str | None, tool_calls: list[dict[str, Any]]) -> str:
        calls = "; ".join(self.call_json(c) for c in tool_calls)
        return f"{content}\n{calls}" if content else calls

    def render_results(self, results: list[str]) -> str:
        return "\n".join(results)


class GraniteToolParser(ArrayCallsParser):
    """Granite 3.x: ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``."""

    name = "granite"
    marker = "<|tool_call|>"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You are a helpful assistant with access to the following function calls. Your task is to produce "
                "a list of function calls necessary to generate response to the user utterance. Use the following "
                f"function calls as required.\n{listing}")

    def render_results(self, results: list[str]) -> str:
        return "\n".join(results)
