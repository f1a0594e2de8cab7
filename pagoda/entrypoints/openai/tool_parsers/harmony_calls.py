"""GPT-OSS's tool calls (``--tool-call-parser openai``, vLLM's name), in OpenAI's Harmony format
(pagoda/reasoning/harmony.py).

A call is a message of its own, with the tool as its recipient; its content is the arguments::

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}

and ``<|call|>`` (a stop token) ends it, and the generation: one call per generation. The
``openai_gptoss`` reasoning parser splits the output first, and hands this parser the content:
the answer's text, with each call left in it as a block (``<|start|>assistant`` + header +
``<|message|>`` + arguments, then ``<|end|>`` once complete). Text outside the blocks is the
message content; each block is a call, named after its recipient: a function's own name for
``functions.NAME``, and a built-in tool's recipient as it is (``python``, ``browser.search``),
since GPT-OSS calls the tools it was trained with even when they were not offered. The arguments
are the message's content as the model wrote it (JSON for a function, code for ``python``),
``{}`` when it wrote none. A block whose header cannot be read is left in the content as it is
written. Streaming re-reads the text at each step: content as it comes (what may still be the
start of a block held back), each call's name once its header is complete, then its arguments as
they grow.

The forcing grammar (``tool_choice`` required or named) is one of whole outputs: analysis
messages and preambles as GPT-OSS writes them, then one call, its recipient a chosen function
(in the role part or after the channel, with or without ``<|constrain|>json``) and its
arguments matching the function's schema, written compactly as GPT-OSS writes JSON.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pagoda.reasoning.harmony import (
    CALL,
    END,
    MESSAGE,
    RETURN,
    START,
    HarmonyHeader,
    call_name,
    find_first,
    partial_marker,
    read_header,
    render_functions,
)
from pagoda.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    RereadingStreamer,
    StreamDelta,
    ToolParser,
)
from pagoda.entrypoints.openai.tool_parsers.json_calls import call_deltas
from pagoda.entrypoints.openai.tool_parsers.partial_json import PartialCall
from pagoda.reasoning.gpt_oss import ANALYSIS_RULES, WHOLE_OUTPUT_GRAMMAR
from pagoda.sampling_params import StructuredOutputsParams

# How GPT-OSS writes JSON arguments: compact, as in the Harmony specification's examples.
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass
class _Block:
    """A ``<|start|>`` block of the content: ``header`` None while (or when) it cannot be read."""

    header: HarmonyHeader | None
    header_done: bool   # its <|message|> has come
    body: str           # what follows <|message|>
    closed: bool
    raw: str            # the block as written

    @property
    def call(self) -> str | None:
        """The name of the call it is, if it is one."""
        return call_name(self.header.recipient) if self.header is not None and self.header.recipient else None

    def text(self, complete: bool) -> str:
        """What it puts in the content (a call puts nothing): a message's text, the raw block when
        its header is not one (or never came, in a block that ended); analysis text is reasoning."""
        if self.header is not None:
            return "" if self.header.recipient or self.header.channel == "analysis" else self.body
        return self.raw if self.header_done or complete else ""


def _split(text: str) -> tuple[list[str], list[_Block]]:
    """The content's text segments (one more than blocks: before, between and after them) and
    its blocks."""
    segments: list[str] = []
    blocks: list[_Block] = []
    pos = 0
    while (start := text.find(START, pos)) >= 0:
        segments.append(text[pos:start])
        stop, marker = find_first(text, (END, CALL, RETURN, START), start + len(START))
        end = stop if stop >= 0 else len(text)
        inner = text[start + len(START):end]
        at = inner.find(MESSAGE)
        header = read_header(inner[:at]) if at >= 0 else None
        blocks.append(_Block(header, at >= 0, inner[at + len(MESSAGE):] if at >= 0 else "", stop >= 0,
                             text[start:end]))  # fmt: skip
        pos = end + (len(marker) if stop >= 0 and marker != START else 0)
    segments.append(text[pos:])
    return segments, blocks


def _read(text: str, complete_last: bool) -> tuple[str, list[PartialCall]]:
    """(the content, the calls) of ``text``; ``complete_last``: a last block no marker ended is
    complete (the output ended at a stop token), not still being written or cut short."""
    segments, blocks = _split(text)
    content = segments[0]
    calls: list[PartialCall] = []
    for block, segment in zip(blocks, segments[1:], strict=True):
        complete = block.closed or complete_last
        name = block.call
        if name is not None:
            arguments = block.body or ("{}" if complete else "")
            calls.append(PartialCall(name=name, arguments=arguments, arguments_done=True, done=complete))
        content += block.text(complete) + segment
    return content, calls


class OpenAIToolParser(ToolParser):
    name = "openai"

    def extract(self, text: str, truncated: bool = False) -> ExtractedToolCalls:
        # Cut short (max_tokens): a call no marker ended is incomplete, and dropped.
        content, calls = _read(text, complete_last=not truncated)
        calls = [c for c in calls if c.done]
        return ExtractedToolCalls(content=content or None,
                                  calls=[ParsedToolCall(c.name, c.arguments) for c in calls])  # type: ignore[arg-type]

    def extract_cut(self, text: str) -> ExtractedToolCalls:
        _, calls = _read(text, complete_last=False)
        return ExtractedToolCalls(content=None,
                                  calls=[ParsedToolCall(c.name, c.arguments) for c in calls])  # type: ignore[arg-type]

    def streamer(self) -> OpenAIToolStreamer:
        return OpenAIToolStreamer()

    def constraint(self, call_schema: dict[str, Any], multiple: bool) -> StructuredOutputsParams:
        # One call whatever ``multiple`` says: <|call|> ends the generation.
        alternatives = call_schema["anyOf"] if "anyOf" in call_schema else [call_schema]
        rules = []
        for k, alt in enumerate(alternatives):
            recipient = json.dumps(" to=functions." + alt["properties"]["name"]["const"])
            # The arguments' schema on its own: references into it re-rooted.
            arguments = json.loads(re.sub(r'"#(?:/anyOf/\d+)?/properties/arguments', '"#',
                                          json.dumps(alt["properties"]["arguments"])))
            rules.append(f'call_{k}: <|channel|> "commentary" {recipient} type? <|message|> args_{k} '
                         f'| {recipient} <|channel|> "commentary" type? <|message|> args_{k}\n'
                         f"args_{k}: %json {json.dumps({**arguments, 'x-guidance': _COMPACT_JSON})}\n")
        grammar = (
            WHOLE_OUTPUT_GRAMMAR
            + 'start: (free <|end|> <|start|> "assistant")* call\n'
            + 'free: analysis | <|channel|> "commentary" <|message|> HARMONY_TEXT\n'
            + ANALYSIS_RULES
            + 'type: " " <|constrain|> "json" | " json"\n'
            + f"call: {' | '.join(f'call_{k}' for k in range(len(alternatives)))}\n"
            + "".join(rules)
        )
        return StructuredOutputsParams(grammar=grammar)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return "# Tools\n\n" + render_functions([t.get("function") or {} for t in tools])

    def render_calls(self, content: str | None, tool_calls: list[dict[str, Any]]) -> str:
        parts = [content or ""]
        for call in tool_calls:
            function = call.get("function") or {}
            arguments = function.get("arguments")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
            parts.append(f"{START}assistant<|channel|>commentary to=functions.{function.get('name')} "
                         f"<|constrain|>json{MESSAGE}{arguments}{END}")  # fmt: skip
        return "".join(parts)

    def render_results(self, results: list[str]) -> str:
        return "\n".join(results)


class OpenAIToolStreamer(RereadingStreamer):
    def feed(self, delta_text: str, final: bool = False) -> StreamDelta:
        self._text += delta_text
        text = self._text if final else self._text[:len(self._text) - partial_marker(self._text)]
        content, calls = _read(text, complete_last=final)
        return StreamDelta(content=self._content(content), calls=call_deltas(calls, self._names_sent, self._args_sent))
