"""Qwen3-Coder's (and Qwen3.5's) tool calls: XML around raw argument values.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is the text between its tags (the newline after the opening tag and before the
closing one dropped), typed by the tool's schema where the request's tools say (``for_tools``):
a string stays text, numbers, booleans, null, objects and arrays are read as JSON; a
parameter the schema does not know is read as JSON when it parses, else kept as text. The
arguments are the JSON object of the values, written as ``json.dumps`` writes it, and stream
one whole parameter at a time (``{"city": "Paris"`` then ``, "days": 3`` then ``}``), so the
fragments add up to the same string. A forced call's grammar (``tool_choice`` required or
named) writes string values without ``<`` (the text before ``</parameter>``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagoda.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    RereadingStreamer,
    StreamDelta,
    ToolCallDelta,
    ToolParser,
    call_function,
)
from pagoda.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagoda.entrypoints.openai.tool_parsers.json_calls import partial_suffix
from pagoda.entrypoints.openai.tool_parsers.partial_json import WS
from pagoda.sampling_params import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?")
_PARAMETER_END = "</parameter>"
_FUNCTION_END = "</function>"


class _Call:
    def __init__(self) -> None:
        self.name: str | None = None
        self.params: list[tuple[str, str]] = []   # complete parameters: (key, raw value)
        self.done = False                          # </function> seen


def _scan(body: str) -> tuple[list[_Call], bool]:
    """The calls of the text after the first ``<tool_call>`` as far as they go, and whether
    it is complete and valid (every block closed, or the last one ending at the text's end
    after its ``</function>``)."""
    calls: list[_Call] = []
    i = 0
    while True:
        m = _FUNCTION.match(body, i)
        if m is None:
            return calls, False
        call = _Call()
        call.name = m.group(1).strip()
        calls.append(call)
        i = m.end()
        while True:
            p = _PARAMETER.match(body, i)
            if p is None:
                break
            end = body.find(_PARAMETER_END, p.end())
            if end < 0:
                return calls, False
            value = body[p.end():end]
            call.params.append((p.group(1).strip(), value[:-1] if value.endswith("\n") else value))
            i = end + len(_PARAMETER_END)
        j = i + len(body[i:]) - len(body[i:].lstrip(WS))
        if not body.startswith(_FUNCTION_END, j):
            return calls, False
        call.done = True
        i = j + len(_FUNCTION_END)
        rest = body[i:].lstrip(WS)
        if not rest:
            return calls, True   # (stopped at EOS before </tool_call>)
        if not rest.startswith(CLOSE):
            return calls, False
        i = len(body) - len(rest) + len(CLOSE)
        rest = body[i:].lstrip(WS)
        if not rest:
            return calls, True
        if not rest.startswith(OPEN):
            return calls, False
        i = len(body) - len(rest) + len(OPEN)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, schemas: dict[str, dict[str, Any]] | None = None) -> None:
        self.schemas = schemas or {}   # function -> its parameters' properties

    def for_tools(self, tools: list[dict[str, Any]] | None) -> Qwen3CoderToolParser:
        schemas = {}
        for tool in tools or ():
            function = tool.get("function") or {}
            schemas[function.get("name")] = (function.get("parameters") or {}).get("properties") or {}
        return Qwen3CoderToolParser(schemas)

    def value(self, function: str | None, key: str, raw: str) -> Any:
        kind = (self.schemas.get(function) or {}).get(key, {}).get("type")
        if kind == "string" or (isinstance(kind, list) and "string" in kind and not _json_literal(raw)):
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            return raw

    def arguments(self, call: _Call, upto: int | None = None) -> str:
        pairs = call.params if upto is None else call.params[:upto]
        return json.dumps({k: self.value(call.name, k, v) for k, v in pairs}, ensure_ascii=False)

    def extract(self, text: str, truncated: bool = False) -> ExtractedToolCalls:
        at = text.find(OPEN)
        if at < 0:
            return ExtractedToolCalls(content=text or None)
        calls, complete = _scan(text[at + len(OPEN):])
        if truncated and not complete:
            calls, complete = [c for c in calls if c.done], True
            if not calls:
                return ExtractedToolCalls(content=text)
        if not complete or not calls:
            return ExtractedToolCalls(content=text)
        content = text[:at].strip(WS)
        return ExtractedToolCalls(content=content or None,
                                  calls=[ParsedToolCall(c.name or "", self.arguments(c)) for c in calls])

    def extract_cut(self, text: str) -> ExtractedToolCalls:
        at = text.find(OPEN)
        calls = [] if at < 0 else _scan(text[at + len(OPEN):])[0]
        return ExtractedToolCalls(content=None, calls=[ParsedToolCall(c.name, self.arguments(c))
                                                       for c in calls if c.name])

    def streamer(self) -> Qwen3CoderStreamer:
        return Qwen3CoderStreamer(self)

    def constraint(self, call_schema: dict[str, Any], multiple: bool) -> StructuredOutputsParams:
        alternatives = call_schema["anyOf"] if "anyOf" in call_schema else [call_schema]
        rules, names = [], []
        for k, alt in enumerate(alternatives):
            name = alt["properties"]["name"]["const"]
            params = alt["properties"]["arguments"].get("properties") or {}
            required = set(alt["properties"]["arguments"].get("required") or ())
            parts = []
            for j, (key, schema) in enumerate(params.items()):
                if schema.get("type") == "string":   # text up to the closing tag, one terminal with it
                    part = f'"<parameter={key}>\\n" text_value "\\n"'
                else:
                    rules.append(f"json_{k}_{j}: %json {json.dumps(schema)}\n")
                    part = f'"<parameter={key}>\\n" json_{k}_{j} "\\n</parameter>\\n"'
                parts.append(part if key in required else f"({part})?")
            body = " ".join(parts) if parts else '""'
            rules.append(f'call_{k}: "<tool_call>\\n<function={name}>\\n" {body} "</function>\\n</tool_call>"\n')
            names.append(f"call_{k}")
        calls = 'call ("\\n" call)*' if multiple else "call"
        grammar = (f"start: {calls}\ncall: {' | '.join(names)}\n" + "".join(rules)
                   + 'text_value: /[^<]*\\n<\\/parameter>/\n')
        return StructuredOutputsParams(grammar=grammar)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou have access to the following functions:\n\n<tools>\n" + listing + "\n</tools>\n\n"
                "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
                "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
                "</parameter>\n</function>\n</tool_call>")

    def render_calls(self, content: str | None, tool_calls: list[dict[str, Any]]) -> str:
        parts = [content] if content else []
        for call in tool_calls:
            name, arguments = call_function(call)
            items = arguments.items() if isinstance(arguments, dict) else ()
            params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
                             "</parameter>\n" for k, v in items)
            parts.append(f"{OPEN}\n<function={name}>\n{params}</function>\n{CLOSE}")
        return "\n".join(parts)

    render_results = HermesToolParser.render_results   # (the same <tool_response> blocks)


def _json_literal(raw: str) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


class Qwen3CoderStreamer(RereadingStreamer):
    def __init__(self, parser: Qwen3CoderToolParser) -> None:
        super().__init__()
        self.parser = parser
        self._sent: list[tuple[int, bool]] = []   # per call: parameters sent, closed

    @property
    def num_calls(self) -> int:
        return len(self._sent)

    def feed(self, delta_text: str, final: bool = False) -> StreamDelta:
        self._text += delta_text
        at = self._text.find(OPEN)
        if at < 0:
            stable = self._text if final else self._text[:len(self._text) - partial_suffix(self._text, OPEN)]
            return StreamDelta(content=self._content(stable))
        out = StreamDelta(content=self._content(self._text[:at].rstrip(WS)))
        calls, _ = _scan(self._text[at + len(OPEN):])
        for index, call in enumerate(calls):
            if call.name is None:
                break
            if index == len(self._sent):
                self._sent.append((0, False))
                out.calls.append(ToolCallDelta(index=index, name=call.name))
            sent, closed = self._sent[index]
            if closed:
                continue
            pieces = []
            for k in range(sent, len(call.params)):
                key, raw = call.params[k]
                pair = json.dumps({key: self.parser.value(call.name, key, raw)}, ensure_ascii=False)[1:-1]
                pieces.append(("{" if k == 0 else ", ") + pair)
            if call.done:
                pieces.append("}" if call.params else "{}")
            if pieces:
                text = "".join(pieces)
                if out.calls and out.calls[-1].index == index:
                    out.calls[-1].arguments += text
                else:
                    out.calls.append(ToolCallDelta(index=index, arguments=text))
            self._sent[index] = (len(call.params), call.done)
        return out
