"""The request of ``POST /v1/responses`` (OpenAI's Responses API), and its translation onto the
chat path: input items become chat messages, function tools become chat tools, ``text.format``
becomes a ``response_format``, so that the same template, tool and structured output machinery
(``serving_chat``, ``tools``, ``structured``) serves both dialects.

Field for field after the ``openai`` package's ``types/responses/response_create_params.py``.
As in ``protocol.py``, unknown fields are a 400 naming them, and fields that would change the
output but are not implemented are rejected unless unset: ``reasoning`` without a reasoning
parser (and, with one, what it cannot do: see ``ReasoningConfig``), ``truncation: "auto"``,
``include`` entries other than ``reasoning.encrypted_content`` (reasoning comes in the clear,
never encrypted) and ``message.output_text.logprobs`` (with ``top_logprobs``, the output
text's logprobs), built-in tools (web_search, file_search, ...), image,
file and audio content, ``background``. Reasoning items sent back as input are accepted and
left out of the prompt, as the reasoning models' chat templates leave out earlier turns'
reasoning (but on GPT-OSS, whose Harmony format keeps the reasoning of the turn being continued:
there they go with the assistant message or calls that follow them, ``to_chat_messages``).
Fields that cannot change the text (``metadata``, ``user``, ``safety_identifier``,
``prompt_cache_key``, ``service_tier``, ``max_tool_calls``, which counts built-in tool calls)
are accepted and echoed. vLLM's extensions: ``top_k``, ``min_p``, ``repetition_penalty`` and
``enable_response_messages`` (the prompt and the output as raw text and token ids).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    model_validator,
)

from pagoda.entrypoints.openai.errors import bad_request, unsupported
from pagoda.entrypoints.openai.structured import JsonSchemaFormat, ResponseFormat
from pagoda.entrypoints.openai.tools import (
    ChatTool,
    FunctionDefinition,
    NamedToolChoice,
    ToolPlan,
    plan_tools,
)

ItemStatus = Literal["in_progress", "completed", "incomplete"]

# ``include`` values: reasoning is returned in the clear anyway (never encrypted); the output
# text's logprobs are computed when asked for.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
INCLUDE_VALUES = ("reasoning.encrypted_content", LOGPROBS_INCLUDE)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


# ---------------------------------------------------------------------- input items
class TextPart(_Strict):
    """``input_text`` (user turns), ``output_text`` (assistant turns echoed back) or ``refusal``."""

    type: Literal["input_text", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None
    # What our own output_text parts carry, so that a response's output can be sent back as input.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    @model_validator(mode="after")
    def _has_text(self) -> TextPart:
        field = "refusal" if self.type == "refusal" else "text"
        if getattr(self, field) is None:
            raise ValueError(f"a {self.type!r} part needs {field!r}")
        return self

    @property
    def content(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class ImagePart(_Strict):
    """``input_image``: an image as a base64 data URL (``file_id``: refused, no file store)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None

    @model_validator(mode="after")
    def _has_url(self) -> ImagePart:
        if self.file_id is not None:
            raise ValueError("input_image with a file_id is not supported (no file store); send image_url")
        if self.image_url is None:
            raise ValueError("an 'input_image' part needs 'image_url'")
        return self

    def to_chat(self) -> dict[str, Any]:
        spec = {"url": self.image_url} if self.detail is None else {"url": self.image_url, "detail": self.detail}
        return {"type": "image_url", "image_url": spec}


_TEXT_PARTS = ("input_text", "output_text", "refusal")


