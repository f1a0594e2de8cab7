"""Request bodies of Ollama's API, and ``options`` mapped onto SamplingParams.

Every model forbids unknown fields (a misspelt option is a 400 naming it, where Ollama
itself would log a warning and carry on). Which of Ollama's options do what here is
listed in the package docstring (``pagoda/entrypoints/ollama/__init__.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, field_validator

from pagoda.entrypoints.openai.errors import APIError, bad_request
from pagoda.entrypoints.openai.protocol import StopField, make_sampling_params
from pagoda.entrypoints.openai.structured import (
    JsonSchemaFormat,
    ResponseFormat,
    from_response_format,
)
from pagoda.entrypoints.openai.tools import ChatTool
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

# Ollama's defaults (its documented Modelfile parameters), so that a client that leaves
# them out samples as it would against Ollama. Ollama's repeat_penalty 1.1 applies to the
# last 64 tokens only; pagoda's penalties see the whole sequence, so it stays off (1.0).
DEFAULT_SAMPLING: dict[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ---------------------------------------------------------------------- options
class Options(_Strict):
    """``options``: sampling settings, and the runner settings Ollama takes per request."""

    # Sampling, mapped onto SamplingParams.
    num_predict: int | None = None  # -1: until a stop or the end of the context
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_last_n: int | None = None
    stop: StopField = None
    seed: int | None = None
    num_ctx: int | None = None  # a bound on prompt + output
    # Samplers pagoda does not have: accepted only at their "off" value.
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None
    # No per-request effect: the engine was configured when the server started.
    num_keep: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    embedding_only: bool | None = None

    def check_supported(self) -> None:
        """400 for a sampler pagoda does not implement, set to anything but its "off" value."""
        off: dict[str, Any] = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}
        for name, neutral in off.items():
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise option_error(name, f"is not supported by this server (only {neutral!r}, which turns it off)")
        if self.penalize_newline:
            raise option_error("penalize_newline", "is not supported by this server (only false)")
        if self.num_predict is not None and (self.num_predict < -1 or self.num_predict == 0):
            raise option_error("num_predict", f"must be -1 (no limit) or >= 1, got {self.num_predict}")
        if self.num_ctx is not None and self.num_ctx < 1:
            raise option_error("num_ctx", f"must be >= 1, got {self.num_ctx}")

    def context_bound(self, max_model_len: int) -> int:
        """num_ctx, capped at the engine's context length (as Ollama caps it at the model's)."""
        return max_model_len if self.num_ctx is None else min(self.num_ctx, max_model_len)

    def penalties_active(self) -> bool:
        return (self.repeat_penalty not in (None, 1.0) or self.presence_penalty not in (None, 0.0)
                or self.frequency_penalty not in (None, 0.0))  # fmt: skip

    def sampling_kwargs(self, context_bound: int, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """SamplingParams fields (without max_tokens and structured output): the options set,
        else the model's own defaults (an Ollama model's params layer), else Ollama's."""
        kwargs = {**DEFAULT_SAMPLING, **{k: v for k, v in (defaults or {}).items() if k != "max_tokens"}}
        fields = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p,
                  "seed": self.seed, "stop": self.stop}  # fmt: skip
        kwargs.update({k: v for k, v in fields.items() if v is not None})
        window = self.repeat_last_n
        if window == 0:
            return kwargs  # Ollama's "0 = disabled": no penalties
        if window is not None and window != -1 and window < context_bound and self.penalties_active():
            raise option_error(
                "repeat_last_n", f"must be -1, 0 or at least num_ctx ({context_bound}) when a penalty is set: "
                "pagoda's penalties look at the whole sequence, not a window of the last tokens",
            )  # fmt: skip
        penalties = {"repetition_penalty": self.repeat_penalty, "presence_penalty": self.presence_penalty,
                     "frequency_penalty": self.frequency_penalty}  # fmt: skip
        kwargs.update({k: v for k, v in penalties.items() if v is not None})
        return kwargs


# SamplingParams' field names -> the option a 400 names.
_OPTION_NAMES = {"repetition_penalty": "options.repeat_penalty", "max_tokens": "options.num_predict",
                 **{f: f"options.{f}" for f in ("temperature", "top_k", "top_p", "min_p", "seed", "stop",
                                                 "presence_penalty", "frequency_penalty")}}  # fmt: skip


def option_error(name: str, what: str) -> APIError:
    return bad_request(f"option '{name}' {what}", param=f"options.{name}", code="invalid_value")


# ---------------------------------------------------------------------- shared fields
# A Go duration ("5m", "1h30m", "-1s") or a number of seconds, as Ollama parses keep_alive.
_DURATION = re.compile(r"^-?(\d+(\.\d*)?|\.\d+)((ns|us|µs|ms|s|m|h)(\d+(\.\d*)?|\.\d+)?)*$")


