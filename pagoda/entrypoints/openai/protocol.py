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

from pagoda.engine.beam_search import BeamSearchParams
from pagoda.entrypoints.openai import structured
from pagoda.entrypoints.openai.errors import APIError, bad_request, unsupported
from pagoda.entrypoints.openai.structured import (
    ResponseFormat,
    StructuredOutputsRequest,
)
from pagoda.entrypoints.openai.tools import (
    ChatTool,
    ToolChoiceField,
    ToolPlan,
    plan_tools,
)
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


def _check_content(value: Any) -> str | list[dict[str, Any]] | None:
    """Text content as a string; a list of text parts is joined with newlines. A list with
    ``image_url`` parts stays a list of parts (the chat serving reads its images)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content parts")
    texts = []
    images = False
    for part in value:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ValueError("each content part must be an object with a 'type'")
        if part["type"] == "image_url":
            spec = part.get("image_url")
            if (set(part) != {"type", "image_url"} or not isinstance(spec, dict) or not isinstance(spec.get("url"), str)
                    or set(spec) - {"url", "detail"}):
                raise ValueError("an image_url content part must be {'type': 'image_url', 'image_url': "
                                 "{'url': <string>, 'detail': auto|low|high}}")
            images = True
            continue
        if part["type"] != "text":
            raise ValueError(f"content parts of type {part['type']!r} are not supported; only 'text' and "
                             "'image_url' parts are")
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise ValueError("a text content part must be {'type': 'text', 'text': <string>}")
        texts.append(part["text"])
    return value if images else "\n".join(texts)


StopField = Annotated[
    str | list[str] | None, PlainValidator(_check_stop, json_schema_input_type=str | list[str] | None)
]
PromptField = Annotated[
    str | list[str] | list[int] | list[list[int]],
    PlainValidator(_check_prompt, json_schema_input_type=str | list[str] | list[int] | list[list[int]]),
]
ContentField = Annotated[
    str | list[dict[str, Any]] | None,
    PlainValidator(_check_content, json_schema_input_type=str | list[dict[str, Any]] | None),
]


# ---------------------------------------------------------------------- shared fields
class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, usage on every chunk too
    include_obfuscation: bool | None = None  # ignored: padding against length side channels


# Fields whose effect beam search cannot give (it ranks whole sequences by logprob): a
# request that sets one with use_beam_search gets a 400 rather than having it ignored.
_NOT_WITH_BEAM = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "logit_bias", "seed", "stop", "stop_token_ids", "min_tokens", "response_format",
                  "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "prompt_logprobs", "logprob_token_ids", "kv_transfer_params", "bad_words",
                  "allowed_token_ids", "vllm_xargs")  # fmt: skip


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
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's: arguments for the server's logits processors (--logits-processors), SamplingParams.extra_args.
    vllm_xargs: dict[str, str | int | float | bool] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # vLLM's response extras: the prompt's and each choice's token ids; logprob tokens as "token_id:N".
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: keep only N prompt tokens (-1: as many as max_model_len allows), the last N
    # (truncation_side "left", the default) or the first N ("right").
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs / guided_* (one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's logprob extras and beam search (docs/logprobs.md).
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool | None = None
    # Prefill-decode disaggregation (vLLM's field; pagoda/config/kv_transfer.py): set by `pagoda router`.
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def stream_usage(self, force: bool = False) -> tuple[bool, bool]:
        """(usage in a last chunk, usage on every chunk), as vLLM decides them: ``force``
        (--enable-force-include-usage) turns the first on whatever stream_options say."""
        include = self.include_usage or force
        continuous = include and bool(self.stream_options and self.stream_options.continuous_usage_stats)
        return include, continuous

    def check_supported(self) -> None:
        if self.n > MAX_N:
            raise bad_request(f"Invalid value for 'n': at most {MAX_N}, got {self.n}.", param="n",
                              code="invalid_value")
        if self.stream_options is not None and not self.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("'prompt_logprobs' cannot be combined with 'stream'.", param="prompt_logprobs")
        if self.truncate_prompt_tokens is not None and (
            self.truncate_prompt_tokens == 0 or self.truncate_prompt_tokens < -1
        ):
            raise bad_request("Invalid value for 'truncate_prompt_tokens': it must be -1 (up to max_model_len) or "
                              f"a positive number of tokens, got {self.truncate_prompt_tokens}.",
                              param="truncate_prompt_tokens", code="invalid_value")  # fmt: skip
        if self.truncation_side is not None and self.truncate_prompt_tokens is None:
            raise bad_request("'truncation_side' applies only with 'truncate_prompt_tokens' (which side of the "
                              "prompt a truncation cuts).", param="truncation_side")  # fmt: skip
        if self.use_beam_search:
            self._check_beam_search()
        else:
            for name in ("length_penalty", "early_stopping"):
                if getattr(self, name) is not None:
                    raise bad_request(f"'{name}' applies only to beam search ('use_beam_search': true).",
                                      param=name)  # fmt: skip

    def _check_beam_search(self) -> None:
        if self.stream:
            raise bad_request("'use_beam_search' cannot be combined with 'stream': the beams are ranked only "
                              "once they are complete.", param="use_beam_search")  # fmt: skip
        for name in _NOT_WITH_BEAM:
            if getattr(self, name) is not None:
                raise bad_request(f"'{name}' cannot be combined with 'use_beam_search'.", param=name)

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """Beam search with ``n`` beams (vLLM's server: beam_width = n), returning all n."""
        kwargs: dict[str, Any] = {"beam_width": self.n, "max_tokens": max_tokens}
        for name in ("temperature", "ignore_eos", "length_penalty", "early_stopping", "include_stop_str_in_output"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        try:
            return BeamSearchParams(**kwargs)
        except ValueError as e:
            field = str(e).split(" ", 1)[0]
            raise bad_request(str(e), param=field, code="invalid_value") from None

    def structured_output(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The constraint the request asks for and the parameter that asked (400 on conflicts)."""
        guided = {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                  "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}  # fmt: skip
        return structured.resolve(self.response_format, self.structured_outputs, guided)

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bias: dict[int, float] = {}
        bad: list[str] = []
        for key, value in self.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                bad.append(key)
        if bad:
            # Every offending key at once (vLLM's words), so one retry can fix them all.
            raise bad_request(
                f"Found token_id(s) {', '.join(repr(k) for k in bad)} in logit_bias, but token_id must be an "
                "integer or string representing an integer.", param="logit_bias", code="invalid_value",
            )  # fmt: skip
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
            "prompt_logprobs": self.prompt_logprobs, "logprob_token_ids": self.logprob_token_ids,
            "kv_transfer_params": self.kv_transfer_params, "bad_words": self.bad_words,
            "allowed_token_ids": self.allowed_token_ids, "extra_args": self.vllm_xargs,
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
        if self.suffix:
            raise unsupported("suffix", "is not supported by this server")
        if self.best_of is not None:
            if self.best_of < self.n:
                raise bad_request(f"'best_of' must be >= 'n' ({self.n}), got {self.best_of}.", param="best_of",
                                  code="invalid_value")  # fmt: skip
            if self.best_of > MAX_N:
                raise bad_request(f"Invalid value for 'best_of': at most {MAX_N}, got {self.best_of}.",
                                  param="best_of", code="invalid_value")  # fmt: skip
            if self.best_of > self.n and self.stream:
                raise bad_request("'best_of' > 'n' cannot be combined with 'stream': which samples are returned "
                                  "is known only when all are complete.", param="best_of")  # fmt: skip
            if self.best_of != self.n and self.use_beam_search:
                raise bad_request("With 'use_beam_search', 'n' is the beam width; 'best_of' must be unset or "
                                  "equal to it.", param="best_of")  # fmt: skip
        if self.logprob_token_ids is not None and self.logprobs is None:
            raise bad_request("'logprob_token_ids' requires 'logprobs'.", param="logprob_token_ids")
        if self.use_beam_search and (self.echo or self.logprobs is not None):
            name = "echo" if self.echo else "logprobs"
            raise bad_request(f"'{name}' cannot be combined with 'use_beam_search'.", param=name)
        if (self.echo and self.logprobs is not None and self.prompt_logprobs is not None
                and self.prompt_logprobs != self.logprobs):
            raise bad_request("With 'echo', 'logprobs' also sets the prompt tokens' logprobs; 'prompt_logprobs' "
                              "must be unset or equal to it.", param="prompt_logprobs")  # fmt: skip

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
            if self.echo:  # the echoed prompt tokens come with their logprobs, as OpenAI's
                kwargs["prompt_logprobs"] = self.logprobs
        if self.best_of is not None and self.best_of != self.n and not self.use_beam_search:
            kwargs["best_of"] = self.best_of
        return make_sampling_params(kwargs, {"extra_args": "vllm_xargs"})


# ---------------------------------------------------------------------- /v1/chat/completions
class ChatMessage(BaseModel):
    """One message. As in vLLM, any role name is accepted (the chat template decides what it
    means) and keys beyond OpenAI's are kept and handed to the template with the message
    (templates read e.g. ``reasoning_content``); the known keys are checked strictly."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str = Field(min_length=1)
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
        out: dict[str, Any] = {**(self.model_extra or {}), "role": role, "content": self.content}
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
    # vLLM's: at most this many tokens of reasoning (with --reasoning-parser; thinking_budget.py).
    thinking_token_budget: int | None = Field(default=None, ge=1)
    # GPT-OSS's reasoning level (low, medium, high), or a chat template's reasoning_effort variable
    # (serving_chat.py ChatServing.effort_kwargs; a 400 for a model that has neither).
    reasoning_effort: str | None = None
    prompt_cache_key: str | None = None  # ignored: a routing hint; prefix caching is automatic
    safety_identifier: str | None = None  # ignored
    # OpenAI fields that would change the output and are not implemented: rejected unless unset.
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: str | None = None
    # vLLM's chat template controls.
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template (enable_thinking...)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    # vLLM's: the reply's content starts with the last message's when that message has the
    # reply's role (with continue_final_message: the assistant text being continued).
    echo: bool = False

    def echo_text(self) -> str:
        """What ``echo`` puts before each choice's content ("" when off or the roles differ)."""
        if not self.echo:
            return ""
        last = self.template_messages()[-1]
        role = "assistant" if self.add_generation_prompt else last.get("role")
        content = last.get("content")
        if last.get("role") != role or not content:
            return ""
        if isinstance(content, str):
            return content
        return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")

    def check_supported(self) -> None:
        super().check_supported()
        check_template_options(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs)
        for name in ("functions", "function_call", "audio", "prediction", "web_search_options", "verbosity"):
            if getattr(self, name) is not None:
                raise unsupported(name, "is not supported by this server")
        if self.modalities is not None and self.modalities != ["text"]:
            raise unsupported("modalities", "other than ['text'] are not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
        if self.logprob_token_ids is not None and not self.logprobs:
            raise bad_request("'logprob_token_ids' requires 'logprobs' to be true.", param="logprob_token_ids")
        if self.use_beam_search and self.logprobs:
            raise bad_request("'logprobs' cannot be combined with 'use_beam_search'.", param="logprobs")

    def check_thinking_budget(self, reasoning_parser: bool, constrained: bool) -> None:
        """What a thinking budget cannot be combined with (it runs as two engine requests)."""
        if self.thinking_token_budget is None:
            return
        if not reasoning_parser:
            raise unsupported("thinking_token_budget", "needs a reasoning parser; start the server with "
                                                       "--reasoning-parser for a reasoning model")  # fmt: skip
        clashes = {"n > 1": self.n > 1, "logprobs": bool(self.logprobs),
                   "structured output or a forced tool call": constrained,
                   "kv_transfer_params": self.kv_transfer_params is not None}  # fmt: skip
        for what, clash in clashes.items():
            if clash:
                raise unsupported("thinking_token_budget", f"cannot be combined with {what}: the reasoning is "
                                                           "ended by a second engine request")  # fmt: skip

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
        names: dict[str, str] = {"logprobs": "top_logprobs", "extra_args": "vllm_xargs"}
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


# ---------------------------------------------------------------------- /v1/chat/completions/batch
ConversationField = Annotated[list[ChatMessage], Field(min_length=1)]


class BatchChatCompletionRequest(ChatCompletionRequest):
    """POST /v1/chat/completions/batch (vLLM's): a chat request whose ``messages`` is a list of
    conversations. Each runs as its own engine request under the request's other fields, and
    the answer is one chat completion whose choice i is conversation i's reply (its
    ``token_ids``, ``prompt_token_ids`` and ``prompt_logprobs`` on the choice), usage summed.
    As vLLM's route it answers in one JSON body and with one reply per conversation: ``stream``,
    ``n`` > 1, beam search and tools are 400s, and so are a thinking budget (it runs a request
    as two engine requests) and ``kv_transfer_params`` (a transfer is one sequence's blocks)."""

    messages: list[ConversationField] = Field(min_length=1)  # type: ignore[assignment]

    def check_supported(self) -> None:
        route = "/v1/chat/completions/batch"
        refused = {
            "stream": (bool(self.stream), f"is not supported by {route}: the replies come in one JSON response"),
            "n": (self.n != 1, f"must be 1 on {route}: choice i is conversation i's one reply"),
            "use_beam_search": (self.use_beam_search, f"is not supported by {route}"),
            "tools": (self.tools is not None, f"are not supported by {route}"),
            "tool_choice": (self.tool_choice not in (None, "none"), f"must be 'none' on {route} (it takes no tools)"),
            "thinking_token_budget": (self.thinking_token_budget is not None, f"is not supported by {route}"),
            "kv_transfer_params": (self.kv_transfer_params is not None,
                                   f"is not supported by {route}: one transfer cannot serve several conversations"),
        }  # fmt: skip
        for name, (refuse, why) in refused.items():
            if refuse:
                raise unsupported(name, why)
        super().check_supported()

    def conversation(self, index: int) -> ChatCompletionRequest:
        """Conversation ``index`` as a chat request of its own, every other field shared (all
        of them were checked when this request was)."""
        fields = {name: getattr(self, name) for name in ChatCompletionRequest.model_fields}
        fields["messages"] = self.messages[index]
        return ChatCompletionRequest.model_construct(self.model_fields_set, **fields)


# ---------------------------------------------------------------------- /tokenize, /detokenize
class TokenizeRequest(_Strict):
    """Either ``prompt`` (encoded as /v1/completions would) or ``messages`` (as /v1/chat/completions
    would, with the same ``tools`` and template options)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool | None = False  # also each token's text (vLLM's token_strs)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self

    def check_supported(self) -> None:
        if self.prompt is not None:
            for name in ("continue_final_message", "chat_template_kwargs", "tools"):
                if getattr(self, name):
                    raise bad_request(f"'{name}' applies to 'messages', not to 'prompt'.", param=name)
            return
        check_template_options(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs)


# Template variables the server sets itself; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                         "chat_template", "documents", "tokenize"})  # fmt: skip


def check_template_options(add_generation_prompt: bool, continue_final_message: bool,
                           chat_template_kwargs: dict[str, Any] | None) -> None:  # fmt: skip
    if continue_final_message and add_generation_prompt:
        # vLLM's rule and words: the default add_generation_prompt=true must be turned off.
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                          param="continue_final_message")  # fmt: skip
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(chat_template_kwargs or {}))
    if reserved:
        raise bad_request(f"'chat_template_kwargs' may not set {', '.join(reserved)}: the request's own fields "
                          "set them.", param="chat_template_kwargs")  # fmt: skip


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


__all__ = [
    "APIError", "BatchChatCompletionRequest", "ChatCompletionRequest", "ChatMessage", "CompletionRequest",
    "DetokenizeRequest",
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
