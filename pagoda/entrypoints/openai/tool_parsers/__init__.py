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
from pagoda.entrypoints.openai.tool_parsers.harmony_calls import OpenAIToolParser
from pagoda.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagoda.entrypoints.openai.tool_parsers.delimited import DeepSeekV3ToolParser, DeepSeekV31ToolParser, KimiK2ToolParser
from pagoda.entrypoints.openai.tool_parsers.json_calls import GraniteToolParser, Llama3JsonToolParser, MistralToolParser
from pagoda.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from pagoda.entrypoints.openai.tool_parsers.xml_calls import Glm45ToolParser, Glm47ToolParser, MiniMaxM2ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, MistralToolParser, Llama3JsonToolParser, GraniteToolParser,
                        DeepSeekV3ToolParser, DeepSeekV31ToolParser, KimiK2ToolParser, Qwen3CoderToolParser,
                        Glm45ToolParser, Glm47ToolParser, MiniMaxM2ToolParser, OpenAIToolParser)}
DEFAULT_TOOL_PARSER = HermesToolParser.name
AUTO = "auto"   # --tool-call-parser auto: the format the chat template writes (choose_tool_parser)

# What a chat template writes around tool calls -> the parser of that format (first match wins: GLM's
# templates also write "<tool_call>", so their "<arg_key>" comes before Hermes' marker, GLM-4.7's
# compact pairs before GLM-4.5's). GPT-OSS's Harmony template writes channels, and its calls as messages.
_TEMPLATE_MARKERS = (
    ("<|channel|>", "openai"),
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("<｜tool▁sep｜>", "deepseek"),
    ("<minimax:tool_call>", "minimax_m2"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|tool_call|>", "granite"),
    ("<|python_tag|>", "llama3_json"),
    ("</arg_key><arg_value>", "glm47"),
    ("<arg_key>", "glm45"),
    ("<function=", "qwen3_coder"),
    ("<tool_call>", "hermes"),
)


def choose_tool_parser(chat_template: str | None) -> tuple[str, str]:
    """(the parser, why) for a model whose chat template is ``chat_template``: the format whose
    markers the template writes (DeepSeek's: V3's fenced JSON arguments, else V3.1's); Hermes
    when it writes none of them."""
    for marker, name in _TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            if name == "deepseek":
                name = "deepseek_v3" if "```json" in chat_template else "deepseek_v31"
            return name, f"the chat template writes {marker!r}"
    return DEFAULT_TOOL_PARSER, "the chat template writes no known tool-call marker"


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {sorted(TOOL_PARSERS)} or {AUTO!r}") from None


__all__ = [
    "AUTO", "DEFAULT_TOOL_PARSER", "choose_tool_parser", "ExtractedToolCalls", "ParsedToolCall", "StreamDelta", "TOOL_PARSERS",
    "ToolCallDelta", "ToolCallStreamer", "ToolParser", "get_tool_parser",
]  # fmt: skip
