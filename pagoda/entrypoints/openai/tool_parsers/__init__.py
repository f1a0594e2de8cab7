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
from pagoda.entrypoints.openai.tool_parsers.delimited import DeepSeekV3ToolParser, DeepSeekV31ToolParser, KimiK2ToolParser
from pagoda.entrypoints.openai.tool_parsers.json_calls import GraniteToolParser, Llama3JsonToolParser, MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, MistralToolParser, Llama3JsonToolParser, GraniteToolParser,
                        DeepSeekV3ToolParser, DeepSeekV31ToolParser, KimiK2ToolParser)}
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
