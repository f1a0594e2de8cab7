"""Request schemas of the OpenAI-compatible API, and their mapping onto SamplingParams.

Every model forbids unknown fields, so a misspelt or unsupported parameter is a 400
naming it rather than being silently ignored (which would change what the client
thinks it asked for). Fields OpenAI defines that cannot change the generated text
(``user``, ``metadata``, ``store``, ``service_tier``,
``prompt_cache_key``, ``safety_identifier``, ``stream_options.include_obfuscation``)
are accepted and ignored. Fields that would change the output but that pagoda does
not implement are declared too, only to reject them with a clear message
(``check_supported``). Validation is strict: ``"0.5"`` is not a number and ``true``
is not an integer, as with OpenAI.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, model_validator

from pagoda.entrypoints.openai import structured
from pagoda.entrypoints.openai.errors import APIError, bad_request, unsupported
from pagoda.entrypoints.openai.structured import ResponseFormat, StructuredOutputsRequest
from pagoda.entrypoints.openai.tools import ChatTool, ToolChoiceField, ToolPlan, plan_tools
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams


# Upper bound on ``n`` (OpenAI's own limit): each choice is a sequence with its own KV
# cache, so an unbounded n lets one request occupy the engine for minutes.
MAX_N = 128


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ---------------------------------------------------------------------- union-typed fields
# Pydantic reports a bad value of a union field once per member, with locations such as
# "prompt.list[int].0"; these plain validators give one error located at the field itself.
def _check_stop(value: Any) -> str | list[str] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("must be a string or a list of strings")


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _check_prompt(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value) or _is_token_list(value):
            return value
        if all(_is_token_list(p) for p in value):
            return value
    if isinstance(value, list) and not value:
        raise ValueError("must not be empty")
    raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists of token ids")


def _check_content(value: Any) -> str | None:
    """Text content as a string; a list of text parts is joined with newlines."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content parts")
    texts = []
    for part in value:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ValueError("each content part must be an object with a 'type'")
        if part["type"] != "text":
            raise ValueError(f"content parts of type {part['type']!r} are not supported; only 'text' parts are")
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise ValueError("a text content part must be {'type': 'text', 'text': <string>}")
        texts.append(part["text"])
    return "\n".join(texts)


StopField = Annotated[
    str | list[str] | None, PlainValidator(_check_stop, json_schema_input_type=str | list[str] | None)
]
PromptField = Annotated[
    str | list[str] | list[int] | list[list[int]],
    PlainValidator(_check_prompt, json_schema_input_type=str | list[str] | list[int] | list[list[int]]),
]
ContentField = Annotated[
    str | None,
    PlainValidator(_check_content, json_schema_input_type=str | list[dict[str, Any]] | None),
]


# ---------------------------------------------------------------------- shared fields
class StreamOptions(_Strict):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # ignored: padding against length side channels