def _check_keep_alive(value: Any) -> float | str | None:
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value  # type: ignore[no-any-return]
    if isinstance(value, str) and _DURATION.match(value.strip()):
        return value
    raise ValueError("must be a number of seconds or a duration such as '5m' or '-1'")


def _check_format(value: Any) -> str | dict[str, Any] | None:
    if value is None or value in ("", "json") or isinstance(value, dict):
        return value  # type: ignore[no-any-return]
    raise ValueError("must be \"json\" or a JSON schema object")


def _check_think(value: Any) -> bool | str | None:
    if value is None or isinstance(value, (bool, str)):
        return value  # type: ignore[no-any-return]
    raise ValueError("must be a boolean or one of 'low', 'medium', 'high'")


KeepAliveField = Annotated[float | str | None, PlainValidator(_check_keep_alive, json_schema_input_type=float | str | None)]
FormatField = Annotated[str | dict[str, Any] | None,
                        PlainValidator(_check_format, json_schema_input_type=str | dict[str, Any] | None)]  # fmt: skip
ThinkField = Annotated[bool | str | None, PlainValidator(_check_think, json_schema_input_type=bool | str | None)]


class GenerationRequest(_Strict):
    """What /api/generate and /api/chat share."""

    model: str = Field(min_length=1)
    stream: bool | None = True  # Ollama streams unless told not to
    format: FormatField = None
    options: Options | None = None
    keep_alive: KeepAliveField = None  # accepted: the model is always loaded
    think: ThinkField = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    truncate: bool | None = None  # Ollama's: cut a prompt longer than num_ctx; pagoda answers 400
    shift: bool | None = None  # Ollama's context shifting; pagoda never shifts

    def template_kwargs(self) -> dict[str, Any] | None:
        """``think`` as the chat templates that switch thinking read it (Qwen3's enable_thinking)."""
        return None if self.think is None else {"enable_thinking": bool(self.think)}

    def check_common(self) -> None:
        if isinstance(self.think, str):
            raise bad_request("'think' levels ('low', 'medium', 'high') are for models that take them (GPT-OSS); "
                              "send true or false.", param="think", code="unsupported_parameter")  # fmt: skip
        if self.truncate:
            raise bad_request("'truncate' is not supported: a prompt longer than num_ctx is an error here.",
                              param="truncate", code="unsupported_parameter")  # fmt: skip
        if self.shift:
            raise bad_request("'shift' is not supported: generation stops at the end of the context.",
                              param="shift", code="unsupported_parameter")  # fmt: skip
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
        if self.options is not None:
            self.options.check_supported()

    @property
    def opts(self) -> Options:
        return self.options or Options()

    def structured_output(self) -> StructuredOutputsParams | None:
        """``format``: "json" is any JSON object; an object is a JSON schema."""
        if not self.format:
            return None
        if self.format == "json":
            return from_response_format(ResponseFormat(type="json_object"))
        assert isinstance(self.format, dict)
        schema = JsonSchemaFormat(name="format", schema=self.format)
        return from_response_format(ResponseFormat(type="json_schema", json_schema=schema))

    def to_sampling_params(self, prompt_len: int, max_model_len: int, structured: StructuredOutputsParams | None,
                           defaults: Mapping[str, Any] | None = None) -> SamplingParams:  # fmt: skip
        """The request's SamplingParams: num_predict (else the model's default), bounded by what
        num_ctx leaves after the prompt; ``defaults``: the model's own (ModelDefaults.sampling)."""
        opts = self.opts
        bound = opts.context_bound(max_model_len)
        if opts.num_ctx is not None and prompt_len >= bound:
            raise option_error("num_ctx", f"is {bound}, and the prompt alone is {prompt_len} tokens: raise num_ctx "
                               "or shorten the prompt (pagoda does not truncate prompts)")  # fmt: skip
        room = max(bound - prompt_len, 1)  # no room at all: the engine's own context length error
        num_predict = opts.num_predict if opts.num_predict is not None else (defaults or {}).get("max_tokens")
        max_tokens = room if num_predict in (None, -1) else min(num_predict, room)  # type: ignore[type-var]
        kwargs = opts.sampling_kwargs(bound, defaults)
        kwargs.update(max_tokens=max_tokens, structured_outputs=structured)
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        return make_sampling_params(kwargs, {**_OPTION_NAMES, "logprobs": "top_logprobs"})


