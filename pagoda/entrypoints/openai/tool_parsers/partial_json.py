"""Reading tool calls out of JSON text that may still be growing, one token at a time.

A call is an object ``{"name": ..., "arguments": {...}}`` (``parameters`` is accepted for
``arguments``). The scanner reports what is known so far: the name once its string is
complete, and the raw text of the arguments value as far as it has been generated. The
arguments are kept as the model wrote them (a raw slice, not re-serialized), so the
fragments streamed while they grow add up to exactly the string a non-streaming
response returns.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_DECODER = json.JSONDecoder(strict=False)  # tolerate raw control characters inside strings
WS = " \t\r\n"   # JSON's whitespace
_PARTIAL_NUMBER = re.compile(r"-?[0-9]*(\.[0-9]*)?([eE][+-]?[0-9]*)?")
ARGUMENT_KEYS = ("arguments", "parameters")


class InvalidJSON(Exception):
    """The text cannot be the start of a tool call object (or array of them)."""


@dataclass
class PartialCall:
    name: str | None = None
    # The arguments text available so far: a raw prefix of an object/array value, or the
    # whole value once complete (a JSON string value decoded to its content).
    arguments: str = ""
    arguments_done: bool = False
    done: bool = False  # the call object is closed

    def final_arguments(self) -> str:
        """The arguments string of the complete call ("{}" when it has none)."""
        return self.arguments if self.arguments_done else "{}"


def _skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in WS:
        i += 1
    return i


def value_end(s: str, i: int, final: bool) -> int | None:
    """The index just past the complete JSON value starting at ``s[i]``; None if it is not
    complete yet. Raises InvalidJSON if no JSON value can start there."""
    try:
        _, end = _DECODER.raw_decode(s, i)
    except json.JSONDecodeError as e:
        if s[i] in '{["':
            return None  # cut short, or broken inside: either way not complete
        rest = s[i:]
        if any(lit.startswith(rest) for lit in ("true", "false", "null")) or _PARTIAL_NUMBER.fullmatch(rest):
            return None  # a literal or number cut short at the end of the text
        raise InvalidJSON(str(e)) from None
    if s[i] not in '{["' and end >= len(s) and not final:
        return None  # a number or literal at the very end may still grow ("12" -> "123")
    return end


def _arguments_text(raw: str) -> str:
    """The arguments string a complete value stands for: a JSON string holds the JSON text
    itself; null means no arguments; anything else is kept as written."""
    if raw.startswith('"'):
        value = _DECODER.decode(raw)
        return value if isinstance(value, str) else raw
    if raw == "null":
        return "{}"
    return raw


def scan_object(s: str, i: int, final: bool) -> tuple[PartialCall, int | None]:
    """Scan the call object starting at ``s[i] == '{'``: (what is known, index past it or None)."""
    call = PartialCall()
    i += 1
    n = len(s)
    while True:
        i = _skip_ws(s, i)
        if i >= n:
            return call, None
        c = s[i]
        if c == "}":
            call.done = True
            return call, i + 1
        if c == ",":
            i += 1
            continue
        if c != '"':
            raise InvalidJSON(f"expected a key at {i}")
        key_end = value_end(s, i, final)
        if key_end is None:
            return call, None
        key = _DECODER.decode(s[i:key_end])
        i = _skip_ws(s, key_end)
        if i >= n:
            return call, None
        if s[i] != ":":
            raise InvalidJSON(f"expected ':' at {i}")
        i = _skip_ws(s, i + 1)
        if i >= n:
            return call, None
        end = value_end(s, i, final)
        if key in ARGUMENT_KEYS:
            if end is None:
                if s[i] in "{[":
                    call.arguments = s[i:]  # every character so far belongs to the value
                return call, None
            call.arguments = _arguments_text(s[i:end])
            call.arguments_done = True
        elif end is None:
            return call, None
        elif key == "name":
            name = _DECODER.decode(s[i:end])
            if not isinstance(name, str):
                raise InvalidJSON("the name of a tool call must be a string")
            call.name = name
        i = end


def scan_calls(text: str, final: bool = False) -> tuple[list[PartialCall], bool]:
    """The calls in ``text`` (one call object, or an array of them) as far as they go, and
    whether the text is complete and valid (only whitespace after the value)."""
    calls: list[PartialCall] = []
    i = _skip_ws(text, 0)
    n = len(text)
    if i >= n:
        return calls, False
    try:
        if text[i] == "{":
            call, end = scan_object(text, i, final)
            calls.append(call)
            return calls, end is not None and _skip_ws(text, end) == n
        if text[i] != "[":
            return calls, False
        i += 1
        while True:
            i = _skip_ws(text, i)
            if i >= n:
                return calls, False
            if text[i] == "]":
                return calls, bool(calls) and _skip_ws(text, i + 1) == n
            if text[i] == ",":
                i += 1
                continue
            if text[i] != "{":
                return calls, False
            call, end = scan_object(text, i, final)
            calls.append(call)
            if end is None:
                return calls, False
            i = end
    except InvalidJSON:
        return calls, False
