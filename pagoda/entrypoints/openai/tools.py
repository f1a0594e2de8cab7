"""Tool calling in /v1/chat/completions: tool definitions, ``tool_choice``, the grammar that
forces a call, and writing tools and earlier calls into the prompt.

``tool_choice``:
- ``none``: no tools in the prompt, nothing parsed;
- ``auto`` (the default with tools): tools in the prompt, calls parsed from the output;
- ``required``: generation constrained to one call (several with ``parallel_tool_calls``)
  of any tool, its arguments matching that tool's ``parameters`` schema;
- ``{"type": "function", "function": {"name": ...}}``: constrained to one call of that tool.

The prompt: a chat template that renders ``tools``, assistant ``tool_calls`` and ``tool``
messages itself is used as is. Otherwise (SmolLM2's template ignores all three) the tool
parser's format is written into the messages: tools into the system prompt, calls into
the assistant text, results into a user turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, PlainValidator, field_validator

from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.tool_parsers import ToolParser
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.tokenizer import Tokenizer

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the schema is enforced whenever a call is forced

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError("must be 1-64 letters, digits, underscores, dashes, dots or colons")
        return value


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _FunctionName


def _check_tool_choice(value: Any) -> str | NamedToolChoice | None:
    if value is None or value in ("none", "auto", "required"):
        return value  # type: ignore[no-any-return]
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValueError:
            pass
    raise ValueError("must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': <name>}}")


ToolChoiceField = Annotated[
    str | NamedToolChoice | None,
    PlainValidator(_check_tool_choice, json_schema_input_type=str | dict[str, Any] | None),
]


@dataclass
class ToolPlan:
    """What a request does with its tools."""

    mode: Literal["none", "auto", "required", "named"]
    tools: list[ChatTool] = field(default_factory=list)
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Tools are in the prompt and calls are parsed from the output."""
        return self.mode != "none" and bool(self.tools)

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def constraint(self, parser: ToolParser) -> StructuredOutputsParams | None:
        """For a forced call: the grammar that admits only valid calls."""
        if not self.forced:
            return None
        chosen = [t for t in self.tools if self.mode == "required" or t.function.name == self.named]
        if len(chosen) == 1:
            schema = call_schema(chosen[0], "#/properties/arguments")
        else:
            schema = {"anyOf": [call_schema(t, f"#/anyOf/{i}/properties/arguments") for i, t in enumerate(chosen)]}
        return parser.constraint(schema, multiple=self.mode == "required" and self.parallel)


def call_schema(tool: ChatTool, arguments_at: str = "#/properties/arguments") -> dict[str, Any]:
    """The JSON ``{"name": <this tool>, "arguments": <matching its parameters>}``, the parameters
    sitting at the JSON pointer ``arguments_at`` of the whole schema. Their own local references
    (``{"$ref": "#/$defs/Item"}``, written against the parameters' root) are moved there, so
    they still point into the tool's own schema (recursive ones included)."""
    parameters = tool.function.parameters
    if not parameters:
        parameters = _EMPTY_PARAMETERS
    parameters = _rebase_refs(parameters, arguments_at)
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _rebase_refs(schema: Any, root: str) -> Any:
    """A copy of ``schema`` with each local ``$ref`` ("#", "#/...") prefixed by ``root``:
    ``{"$ref": "#/$defs/A"}`` -> ``{"$ref": root + "/$defs/A"}``."""
    if isinstance(schema, list):
        return [_rebase_refs(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        else:
            out[key] = _rebase_refs(value, root)
    return out


def plan_tools(
    tools: list[ChatTool] | None, tool_choice: str | NamedToolChoice | None, parallel_tool_calls: bool | None
) -> ToolPlan:
    """Check tools and tool_choice together (400 on a conflict) and say what to do."""
    tools = tools or []
    names = [t.function.name for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise bad_request(f"Tool names must be unique; repeated: {', '.join(duplicates)}.", param="tools")
    parallel = parallel_tool_calls is not False
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if not tools:
            raise bad_request("'tool_choice' names a function, but no 'tools' were given.", param="tool_choice")
        if name not in names:
            raise bad_request(
                f"'tool_choice' names the function {name!r}, which is not among the tools "
                f"({', '.join(names)}).", param="tool_choice", code="invalid_value",
            )  # fmt: skip
        return ToolPlan("named", tools, name, parallel)
    if tool_choice == "required" and not tools:
        raise bad_request("'tool_choice' is 'required', but no 'tools' were given.", param="tool_choice")
    mode = tool_choice or ("auto" if tools else "none")
    return ToolPlan(mode, tools, None, parallel)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the prompt
_PROBE = "pagoda_probe_7f3a"
_native_cache: dict[str, bool] = {}


def template_renders_tools(tokenizer: Tokenizer) -> bool:
    """Whether the chat template writes tools, assistant tool calls and tool results itself:
    rendering a probe conversation must keep all three."""
    key = repr((tokenizer.chat_template, getattr(tokenizer, "_named_chat_templates", None)))
    if key not in _native_cache:
        tool = {"type": "function", "function": {"name": f"{_PROBE}_tool", "parameters": _EMPTY_PARAMETERS}}
        call = {"id": "call_0", "type": "function", "function": {"name": f"{_PROBE}_call", "arguments": {}}}
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": f"{_PROBE}_result"},
        ]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=[tool])
            _native_cache[key] = all(f"{_PROBE}_{part}" in text for part in ("tool", "call", "result"))
        except Exception:
            _native_cache[key] = False
    return _native_cache[key]


def native_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template that renders tool calls: arguments as objects, as templates expect."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                function = dict(call.get("function") or {})
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except ValueError:
                        pass
                calls.append({**call, "function": function})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def written_messages(
    messages: list[dict[str, Any]], parser: ToolParser, tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """For a template that does not render tools: the same conversation in plain messages,
    with ``tools`` (if any) described in the system prompt."""
    out: list[dict[str, Any]] = []
    results: list[str] = []

    def flush_results() -> None:
        if results:
            out.append({"role": "user", "content": parser.render_results(results)})
            results.clear()

    for m in messages:
        if m["role"] == "tool":
            results.append(m.get("content") or "")
            continue
        flush_results()
        if m.get("tool_calls"):
            text = parser.render_calls(m.get("content"), m["tool_calls"])
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = text
        out.append({k: v for k, v in m.items() if k != "tool_call_id"})
    flush_results()
    if tools:
        prompt = parser.system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def prompt_inputs(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], plan: ToolPlan, parser: ToolParser
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and ``tools`` to hand the chat template."""
    has_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not plan.active and not has_calls:
        return messages, None
    tools = plan.tool_dicts() if plan.active else None
    if template_renders_tools(tokenizer):
        return native_messages(messages), tools
    return written_messages(messages, parser, tools), None
