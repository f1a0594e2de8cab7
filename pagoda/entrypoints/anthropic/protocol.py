"""Request bodies of Anthropic's Messages API, and their translation onto what chat completions
already use: chat-template messages, a ``ToolPlan`` and SamplingParams.

As everywhere in pagoda, unknown fields are a 400 naming them. Fields that cannot change
the generated text are accepted and ignored: ``metadata.user_id``, ``service_tier`` and
``cache_control`` (prefix caching is automatic). Image and document blocks, server tools
and a final assistant message (prefill) are refused with a 400 saying so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    model_validator,
)

from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.protocol import make_sampling_params
from pagoda.entrypoints.openai.tools import (
    ChatTool,
    NamedToolChoice,
    ToolPlan,
    plan_tools,
)
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

# Anthropic's own floor for a thinking budget.
MIN_THINKING_BUDGET = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content or [])
        return f"Error: {text}" if self.is_error else text


class ImageSource(_Strict):
    type: Literal["base64", "url"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"] | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(_Strict):
    """An image in a user turn: base64 data (a URL is refused: this server fetches nothing)."""

    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None

    def part(self) -> dict[str, Any]:
        """The image as the chat helpers read it (pagoda/multimodal/prompts.py)."""
        s = self.source
        if s.type == "base64":
            if s.data is None or s.media_type is None:
                raise ValueError("a base64 image source needs 'media_type' and 'data'")
            return {"type": "image_base64", "image_base64": s.data}
        if s.url is None:
            raise ValueError("a url image source needs 'url'")
        return {"type": "image_url", "image_url": {"url": s.url}}


class ThinkingBlock(_Strict):
    """Sent back with an earlier assistant turn; like Anthropic, it is left out of the prompt."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
_BLOCKS: dict[str, type[BaseModel]] = {
    "text": TextBlock, "image": ImageBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock, "redacted_thinking": RedactedThinkingBlock,
}  # fmt: skip


def _check_content(value: Any) -> str | list[Block]:
    """A string, or a list of the content blocks this server reads; one clear message otherwise."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content blocks")  # noqa: TRY004 (pydantic wants ValueError)
    if not value:
        raise ValueError("must not be an empty list")
    blocks = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise ValueError("each content block must be an object with a 'type'")  # noqa: TRY004
        model = _BLOCKS.get(kind)
        if model is None:
            raise ValueError(f"content blocks of type {kind!r} are not supported by this server "
                             f"(supported: {', '.join(_BLOCKS)})")  # fmt: skip
        try:
            block = model.model_validate(part)
            if isinstance(block, ImageBlock):
                block.part()   # a source without its data is refused here
            blocks.append(block)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"invalid {kind!r} block: {where}: {first['msg']}") from None
    return blocks  # type: ignore[return-value]


ContentField = Annotated[
    str | list[Block], PlainValidator(_check_content, json_schema_input_type=str | list[dict[str, Any]])
]


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: ContentField

    def to_template_dicts(self) -> list[dict[str, Any]]:
        """This turn as chat-template messages (OpenAI's shapes, which the tool machinery reads):
        tool results become ``tool`` messages, tool uses an assistant's ``tool_calls``."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        if self.role == "assistant":
            if any(isinstance(b, ImageBlock) for b in self.content):
                raise bad_request("'image' blocks belong in user messages.", param="messages")
            texts = [b.text for b in self.content if isinstance(b, TextBlock)]
            calls = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                for b in self.content if isinstance(b, ToolUseBlock)
            ]  # fmt: skip
            message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
            if calls:
                message["tool_calls"] = calls
            return [message]
        # A user turn: consecutive text (and image) blocks make one message, each tool result
        # its own. A message with images keeps its blocks as parts, in order.
        out: list[dict[str, Any]] = []
        parts: list[dict[str, Any]] = []

        def flush() -> None:
            if not parts:
                return
            images = any(p["type"] != "text" for p in parts)
            out.append({"role": "user", "content": list(parts) if images else "\n".join(p["text"] for p in parts)})
            parts.clear()

        for block in self.content:
            if isinstance(block, ToolResultBlock):
                flush()
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
            elif isinstance(block, TextBlock):
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, ImageBlock):
                parts.append(block.part())
            elif isinstance(block, ToolUseBlock):
                raise bad_request("'tool_use' blocks belong in assistant messages.", param="messages")
        flush()
        return out