# ---------------------------------------------------------------------- /api/generate
class GenerateRequest(GenerationRequest):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[str] | None = None
    # Image generation (Ollama's experimental image models): not a text model's job.
    width: int | None = None
    height: int | None = None
    steps: int | None = None

    def check_supported(self) -> None:
        self.check_common()
        if self.suffix:
            raise bad_request("'suffix' (fill-in-the-middle) is not supported by this server.", param="suffix",
                              code="unsupported_parameter")  # fmt: skip
        if self.template:
            raise bad_request("'template' is not supported: pagoda renders prompts with the model's own chat "
                              "template (a Jinja template); send 'raw': true with a prompt you formatted yourself.",
                              param="template", code="unsupported_parameter")  # fmt: skip
        if self.images and self.raw:
            raise bad_request("'images' cannot be combined with 'raw': the model's template places them.",
                              param="images")  # fmt: skip
        for name in ("width", "height", "steps"):
            if getattr(self, name) is not None:
                raise bad_request(f"'{name}' is for image generation, which this server does not do.",
                                  param=name, code="unsupported_parameter")  # fmt: skip
        if self.raw and self.system:
            raise bad_request("'system' cannot be combined with 'raw': a raw prompt is used exactly as sent.",
                              param="system")  # fmt: skip


def image_parts(images: list[str] | None, text: str) -> str | list[dict[str, Any]]:
    """A message's content: its text, or with ``images`` (base64) the images' parts first, then
    the text (pagoda/multimodal/prompts.py reads them)."""
    if not images:
        return text
    return [*({"type": "image_base64", "image_base64": b64} for b64 in images), {"type": "text", "text": text}]


# ---------------------------------------------------------------------- /api/chat
class ToolCallFunction(_Strict):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None  # Ollama numbers the calls of one message


class ToolCall(_Strict):
    function: ToolCallFunction
    id: str | None = None


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""  # the ollama client leaves out an empty content
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None

    @field_validator("thinking")
    @classmethod
    def _no_thinking(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("'thinking' is not supported by this server yet")
        return value

    def to_template_dict(self, index: int) -> dict[str, Any]:
        """The message in the OpenAI shape pagoda's chat helpers take (tools.py)."""
        out: dict[str, Any] = {"role": self.role, "content": image_parts(self.images, self.content)}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": call.id or f"call_{index}_{i}", "type": "function",
                 "function": {"name": call.function.name, "arguments": call.function.arguments}}
                for i, call in enumerate(self.tool_calls)
            ]  # fmt: skip
        if self.role == "tool":
            if self.tool_name is not None:
                out["name"] = self.tool_name
            if self.tool_call_id is not None:
                out["tool_call_id"] = self.tool_call_id
        return out


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(default_factory=list)
    tools: list[ChatTool] | None = None

    def check_supported(self) -> None:
        self.check_common()

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict(i) for i, m in enumerate(self.messages)]


# ---------------------------------------------------------------------- model management
class ShowRequest(_Strict):
    model: str | None = Field(default=None, min_length=1)
    name: str | None = Field(default=None, min_length=1)  # the older spelling of ``model``
    verbose: bool | None = None  # also the long arrays of the model's metadata (its vocabulary)
    system: str | None = None  # Ollama's deprecated per-show overrides: rejected
    template: str | None = None
    options: dict[str, Any] | None = None

    def model_name(self) -> str:
        for name in ("system", "template", "options"):
            if getattr(self, name) is not None:
                raise bad_request(f"'{name}' is not supported by /api/show.", param=name,
                                  code="unsupported_parameter")  # fmt: skip
        name = self.model or self.name
        if name is None:
            raise bad_request("model is required", param="model", code="missing_required_parameter")
        return name


class ManageRequest(BaseModel):
    """The body of /api/pull, /push, /create, /copy and /delete: never acted on, so not
    checked beyond being a JSON object."""

    model_config = ConfigDict(extra="allow")


__all__ = ["ChatRequest", "GenerateRequest", "ManageRequest", "Message", "Options", "ShowRequest", "ToolCall"]


# ---------------------------------------------------------------------- embeddings
class _EmbeddingFields(_Strict):
    model: str
    options: Options | None = None  # none has an effect on a vector: set ones are a 400
    keep_alive: KeepAliveField = None  # accepted: the model is always loaded

    def check_supported(self) -> None:
        used = sorted(self.options.model_dump(exclude_none=True)) if self.options is not None else []
        if used:
            raise bad_request(f"options {', '.join(used)} have no effect on embeddings; leave them out",
                              param="options")  # fmt: skip


class EmbedRequest(_EmbeddingFields):
    """/api/embed: ``input`` a string or a list of them; ``truncate`` (Ollama's default true)
    cuts an input longer than the context to its last tokens, false makes it a 400;
    ``dimensions`` where the model is Matryoshka (as /v1/embeddings)."""

    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None


class LegacyEmbeddingsRequest(_EmbeddingFields):
    """/api/embeddings, Ollama's older route: one ``prompt``, one ``embedding`` back."""

    prompt: str
