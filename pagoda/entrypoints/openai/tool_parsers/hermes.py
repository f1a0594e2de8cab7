"""Hermes / Qwen tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Several calls are several blocks; an array of call objects inside one block (as
SmolLM2 was trained to write) is read too. Text outside the blocks is the message
content, without the whitespace next to a block. If a block does not hold valid calls,
the whole output is returned as content, with no calls.
"""

from __future__ import annotations

import json
from typing import Any

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
from pagoda.entrypoints.openai.tool_parsers.partial_json import WS, PartialCall, scan_calls
from pagoda.sampling_params import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _find_close(text: str, start: int) -> int:
    """Where ``</tool_call>`` begins at or after ``start`` outside JSON strings, or -1:
    a call's string argument may hold the tag itself (a sampled city name did)."""
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "<" and text.startswith(CLOSE, i):
            return i
    return -1


def split_blocks(text: str) -> tuple[list[str], list[tuple[str, bool]]]:
    """Text -> (the segments outside blocks, the blocks as (inner text, closed)).
    There is always one segment more than blocks: before, between and after them."""
    segments: list[str] = []
    blocks: list[tuple[str, bool]] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            segments.append(text[pos:])
            return segments, blocks
        segments.append(text[pos:start])
        inner = start + len(OPEN)
        end = _find_close(text, inner)
        if end < 0:
            blocks.append((text[inner:], False))
            segments.append("")
            return segments, blocks
        blocks.append((text[inner:end], True))
        pos = end + len(CLOSE)


def _parts(segments: list[str]) -> list[str]:
    """The outside segments without the whitespace that touches a block."""
    if len(segments) == 1:
        return segments
    last = len(segments) - 1
    return [s.rstrip(WS) if i == 0 else s.lstrip(WS) if i == last else s.strip(WS)
            for i, s in enumerate(segments)]  # fmt: skip


def _content(segments: list[str]) -> str:
    """The message content: the text around the blocks, pieces joined by a space."""
    return " ".join(p for p in _parts(segments) if p)


class HermesToolParser(ToolParser):
    name = "hermes"

    def extract(self, text: str, truncated: bool = False) -> ExtractedToolCalls:
        if truncated:
            # Cut short (max_tokens): the calls that were completed, without the one in progress.
            start = text.rfind(OPEN)
            if start >= 0 and CLOSE not in text[start:]:
                _, complete = scan_calls(text[start + len(OPEN):], final=True)
                if not complete:
                    before = self.extract(text[:start])
                    return before if before.calls else ExtractedToolCalls(content=text)
        segments, blocks = split_blocks(text)
        if not blocks:
            return ExtractedToolCalls(content=text or None)
        calls: list[ParsedToolCall] = []
        for inner, _closed in blocks:  # an unclosed last block (stopped at EOS) is fine if complete
            scanned, complete = scan_calls(inner, final=True)
            if not complete or not _valid_json(inner) or any(c.name is None or not c.done for c in scanned):
                return ExtractedToolCalls(content=text)
            calls.extend(ParsedToolCall(c.name, c.final_arguments()) for c in scanned)  # type: ignore[arg-type]
        content = _content(segments)
        return ExtractedToolCalls(content=content if content.strip(WS) else None, calls=calls)

    def extract_cut(self, text: str) -> ExtractedToolCalls:
        _, blocks = split_blocks(text)
        calls: list[ParsedToolCall] = []
        for inner, closed in blocks:
            scanned, _ = scan_calls(inner, final=closed)
            calls.extend(ParsedToolCall(c.name, c.final_arguments() if c.done else c.arguments)
                         for c in scanned if c.name is not None)
        return ExtractedToolCalls(content=None, calls=calls)

    def streamer(self) -> HermesStreamer:
        return HermesStreamer()

    def constraint(self, call_schema: dict[str, Any], multiple: bool) -> StructuredOutputsParams:
        schema = {**call_schema, "x-guidance": JSON_LAYOUT}
        start = 'start: call ("\\n" call)*' if multiple else "start: call"
        grammar = (
            f"{start}\n"
            f'call: "{OPEN}\\n" call_json "\\n{CLOSE}"\n'
            f"call_json: %json {json.dumps(schema)}\n"
        )
        return StructuredOutputsParams(grammar=grammar)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{OPEN}{CLOSE} XML tags:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}'
        )

    def render_calls(self, content: str | None, tool_calls: list[dict[str, Any]]) -> str:
        parts = [content] if content else []
        for call in tool_calls:
            name, arguments = call_function(call)
            body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
            parts.append(f"{OPEN}\n{body}\n{CLOSE}")
        return "\n".join(parts)

    def render_results(self, results: list[str]) -> str:
        return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)


def _valid_json(text: str) -> bool:
    try:
        json.JSONDecoder(strict=False).decode(text.strip(WS))
    except ValueError:
        return False
    return True


class HermesStreamer(RereadingStreamer):
    """Re-reads the whole text at each step (outputs are short) and sends what is new:
    content outside blocks, each call's name once it is complete, then its arguments as
    they grow. Whitespace that may turn out to touch a block, and what may be the start
    of ``<tool_call>``, are held back until the next step tells."""

    def feed(self, delta_text: str, final: bool = False) -> StreamDelta:
        self._text += delta_text
        segments, blocks = split_blocks(self._text)
        out = StreamDelta(content=self._new_content(segments, bool(blocks), final))
        calls: list[PartialCall] = []
        for inner, closed in blocks:
            scanned, _ = scan_calls(inner, final=final or closed)
            calls.extend(scanned)
        out.calls = call_deltas(calls, self._names_sent, self._args_sent)
        return out

    def _new_content(self, segments: list[str], has_blocks: bool, final: bool) -> str:
        last = segments[-1]
        if has_blocks:
            last = last.lstrip(WS)
        if not final:
            last = last[: len(last) - partial_suffix(last, OPEN)]
            last = last.rstrip(WS)  # it stays if text follows, goes if a block does
        stable = " ".join(p for p in _parts(segments)[:-1] if p) if has_blocks else ""
        if stable and last:
            stable += " "
        stable += last
        return self._content(stable)