def _check_parts(value: Any) -> str | list[TextPart | ImagePart]:
    """Content: a string, or a list of text and image parts (files and audio: a clear 400)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content parts")  # noqa: TRY004 (pydantic needs ValueError)
    parts: list[TextPart | ImagePart] = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            parts.append(ImagePart.model_validate(part))
            continue
        if kind not in _TEXT_PARTS:
            if isinstance(kind, str):
                raise ValueError(f"content parts of type {kind!r} are not supported; only text parts "
                                 "('input_text', 'output_text', 'refusal') and 'input_image' are")  # fmt: skip
            raise ValueError("each content part must be an object with a 'type'")
        parts.append(TextPart.model_validate(part))
    return parts


ContentField = Annotated[
    str | list[TextPart | ImagePart],
    PlainValidator(_check_parts, json_schema_input_type=str | list[dict[str, Any]]),
]


def _text_of(content: str | list[TextPart | ImagePart]) -> str:
    # Parts joined with newlines, as /v1/chat/completions joins text parts.
    if isinstance(content, str):
        return content
    if any(isinstance(p, ImagePart) for p in content):
        raise bad_request("'input_image' parts belong in message content, not in a function call's output.",
                          param="input")
    return "\n".join(p.content for p in content)


def _chat_content(content: str | list[TextPart | ImagePart]) -> str | list[dict[str, Any]]:
    """A message's content for the chat helpers: text, or with images the parts in order."""
    if isinstance(content, str) or not any(isinstance(p, ImagePart) for p in content):
        return _text_of(content)
    return [p.to_chat() if isinstance(p, ImagePart) else {"type": "text", "text": p.content} for p in content]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: ContentField
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # a label; the text is what counts

    def to_chat(self) -> dict[str, Any]:
        # "developer" is OpenAI's new name for "system"; chat templates only know the latter.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": _chat_content(self.content)}


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None

    def to_tool_call(self) -> dict[str, Any]:
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: ContentField
    id: str | None = None
    status: ItemStatus | None = None

    def to_chat(self) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": self.call_id, "content": _text_of(self.output)}


