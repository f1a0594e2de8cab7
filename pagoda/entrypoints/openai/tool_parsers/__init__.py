"""Tool-call formats, chosen with ``pagoda serve --tool-call-parser``."""

from __future__ import annotations

from pagoda.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    StreamDelta,
    ToolCallDelta,
    ToolCallStreamer,
    ToolParser,
)
from pagoda.entrypoints.openai.tool_parsers.hermes import HermesToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {HermesToolParser.name: HermesToolParser}
DEFAULT_TOOL_PARSER = HermesToolParser.name


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {sorted(TOOL_PARSERS)}") from None


__all__ = [
    "DEFAULT_TOOL_PARSER", "ExtractedToolCalls", "ParsedToolCall", "StreamDelta", "TOOL_PARSERS",
    "ToolCallDelta", "ToolCallStreamer", "ToolParser", "get_tool_parser",
]  # fmt: skip