class _SamplingRequest(_Strict):
    """Parameters both generation endpoints accept."""

    model: str | None = None  # None: the served model
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None  # None: up to the context length
    stop: StopField = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Accepted and ignored: they do not change what is generated.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM's extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    # vLLM's scheduling and cache isolation extras (docs/scheduling.md).
    priority: int = 0  # lower runs first; non-zero needs --scheduling-policy priority or fair
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs / guided_* (one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        if self.n > MAX_N:
            raise bad_request(f"Invalid value for 'n': at most {MAX_N}, got {self.n}.", param="n",
                              code="invalid_value")
        if self.stream_options is not None and not self.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true.", param="stream_options")

    def structured_output(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The constraint the request asks for and the parameter that asked (400 on conflicts)."""
        guided = {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                  "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}  # fmt: skip
        return structured.resolve(self.response_format, self.structured_outputs, guided)

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise bad_request(
                    f"Invalid value for 'logit_bias': keys must be token ids, got {key!r}.", param="logit_bias"
                ) from None
        return bias

    def _sampling_kwargs(self, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The request's sampling fields over ``defaults`` (the model's own, e.g. an Ollama
        model's params layer; its max_tokens is ``_max_tokens``' business)."""
        fields = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "logit_bias": self._logit_bias(), "stop": self.stop, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos, "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }  # fmt: skip
        # Leave absent ones out so the model's or SamplingParams' own defaults apply.
        base = {k: v for k, v in (defaults or {}).items() if k != "max_tokens"}
        return base | {k: v for k, v in fields.items() if v is not None}

    @staticmethod
    def _default_max_tokens(room: int, defaults: Mapping[str, Any] | None) -> int:
        """Without max_tokens: the room the context leaves, at most the model's default."""
        limit = (defaults or {}).get("max_tokens")
        return min(room, limit) if limit is not None else room


def make_sampling_params(kwargs: dict[str, Any], api_names: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams(**kwargs); its ValueError (which starts with the field name) becomes a 400."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        message = str(e)
        field = message.split(" ", 1)[0]
        param = (api_names or {}).get(field, field)
        if param != field:
            message = param + message[len(field):]
        raise bad_request(message, param=param, code="invalid_value") from None


# ---------------------------------------------------------------------- /v1/completions
class CompletionRequest(_SamplingRequest):
    prompt: PromptField
    best_of: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    logprobs: int | None = None  # number of top alternatives per position

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise unsupported("echo", "is not supported by this server")
        if self.suffix:
            raise unsupported("suffix", "is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            # best_of > n would need sequence scoring; best_of < n is invalid anywhere.
            raise unsupported("best_of", "other than n is not supported")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list: each entry is its own set of n choices."""
        if isinstance(self.prompt, str) or _is_token_list(self.prompt):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]  # a list of strings or of token lists

    def to_sampling_params(
        self, default_max_tokens: int, structured_outputs: StructuredOutputsParams | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> SamplingParams:
        kwargs = self._sampling_kwargs(defaults)
        kwargs["structured_outputs"] = structured_outputs
        kwargs["max_tokens"] = (self.max_tokens if self.max_tokens is not None
                                else self._default_max_tokens(default_max_tokens, defaults))
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
        return make_sampling_params(kwargs)


# ---------------------------------------------------------------------- /v1/chat/completions
class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: ContentField = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # Clients echo earlier assistant messages back with these; they carry nothing for the prompt.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _content_needed(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs 'content'")
        return self

    def to_template_dict(self) -> dict[str, Any]:
        # "developer" is OpenAI's new name for "system"; chat templates only know the latter.
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.content}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoiceField = None
    parallel_tool_calls: bool | None = None  # with tool_choice "required": whether several calls may come
    prompt_cache_key: str | None = None  # ignored: a routing hint; prefix caching is automatic
    safety_identifier: str | None = None  # ignored
    # OpenAI fields that would change the output and are not implemented: rejected unless unset.
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None
    verbosity: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("functions", "function_call", "audio", "prediction", "reasoning_effort",
                     "web_search_options", "verbosity"):  # fmt: skip
            if getattr(self, name) is not None:
                raise unsupported(name, "is not supported by this server")
        if self.modalities is not None and self.modalities != ["text"]:
            raise unsupported("modalities", "other than ['text'] are not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict() for m in self.messages]

    def tool_plan(self) -> ToolPlan:
        """What to do with the tools (400 for an inconsistent tools / tool_choice / response format)."""
        plan = plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
        if plan.forced:
            _, param = self.structured_output()
            if param is not None:
                raise bad_request(
                    f"'{param}' cannot be combined with a forced tool call (tool_choice "
                    f"{plan.named or plan.mode!r}): both constrain the whole output.", param=param,
                )  # fmt: skip
        return plan

    def to_sampling_params(
        self, default_max_tokens: int, structured_outputs: StructuredOutputsParams | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> SamplingParams:
        kwargs = self._sampling_kwargs(defaults)
        kwargs["structured_outputs"] = structured_outputs
        names: dict[str, str] = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            kwargs["max_tokens"] = self.max_completion_tokens
            names["max_tokens"] = "max_completion_tokens"
        elif self.max_tokens is not None:
            kwargs["max_tokens"] = self.max_tokens
        else:
            kwargs["max_tokens"] = self._default_max_tokens(default_max_tokens, defaults)
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        return make_sampling_params(kwargs, names)


# ---------------------------------------------------------------------- /tokenize, /detokenize
class TokenizeRequest(_Strict):
    """Either ``prompt`` (encoded as /v1/completions would) or ``messages`` (as /v1/chat/completions would)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


__all__ = [
    "APIError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "DetokenizeRequest",
    "StreamOptions", "TokenizeRequest", "make_sampling_params",
]  # fmt: skip


# ---------------------------------------------------------------------- LoRA adapters at run time
class LoadLoRAAdapterRequest(_Strict):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Strict):
    """POST /v1/unload_lora_adapter (vLLM's body); ``lora_int_id``, if given, must match."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