class SummaryPart(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningTextPart(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningInputItem(_Strict):
    """A reasoning item of an earlier response, sent back with it (or stored with it). It is
    kept as history (listed, stored) but not put in the prompt: reasoning models' templates
    render only the answers of earlier turns."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryPart] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningInputItem
_ITEM_MODELS: dict[str, type[InputItem]] = {
    "message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningInputItem,
}  # fmt: skip


def parse_item(value: Any) -> InputItem:
    """One input item (a message may leave out its ``type``); ValueError names what is wrong."""
    if not isinstance(value, dict):
        raise ValueError("must be an object")  # noqa: TRY004 (pydantic needs ValueError)
    kind = value.get("type", "message")
    model = _ITEM_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ValueError(f"input items of type {kind!r} are not supported; only 'message', "
                         "'function_call', 'function_call_output' and 'reasoning' are")  # fmt: skip
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise ValueError(_first_error(e)) from None


def _first_error(e: ValidationError) -> str:
    """'content: must be ...' from a nested model's first error (one clear message, as errors.py)."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    message = str(err["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def _check_input(value: Any) -> str | list[InputItem]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of input items")  # noqa: TRY004 (pydantic needs ValueError)
    items = []
    for i, item in enumerate(value):
        try:
            items.append(parse_item(item))
        except ValueError as e:
            raise ValueError(f"item {i}: {e}") from None
    return items


InputField = Annotated[
    str | list[InputItem], PlainValidator(_check_input, json_schema_input_type=str | list[dict[str, Any]])
]


def to_chat_messages(items: list[InputItem], keep_reasoning: bool = False) -> list[dict[str, Any]]:
    """Input items as chat messages. A run of ``function_call`` items joins the assistant
    message before it (a response's output is [message, function_call, function_call]),
    so that a turn with several calls is one assistant message with several ``tool_calls``.
    ``keep_reasoning``: a reasoning item's text becomes the ``reasoning_content`` of the
    assistant message it comes before (a response's output is [reasoning, function_call]);
    otherwise reasoning items are left out (see ReasoningInputItem)."""
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []   # reasoning items waiting for their assistant message
    for item in items:
        if isinstance(item, ReasoningInputItem):
            parts = item.content or item.summary
            reasoning += [p.text for p in parts] if keep_reasoning else []
            continue
        last = messages[-1] if messages else None
        if isinstance(item, FunctionCallItem):
            if last is None or last["role"] != "assistant" or reasoning:
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(item.to_tool_call())
        else:
            last = item.to_chat()
            messages.append(last)
        if reasoning and last["role"] == "assistant":
            last["reasoning_content"] = "\n".join(reasoning)
        reasoning = [] if last["role"] == "assistant" else reasoning
    return messages


# ---------------------------------------------------------------------- tools and tool_choice
class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the schema is enforced whenever a call is forced, as in chat

    def to_chat(self) -> ChatTool:
        return ChatTool(type="function", function=FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters, strict=self.strict))  # fmt: skip


def _check_tools(value: Any) -> list[FunctionTool] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError("must be a list of tools")  # noqa: TRY004 (pydantic needs ValueError)
    tools = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            if isinstance(kind, str):
                raise ValueError(f"tool {i}: built-in tools of type {kind!r} are not supported; only 'function' "
                                 "tools are")  # fmt: skip
            raise ValueError(f"tool {i}: must be an object with a 'type'")
        try:
            tool_model = FunctionTool.model_validate(tool)
            tool_model.to_chat()  # checks the name as chat does
        except ValidationError as e:
            raise ValueError(f"tool {i}: {_first_error(e)}") from None
        tools.append(tool_model)
    return tools


ToolsField = Annotated[
    list[FunctionTool] | None, PlainValidator(_check_tools, json_schema_input_type=list[dict[str, Any]] | None)
]


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str


def _check_tool_choice(value: Any) -> str | FunctionToolChoice | None:
    if value is None or value in ("none", "auto", "required"):
        return value  # type: ignore[no-any-return]
    if isinstance(value, dict):
        try:
            return FunctionToolChoice.model_validate(value)
        except ValidationError:
            pass
    raise ValueError("must be 'none', 'auto', 'required' or {'type': 'function', 'name': <name>}")


ToolChoiceField = Annotated[
    str | FunctionToolChoice | None,
    PlainValidator(_check_tool_choice, json_schema_input_type=str | dict[str, Any] | None),
]


# ---------------------------------------------------------------------- text, reasoning
class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    # "schema" would shadow a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # the schema is always enforced

    @model_validator(mode="after")
    def _fields_match_type(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise ValueError("'name' and 'schema' are required when 'type' is 'json_schema'")
        if self.type != "json_schema" and (self.name, self.json_schema, self.description, self.strict) != (None,) * 4:
            raise ValueError(f"'name', 'schema', 'description' and 'strict' belong to 'json_schema', not {self.type!r}")
        return self

    def to_response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        schema = JsonSchemaFormat(name=self.name or "", json_schema=self.json_schema, description=self.description,
                                  strict=self.strict)  # fmt: skip
        return ResponseFormat(type="json_schema", json_schema=schema)


class TextConfig(_Strict):
    format: TextFormat | None = None
    # Only the default: this server cannot make a model more or less wordy.
    verbosity: Literal["medium"] | None = None


class ReasoningConfig(_Strict):
    """What to do about reasoning. Without a reasoning parser, only a request that asks for
    no reasoning is accepted. With one, the model's reasoning is returned as a ``reasoning``
    item, and:

    - ``effort``: GPT-OSS's reasoning level (low, medium, high: the Harmony system message's
      ``Reasoning:`` line), or the value of a chat template's ``reasoning_effort`` variable; a
      400 for a model that has neither (serving_chat.py ``ChatServing.effort_kwargs``).
    - ``summary`` / ``generate_summary``: only ``auto`` (which lets the server return no
      summary); there is no summarizer, so ``concise`` and ``detailed`` are a 400.
    - ``context``: ``auto`` or ``current_turn`` (earlier turns' reasoning is not rendered);
      ``all_turns`` is a 400.
    - ``mode``: only ``standard``.
    """

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None
    generate_summary: str | None = None
    context: str | None = None
    mode: str | None = None

    @property
    def asks_for_reasoning(self) -> bool:
        values = (self.summary, self.generate_summary, self.context, self.mode)
        return self.effort not in (None, "none") or any(v is not None for v in values)

    def check_with_parser(self) -> None:
        """The 400 for what a server with a reasoning parser still cannot do."""
        for name in ("summary", "generate_summary"):
            value = getattr(self, name)
            if value not in (None, "auto"):
                raise unsupported(f"reasoning.{name}", f"value {value!r} is not supported: there is no reasoning "
                                                       "summarizer (only 'auto', which returns no summary)")  # fmt: skip
        if self.context not in (None, "auto", "current_turn"):
            raise unsupported("reasoning.context", f"value {self.context!r} is not supported; earlier turns' "
                                                   "reasoning is not rendered ('auto' or 'current_turn')")  # fmt: skip
        if self.mode not in (None, "standard"):
            raise unsupported("reasoning.mode", f"value {self.mode!r} is not supported; only 'standard'")


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool | None = None  # ignored: padding against length side channels


def _check_metadata(value: Any) -> dict[str, str] | None:
    # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512.
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError("must be an object of string values")
    if len(value) > 16:
        raise ValueError(f"at most 16 pairs, got {len(value)}")
    for key, item in value.items():
        if len(key) > 64 or len(item) > 512:
            raise ValueError(f"keys may have at most 64 characters and values 512 ({key[:64]!r})")
    return value


MetadataField = Annotated[
    dict[str, str] | None, PlainValidator(_check_metadata, json_schema_input_type=dict[str, str] | None)
]


# ---------------------------------------------------------------------- the request
class ResponsesRequest(_Strict):
    model: str | None = None  # None: the served model
    input: InputField
    instructions: str | None = None
    max_output_tokens: int | None = None  # None: up to the context length
    temperature: float | None = None
    top_p: float | None = None
    tools: ToolsField = None
    tool_choice: ToolChoiceField = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: MetadataField = None
    store: bool | None = None  # None: True, as OpenAI
    previous_response_id: str | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None  # with include ["message.output_text.logprobs"]; -1: the whole vocabulary
    background: bool | None = None
    # vLLM's extensions: sampling, and the prompt and output as raw text and token ids in the
    # Response (input_messages / output_messages).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    enable_response_messages: bool | None = None
    # Accepted and echoed: they do not change what is generated.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = None

    @property
    def stored(self) -> bool:
        return self.store is not False

    @property
    def output_logprobs(self) -> bool:
        """Whether the output text comes with its tokens' logprobs."""
        return LOGPROBS_INCLUDE in (self.include or ())

    def check_supported(self, reasoning_parser: bool = False) -> None:
        """400 for what is not implemented; ``reasoning_parser``: the server reads reasoning."""
        if self.reasoning is not None and reasoning_parser:
            self.reasoning.check_with_parser()
        elif self.reasoning is not None and self.reasoning.asks_for_reasoning:
            raise unsupported("reasoning", "is not supported by this server: it has no reasoning parser "
                                           "(--reasoning-parser)")  # fmt: skip
        if self.truncation == "auto":
            raise unsupported("truncation", "value 'auto' is not supported; only 'disabled' (an input longer than "
                                            "the context is a 400)")  # fmt: skip
        if self.top_logprobs is not None and not self.output_logprobs:
            raise bad_request(f"'top_logprobs' needs 'include': ['{LOGPROBS_INCLUDE}'] (the output text's "
                              "logprobs, which it sets the alternatives of).", param="top_logprobs")  # fmt: skip
        if self.background:
            raise unsupported("background", "mode is not supported by this server")
        extra = [i for i in self.include or [] if i not in INCLUDE_VALUES]
        if extra:
            raise unsupported("include", f"values other than {' and '.join(map(repr, INCLUDE_VALUES))} are not "
                                         f"supported: {extra}")  # fmt: skip
        if self.stream_options is not None and not self.stream:
            raise unsupported("stream_options", "is only allowed when 'stream' is true")

    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        return fmt.to_response_format() if fmt is not None else None

    def tool_plan(self) -> ToolPlan:
        """What to do with the tools, checked as chat checks them (400 on a conflict)."""
        choice = self.tool_choice
        named = NamedToolChoice(type="function", function={"name": choice.name}) \
            if isinstance(choice, FunctionToolChoice) else choice  # fmt: skip
        tools = [t.to_chat() for t in self.tools] if self.tools else None
        return plan_tools(tools, named, self.parallel_tool_calls)
