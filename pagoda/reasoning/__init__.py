"""Reasoning parsers, chosen with ``pagoda serve --reasoning-parser``: name -> class."""

from __future__ import annotations

from pagoda.reasoning.base import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningSplit,
    ReasoningStreamer,
    count_reasoning_tokens,
)
from pagoda.reasoning.gpt_oss import GptOssReasoningParser
from pagoda.reasoning.think_tags import (
    DeepSeekR1ReasoningParser,
    Ernie45ReasoningParser,
    Glm45ReasoningParser,
    Glm47ReasoningParser,
    GraniteReasoningParser,
    HunyuanA13BReasoningParser,
    MiniMaxM2AppendThinkReasoningParser,
    MiniMaxM2ReasoningParser,
    MistralReasoningParser,
    Qwen3ReasoningParser,
    SeedOssReasoningParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (
        DeepSeekR1ReasoningParser, Qwen3ReasoningParser, Glm45ReasoningParser, Glm47ReasoningParser,
        MiniMaxM2ReasoningParser, MiniMaxM2AppendThinkReasoningParser, MistralReasoningParser, SeedOssReasoningParser,
        Ernie45ReasoningParser, HunyuanA13BReasoningParser, GraniteReasoningParser, GptOssReasoningParser,
    )
}  # fmt: skip


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser called ``name`` (None: no parser); ValueError naming the choices for an unknown one."""
    if name is None:
        return None
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {sorted(REASONING_PARSERS)}") from None


__all__ = [
    "REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "ReasoningSplit", "ReasoningStreamer",
    "count_reasoning_tokens", "get_reasoning_parser",
]  # fmt: skip