class Tool(_Strict):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("'name' is required with type 'tool', and only allowed with it")
        return self


class Thinking(_Strict):
    """``enabled`` (with a budget), ``disabled``, or ``adaptive`` (the model decides: it thinks
    when it does, and that is what is returned).

    ``budget_tokens`` is checked as Anthropic checks it (>= 1024, < max_tokens) and enforced:
    the reasoning section gets at most that many tokens, then ``</think>`` is written for the
    model and it goes on to the answer (``openai/thinking_budget.py``).
    """

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget(self) -> Thinking:
        if self.type == "enabled" and (self.budget_tokens is None or self.budget_tokens < MIN_THINKING_BUDGET):
            raise ValueError(f"'budget_tokens' of at least {MIN_THINKING_BUDGET} is required when thinking is enabled")
        if self.type != "enabled" and self.budget_tokens is not None:
            raise ValueError("'budget_tokens' is only allowed when thinking is enabled")
        return self

    @property
    def on(self) -> bool:
        return self.type != "disabled"


class Metadata(_Strict):
    user_id: str | None = None  # ignored: it does not change the output


class _PromptRequest(_Strict):
    """What both /v1/messages and /v1/messages/count_tokens render into a prompt."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None  # ignored: prefix caching is automatic

    @property
    def thinking_on(self) -> bool:
        return self.thinking is not None and self.thinking.on

    def template_messages(self) -> list[dict[str, Any]]:
        if self.messages[-1].role == "assistant":
            raise bad_request("A final assistant message (prefill) is not supported by this server; "
                              "end with a user message.", param="messages")  # fmt: skip
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        for message in self.messages:
            out.extend(message.to_template_dicts())
        return out

    def tool_plan(self) -> ToolPlan:
        """Anthropic's tools and tool_choice as chat completions' (400 on a conflict)."""
        try:
            tools = [ChatTool.model_validate({"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema, **({"description": t.description} if t.description else {}),
            }}) for t in self.tools or []]  # fmt: skip
        except ValidationError as e:
            raise bad_request(f"Invalid tool: {e.errors()[0]['msg']}", param="tools") from None
        choice = self.tool_choice
        mode: str | NamedToolChoice | None = None
        if choice is not None:
            mode = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
            if choice.type == "tool":
                mode = NamedToolChoice.model_validate({"type": "function", "function": {"name": choice.name}})
        parallel = not (choice is not None and choice.disable_parallel_tool_use)
        plan = plan_tools(tools, mode, parallel)
        if plan.forced and self.thinking_on:
            raise bad_request("Thinking may not be enabled when 'tool_choice' forces tool use.", param="thinking")
        return plan

    @property
    def max_tool_calls(self) -> int | None:
        """1 with ``disable_parallel_tool_use``: further calls in the output are dropped."""
        return 1 if self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use else None


class MessagesRequest(_PromptRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # ignored: one tier here

    def check_thinking_budget(self) -> None:
        if self.thinking is not None and self.thinking.budget_tokens is not None \
                and self.thinking.budget_tokens >= self.max_tokens:  # fmt: skip
            raise bad_request("'thinking.budget_tokens' must be less than 'max_tokens'.", param="thinking.budget_tokens")

    def to_sampling_params(self, structured: StructuredOutputsParams | None,
                           defaults: Mapping[str, Any] | None = None) -> SamplingParams:  # fmt: skip
        """``defaults``: the model's own sampling defaults (ModelDefaults.sampling), under the
        request's fields; max_tokens is always the request's (Anthropic requires it)."""
        kwargs: dict[str, Any] = {k: v for k, v in (defaults or {}).items() if k != "max_tokens"}
        kwargs.update(max_tokens=self.max_tokens, structured_outputs=structured)
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k),
                            ("stop", self.stop_sequences)):  # fmt: skip
            if value is not None:
                kwargs[name] = value
        return make_sampling_params(kwargs, {"stop": "stop_sequences"})


class CountTokensRequest(_PromptRequest):
    pass
