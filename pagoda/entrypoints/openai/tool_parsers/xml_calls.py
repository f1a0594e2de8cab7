"""Tool-call formats that write each argument as an XML element around its raw value:

- ``glm45`` (GLM-4.5, GLM-4.6): one block a call, the name on the first line, then a
  key / value pair per argument::

      <tool_call>get_weather
      <arg_key>city</arg_key>
      <arg_value>Paris</arg_value>
      <arg_key>days</arg_key>
      <arg_value>3</arg_value>
      </tool_call>

- ``glm47`` (GLM-4.7): the same elements with no newlines between them,
  ``<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>``,
  one block straight after the other. Both GLM parsers read both layouts (whitespace between
  the tags is free); they differ in what they write (``render_calls``, the forcing grammar).
- ``minimax_m2`` (MiniMax-M2): one block holding one or more calls::

      <minimax:tool_call>
      <invoke name="get_weather">
      <parameter name="city">Paris</parameter>
      <parameter name="days">3</parameter>
      </invoke>
      </minimax:tool_call>

  (a newline just inside ``<parameter>``'s tags is dropped; an output that stops right after
  its last ``</invoke>`` is complete).

A value is typed by the tool's schema where the request's tools say (``for_tools``), as
Qwen3-Coder's: a string parameter's value is the text as written (``"1234"`` stays a string),
other types' values are read as JSON; a parameter the schema does not know is read as JSON
when it parses, else kept as text. The text before the first block is the content; nothing but
whitespace and further blocks may follow it, or the whole output is returned as content, with
no calls. The arguments are the JSON object of the pairs, each written as ``json.dumps``
writes it, in the order the model wrote them, and stream one whole parameter at a time
(``{"city": "Paris"`` then ``, "days": 3`` then ``}`` once the call closes), so the fragments
add up to exactly the non-streamed string. A forced call's grammar (``tool_choice`` required or
named) writes string values without ``<`` (the text up to the closing tag).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
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
from pagoda.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagoda.entrypoints.openai.tool_parsers.json_calls import call_deltas, partial_suffix
from pagoda.entrypoints.openai.tool_parsers.partial_json import WS, PartialCall
from pagoda.sampling_params import StructuredOutputsParams


@dataclass
class XmlCall:
    name: str
    params: list[tuple[str, str]] = field(default_factory=list)   # complete parameters: (key, raw value)
    done: bool = False                                           # the call's closing tag seen


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i


def _types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema admits (its ``type``, one or a list, and its
    ``anyOf`` / ``oneOf`` members'); empty when it does not say."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    types = {t for t in (kind if isinstance(kind, list) else [kind]) if isinstance(t, str)}
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or ():
            types |= _types(member)
    return types


def _json_value(raw: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(raw)
    except ValueError:
        return False, None


class XmlCallsParser(ToolParser):
    """What the XML formats share: typing values by the tools' schemas, extraction, streaming,
    the forcing grammar's parameter rules. A format says where its calls begin (``opener``)
    and how to read them (``scan``)."""

    opener: ClassVar[str]   # the tag the first call (block) begins with

    def __init__(self, schemas: dict[str, dict[str, Any]] | None = None) -> None:
        self.schemas = schemas or {}   # function -> its parameters' properties

    def scan(self, body: str) -> tuple[list[XmlCall], bool]:
        """The calls of the text after the first ``opener`` as far as they go (a call once its
        name is complete, its parameters once each is), and whether the text is complete and
        valid."""
        raise NotImplementedError

    def for_tools(self, tools: list[dict[str, Any]] | None) -> XmlCallsParser:
        schemas = {}
        for tool in tools or ():
            function = tool.get("function") or {}
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            schemas[function.get("name")] = properties if isinstance(properties, dict) else {}
        return type(self)(schemas)

    def value(self, function: str, key: str, raw: str) -> Any:
        types = _types((self.schemas.get(function) or {}).get(key))
        if "string" in types:
            if types == {"string"}:
                return raw
            ok, value = _json_value(raw)   # e.g. ["string", "null"]: null is null, the rest text
            return value if ok and not isinstance(value, str) else raw
        ok, value = _json_value(raw)
        return value if ok else raw

    def arguments(self, call: XmlCall, closed: bool) -> str:
        """The arguments text of ``call``'s complete parameters (``closed``: with its ``}``):
        what the stream has sent by then."""
        pairs = [json.dumps({k: self.value(call.name, k, v)}, ensure_ascii=False)[1:-1] for k, v in call.params]
        if not closed:
            return "{" + ", ".join(pairs) if pairs else ""
        return "{" + ", ".join(pairs) + "}"

    def split(self, text: str) -> tuple[str, list[XmlCall], bool] | None:
        """(the text before the calls, the calls, complete and valid), or None: no calls."""
        at = text.find(self.opener)
        if at < 0:
            return None
        calls, complete = self.scan(text[at + len(self.opener):])
        return text[:at], calls, complete

    def extract(self, text: str, truncated: bool = False) -> ExtractedToolCalls:
        found = self.split(text)
        if found is None:
            return ExtractedToolCalls(content=text or None)
        before, calls, complete = found
        if truncated and not complete:
            calls, complete = [c for c in calls if c.done], True
        if not complete or not calls:
            return ExtractedToolCalls(content=text)
        content = before.strip(WS)
        return ExtractedToolCalls(content=content or None,
                                  calls=[ParsedToolCall(c.name, self.arguments(c, closed=True)) for c in calls])

    def extract_cut(self, text: str) -> ExtractedToolCalls:
        found = self.split(text)
        calls = [] if found is None else found[1]
        return ExtractedToolCalls(content=None, calls=[ParsedToolCall(c.name, self.arguments(c, closed=c.done))
                                                       for c in calls])

    def streamer(self) -> XmlCallsStreamer:
        return XmlCallsStreamer(self)

    def constraint(self, call_schema: dict[str, Any], multiple: bool) -> StructuredOutputsParams:
        alternatives = call_schema["anyOf"] if "anyOf" in call_schema else [call_schema]
        rules, names = [], []
        for k, alt in enumerate(alternatives):
            name = alt["properties"]["name"]["const"]
            parts = []
            for j, (key, schema, required) in enumerate(_parameters(alt)):
                if _types(schema) == {"string"}:   # (as ``value`` reads it) text up to the closing tag, one terminal
                    part = self.text_parameter(key)
                else:
                    rules.append(f"json_{k}_{j}: %json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}\n")
                    part = self.json_parameter(key, f"json_{k}_{j}")
                parts.append(part if required else f"({part})?")
            rules.append(f"call_{k}: {self.call_rule(name, ' '.join(parts) if parts else '')}\n")
            names.append(f"call_{k}")
        grammar = f"start: {self.calls_rule(multiple)}\ncall: {' | '.join(names)}\n" + "".join(rules) + self.terminals
        return StructuredOutputsParams(grammar=grammar)

    # The pieces of the forcing grammar each format writes (Lark).
    terminals: ClassVar[str]

    def text_parameter(self, key: str) -> str:
        raise NotImplementedError

    def json_parameter(self, key: str, rule: str) -> str:
        raise NotImplementedError

    def call_rule(self, name: str, parameters: str) -> str:
        raise NotImplementedError

    def calls_rule(self, multiple: bool) -> str:
        raise NotImplementedError

    @staticmethod
    def raw_values(call: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
        """An OpenAI call's name and its arguments as the format writes them: strings as they
        are, other values as JSON."""
        name, arguments = call_function(call)
        items = arguments.items() if isinstance(arguments, dict) else ()
        return str(name or ""), [(str(k), v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
                                 for k, v in items]


def _parameters(alt: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """A call schema's parameters as (key, schema, required), in the schema's order; each
    schema standalone: references to the arguments' root re-rooted, and the arguments'
    ``$defs`` / ``definitions`` carried along, so ``{"$ref": "#/$defs/Item"}`` still resolves."""
    rerooted = re.sub(r'"#(?:/anyOf/\d+)?/properties/arguments', '"#', json.dumps(alt["properties"]["arguments"]))
    args = json.loads(rerooted)
    shared = {key: args[key] for key in ("$defs", "definitions") if key in args}
    required = set(args.get("required") or ())
    return [(key, {**schema, **shared} if isinstance(schema, dict) else {}, key in required)
            for key, schema in (args.get("properties") or {}).items()]


class XmlCallsStreamer(RereadingStreamer):
    """Re-reads the text at each step: content until the first block (a partial opener held
    back), then each call's name once complete and its arguments a whole parameter at a time.
    An output whose blocks turn out to hold no call is sent as content at its end, as ``extract``
    returns it (one that started a call cannot take it back)."""

    def __init__(self, parser: XmlCallsParser) -> None:
        super().__init__()
        self.parser = parser

    def feed(self, delta_text: str, final: bool = False) -> StreamDelta:
        self._text += delta_text
        found = self.parser.split(self._text)
        if found is None:
            stable = self._text
            if not final:   # a partial opener, and whitespace that a block would take off the content, wait
                stable = stable[:len(stable) - partial_suffix(stable, self.parser.opener)].rstrip(WS)
            return StreamDelta(content=self._content(stable))
        before, calls, complete = found
        if final and not (complete and calls) and not self._names_sent:
            return StreamDelta(content=self._content(self._text))   # no calls after all: all of it is content
        out = StreamDelta(content=self._content(before.rstrip(WS)))
        partial = [PartialCall(name=c.name, arguments=self.parser.arguments(c, closed=c.done), arguments_done=c.done,
                               done=c.done) for c in calls]
        out.calls = call_deltas(partial, self._names_sent, self._args_sent)
        return out


# ---------------------------------------------------------------------------------------- GLM
_GLM_OPEN, _GLM_CLOSE = "<tool_call>", "</tool_call>"
_KEY_OPEN, _KEY_CLOSE = "<arg_key>", "</arg_key>"
_VALUE_OPEN, _VALUE_CLOSE = "<arg_value>", "</arg_value>"
_NAME = re.compile(r"[^\s<>{}\[\]\"']+")   # a function name: no JSON (Hermes' blocks), no tags


class Glm45ToolParser(XmlCallsParser):
    name = "glm45"
    opener = _GLM_OPEN
    sep: ClassVar[str] = "\n"   # what this model writes between the elements (GLM-4.7: nothing)
    terminals = "GLM_TEXT: /[^<]*<\\/arg_value>/\n"

    def scan(self, body: str) -> tuple[list[XmlCall], bool]:
        calls: list[XmlCall] = []
        i, n = 0, len(body)
        while True:
            i = _skip(body, i)
            j = i
            while j < n and body[j] not in "\r\n<":
                j += 1
            if j >= n:
                return calls, False   # the name is still coming
            if not _NAME.fullmatch(body[i:j].strip(WS)):
                return calls, False
            call = XmlCall(body[i:j].strip(WS))
            calls.append(call)
            i = j
            while True:
                i = _skip(body, i)
                if body.startswith(_GLM_CLOSE, i):
                    call.done = True
                    i += len(_GLM_CLOSE)
                    break
                if not body.startswith(_KEY_OPEN, i):
                    return calls, False
                key_end = body.find(_KEY_CLOSE, i)
                key = body[i + len(_KEY_OPEN):max(key_end, i)].strip(WS)
                if key_end < 0 or not key or "<" in key:
                    return calls, False
                i = _skip(body, key_end + len(_KEY_CLOSE))
                if not body.startswith(_VALUE_OPEN, i):
                    return calls, False
                value_end = body.find(_VALUE_CLOSE, i)
                if value_end < 0:
                    return calls, False
                call.params.append((key, body[i + len(_VALUE_OPEN):value_end]))
                i = value_end + len(_VALUE_CLOSE)
            i = _skip(body, i)
            if i >= n:
                return calls, True
            if not body.startswith(_GLM_OPEN, i):
                return calls, False
            i += len(_GLM_OPEN)

    def text_parameter(self, key: str) -> str:
        return f"{json.dumps(f'{_KEY_OPEN}{key}{_KEY_CLOSE}{self.sep}{_VALUE_OPEN}')} GLM_TEXT" + self._sep()

    def json_parameter(self, key: str, rule: str) -> str:
        return (f"{json.dumps(f'{_KEY_OPEN}{key}{_KEY_CLOSE}{self.sep}{_VALUE_OPEN}')} {rule} "
                f"{json.dumps(_VALUE_CLOSE + self.sep)}")

    def call_rule(self, name: str, parameters: str) -> str:
        return f"{json.dumps(_GLM_OPEN + name + self.sep)} {parameters} {json.dumps(_GLM_CLOSE)}"

    def calls_rule(self, multiple: bool) -> str:
        return f"call ({self._sep()} call)*" if multiple else "call"

    def _sep(self) -> str:
        return f" {json.dumps(self.sep)}" if self.sep else ""

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        sep = self.sep
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{listing}\n</tools>\n\n"
                "For each function call, output the function name and arguments in the following format:\n"
                f"<tool_call>{{function-name}}{sep}<arg_key>{{arg-key-1}}</arg_key>{sep}<arg_value>{{arg-value-1}}"
                f"</arg_value>{sep}<arg_key>{{arg-key-2}}</arg_key>{sep}<arg_value>{{arg-value-2}}</arg_value>{sep}"
                "...</tool_call>")

    def render_calls(self, content: str | None, tool_calls: list[dict[str, Any]]) -> str:
        blocks = []
        for call in tool_calls:
            name, values = self.raw_values(call)
            pairs = "".join(f"{_KEY_OPEN}{k}{_KEY_CLOSE}{self.sep}{_VALUE_OPEN}{v}{_VALUE_CLOSE}{self.sep}"
                            for k, v in values)
            blocks.append(f"{_GLM_OPEN}{name}{self.sep}{pairs}{_GLM_CLOSE}")
        calls = self.sep.join(blocks)
        return f"{content}\n{calls}" if content else calls

    render_results = HermesToolParser.render_results   # (the same <tool_response> blocks)


class Glm47ToolParser(Glm45ToolParser):
    name = "glm47"
    sep = ""


# ----------------------------------------------------------------------------------- MiniMax
_MM_OPEN, _MM_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
_INVOKE = re.compile(r"\s*<invoke name=([\"']?)([^\"'<>\n]+)\1\s*>")
_PARAMETER = re.compile(r"\s*<parameter name=([\"']?)([^\"'<>\n]+)\1\s*>")
_PARAMETER_CLOSE, _INVOKE_CLOSE = "</parameter>", "</invoke>"


class MiniMaxM2ToolParser(XmlCallsParser):
    name = "minimax_m2"
    opener = _MM_OPEN
    terminals = "MM_TEXT: /[^<]*<\\/parameter>/\n"

    def scan(self, body: str) -> tuple[list[XmlCall], bool]:
        calls: list[XmlCall] = []
        i, n = 0, len(body)
        while True:
            while (m := _INVOKE.match(body, i)) is not None:
                call = XmlCall(m.group(2).strip(WS))
                calls.append(call)
                i = m.end()
                while (p := _PARAMETER.match(body, i)) is not None:
                    end = body.find(_PARAMETER_CLOSE, p.end())
                    if end < 0:
                        return calls, False
                    value = body[p.end():end]
                    value = value[1:] if value.startswith("\n") else value
                    call.params.append((p.group(2).strip(WS), value[:-1] if value.endswith("\n") else value))
                    i = end + len(_PARAMETER_CLOSE)
                i = _skip(body, i)
                if not body.startswith(_INVOKE_CLOSE, i):
                    return calls, False
                call.done = True
                i += len(_INVOKE_CLOSE)
            i = _skip(body, i)
            if i >= n:
                return calls, bool(calls) and calls[-1].done   # (stopped at EOS before the block's end)
            if not body.startswith(_MM_CLOSE, i) or not calls:
                return calls, False
            i = _skip(body, i + len(_MM_CLOSE))
            if i >= n:
                return calls, True
            if not body.startswith(_MM_OPEN, i):
                return calls, False
            i += len(_MM_OPEN)

    def text_parameter(self, key: str) -> str:
        return json.dumps('<parameter name="' + key + '">') + ' MM_TEXT "\\n"'

    def json_parameter(self, key: str, rule: str) -> str:
        return " ".join((json.dumps('<parameter name="' + key + '">'), rule, json.dumps(_PARAMETER_CLOSE + "\n")))

    def call_rule(self, name: str, parameters: str) -> str:
        return " ".join((json.dumps('<invoke name="' + name + '">\n'), parameters, json.dumps(_INVOKE_CLOSE + "\n")))

    def calls_rule(self, multiple: bool) -> str:
        return " ".join((json.dumps(_MM_OPEN + "\n"), "call+" if multiple else "call", json.dumps(_MM_CLOSE)))

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\nYou may call one or more tools to assist with the user query.\n"
                f"Here are the tools available in JSONSchema format:\n\n<tools>\n{listing}\n</tools>\n\n"
                "When making tool calls, use XML format to invoke tools and pass parameters:\n\n"
                f'{_MM_OPEN}\n<invoke name="tool-name-1">\n<parameter name="param-key-1">param-value-1</parameter>\n'
                f'<parameter name="param-key-2">param-value-2</parameter>\n...\n</invoke>\n{_MM_CLOSE}')

    def render_calls(self, content: str | None, tool_calls: list[dict[str, Any]]) -> str:
        invokes = []
        for call in tool_calls:
            name, values = self.raw_values(call)
            # A value that starts or ends with a newline is written between newlines, which the reading drops.
            params = "".join(f'<parameter name="{k}">{_padded(v)}</parameter>\n' for k, v in values)
            invokes.append(f'<invoke name="{name}">\n{params}</invoke>\n')
        block = f"{_MM_OPEN}\n{''.join(invokes)}{_MM_CLOSE}"
        return f"{content}\n{block}" if content else block

    def render_results(self, results: list[str]) -> str:
        return "\n".join(f"<response>{r}</response>" for r in results)


def _padded(value: str) -> str:
    return f"\n{value}\n" if value.startswith("\n") or value.endswith("\n") else value
