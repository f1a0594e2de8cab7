"""Feeding a tool-call streamer piece by piece, and checking a whole output's extraction,
as the tool-parser tests do."""

from __future__ import annotations

import json
import random

from pagoda.entrypoints.openai.tool_parsers import ToolCallStreamer


def check_extract(parser, text: str, content: str | None, calls: list[tuple[str, str]] | None) -> None:
    """``parser.extract(text)`` gives ``content`` and ``calls`` (name, arguments), each
    call's arguments a JSON object; ``calls`` None: not valid calls, so the whole output is
    the content and there are no calls."""
    out = parser.extract(text)
    if calls is None:
        assert out.content == text and out.calls == []
        return
    assert out.content == content
    assert [(c.name, c.arguments) for c in out.calls] == calls
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)


def stream(streamer: ToolCallStreamer, text: str, rng: random.Random,
           max_step: int = 6) -> tuple[str, list[tuple[str, str]]]:  # fmt: skip
    """``text`` fed in random pieces of 1..max_step characters (the last one final): the
    content sent and the calls as (name, arguments) from the deltas, checking on the way
    that names come once, in order, before their arguments."""
    content = ""
    calls: dict[int, list] = {}
    i = 0
    while i < len(text):
        step = rng.randint(1, max_step)
        piece, i = text[i:i + step], i + step
        delta = streamer.feed(piece, final=i >= len(text))
        content += delta.content
        for d in delta.calls:
            if d.name is not None:
                assert d.index not in calls and d.index == len(calls), "names come once, in order"
                calls[d.index] = [d.name, ""]
            else:
                assert d.index in calls, "arguments only after the name"
            calls[d.index][1] += d.arguments
    assert streamer.num_calls == len(calls)
    return content, [tuple(calls[k]) for k in sorted(calls)]  # type: ignore[misc]
