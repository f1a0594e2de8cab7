"""Request parsing, validation and the SamplingParams mapping of the OpenAI API (no server)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from pagoda.entrypoints.openai.errors import APIError, validation_error_to_api_error
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def api_error_of(model: type[BaseModel], data: dict[str, Any]) -> APIError:
    """What the server answers for a body that fails validation (the body-level error conversion)."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    return validation_error_to_api_error(RequestValidationError(errors))


# ---------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt: Any, expected: list[Any]) -> None:
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", [[], [1, "a"], [[1], "a"], 5, [True], None, [[1.5]]])
def test_completion_prompt_rejected(prompt: Any) -> None:
    err = api_error_of(CompletionRequest, {"prompt": prompt})
    assert err.status == 400 and err.param == "prompt"


def test_prompt_is_required() -> None:
    err = api_error_of(CompletionRequest, {})
    assert err.param == "prompt" and err.message == "Missing required parameter: 'prompt'."


def test_unknown_field_names_it() -> None:
    err = api_error_of(ChatCompletionRequest, {"messages": USER, "prompt_logprob": 1})
    assert err.param == "prompt_logprob" and err.code == "unknown_parameter"
    assert "prompt_logprob" in err.message


def test_strict_types() -> None:
    # OpenAI rejects a string where a number belongs, and so do we (pydantic would coerce it).
    assert api_error_of(ChatCompletionRequest, {"messages": USER, "temperature": "0.5"}).param == "temperature"
    assert api_error_of(ChatCompletionRequest, {"messages": USER, "n": True}).param == "n"
    assert api_error_of(ChatCompletionRequest, {"messages": USER, "max_tokens": 2.5}).param == "max_tokens"
    assert chat(temperature=1).temperature == 1.0  # an int is a fine number


def test_ignored_fields_are_accepted() -> None:
    req = chat(user="u1", metadata={"k": "v"}, store=False, service_tier="auto", parallel_tool_calls=True,
               prompt_cache_key="abc", safety_identifier="s", stream=True,
               stream_options={"include_usage": True, "include_obfuscation": False})  # fmt: skip
    req.check_supported()
    assert req.include_usage


def test_content_parts_joined() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    )
    assert req.template_messages() == [{"role": "user", "content": "a\nb"}]


def test_unknown_and_malformed_parts_rejected() -> None:
    err = api_error_of(
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]},
    )
    assert err.param == "messages.[0].content"
    assert "'input_audio' are not supported" in err.message
    assert not err.message.startswith("Invalid value for 'messages.[0].content': Value error")
    for part in ({"type": "image_url", "image_url": "x"}, {"type": "image_url", "image_url": {"url": 1}},
                 {"type": "image_url", "image_url": {"url": "x", "size": 3}}):
        err = api_error_of(ChatCompletionRequest, {"messages": [{"role": "user", "content": [part]}]})
        assert err.param == "messages.[0].content" and "an image_url content part must be" in err.message


def test_image_parts_kept_as_parts() -> None:
    """Image parts stay parts (the chat serving reads the images); text-only lists still join."""
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:,", "detail": "low"}}]
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})
    assert req.template_messages() == [{"role": "user", "content": parts}]


def test_message_roles_and_fields() -> None:
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "hi", "name": "bob"},
        {"role": "assistant", "content": "hello", "refusal": None, "annotations": [], "audio": None},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ]})  # fmt: skip
    msgs = req.template_messages()
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1]["name"] == "bob"
    assert msgs[3]["tool_calls"] and msgs[3]["content"] is None
    assert msgs[4]["tool_call_id"] == "1"
    # As vLLM: any role name (the template decides), extra keys kept for the template.
    custom = ChatCompletionRequest.model_validate({"messages": [{"role": "robot", "content": "x", "mood": "calm"}]})
    assert custom.template_messages() == [{"role": "robot", "content": "x", "mood": "calm"}]
    assert api_error_of(ChatCompletionRequest, {"messages": [{"role": 7, "content": "x"}]}).param == (
        "messages.[0].role"
    )
    assert api_error_of(ChatCompletionRequest, {"messages": [{"role": "user"}]}).param == "messages.[0]"
    assert api_error_of(ChatCompletionRequest, {"messages": []}).param == "messages"


# ---------------------------------------------------------------------- supported / rejected
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_chat_unsupported(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        chat(**fields).check_supported()
    assert info.value.status == 400 and info.value.param == param


def test_chat_accepted_no_ops() -> None:
    """Fields accepted with values that change nothing: the request's sampling
    parameters are those of the same request without them."""
    plain = chat().to_sampling_params(default_max_tokens=100)
    for fields in ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
                   {"tool_choice": "auto"},
                   {"response_format": {"type": "text"}, "modalities": ["text"]}):
        req = chat(**fields)
        req.check_supported()
        assert req.to_sampling_params(default_max_tokens=100) == plain, fields
    chat(response_format={"type": "json_object"}).check_supported()  # structured output: see test_structured_request


@pytest.mark.parametrize(
    "fields, param",
    [({"suffix": "x"}, "suffix"), ({"best_of": 1, "n": 2}, "best_of"),
     ({"best_of": 3, "stream": True}, "best_of"), ({"stream": True, "use_beam_search": True}, "use_beam_search"),
     ({"length_penalty": 1.5}, "length_penalty"), ({"top_k": 3, "use_beam_search": True}, "top_k")],
)
def test_completion_unsupported(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        completion(**fields).check_supported()
    assert info.value.status == 400 and info.value.param == param
    assert param in info.value.message


def test_completion_accepted_no_ops() -> None:
    req = completion(echo=False, suffix=None, best_of=2, n=2)
    req.check_supported()
    assert req.to_sampling_params(default_max_tokens=100) == completion(n=2).to_sampling_params(default_max_tokens=100)


# ---------------------------------------------------------------------- SamplingParams mapping
def test_chat_sampling_params() -> None:
    req = chat(
        n=2, temperature=0.5, top_p=0.9, max_completion_tokens=7, stop="END", seed=3, presence_penalty=0.5,
        frequency_penalty=-0.5, logit_bias={"12": 5, "7": -100}, logprobs=True, top_logprobs=3, top_k=40,
        min_p=0.05, repetition_penalty=1.1, min_tokens=2, ignore_eos=True, stop_token_ids=[2],
        skip_special_tokens=False, include_stop_str_in_output=True,
    )  # fmt: skip
    p = req.to_sampling_params(default_max_tokens=100)
    assert (p.n, p.temperature, p.top_p, p.max_tokens, p.stop, p.seed) == (2, 0.5, 0.9, 7, ["END"], 3)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)
    assert p.logit_bias == {12: 5.0, 7: -100.0}
    assert p.logprobs == 3
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens) == (40, 0.05, 1.1, 2)
    assert p.ignore_eos and not p.skip_special_tokens and p.include_stop_str_in_output
    assert p.stop_token_ids == [2]


def test_defaults() -> None:
    p = chat().to_sampling_params(default_max_tokens=123)
    assert p.max_tokens == 123  # absent max_tokens: the room left in the context
    assert p.logprobs is None and p.n == 1 and p.temperature == 1.0 and p.stop == []
    assert chat(logprobs=True).to_sampling_params(5).logprobs == 0
    assert chat(max_tokens=9).to_sampling_params(5).max_tokens == 9
    assert completion(logprobs=2, max_tokens=4).to_sampling_params(50).logprobs == 2


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 200}}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": -2}, "top_logprobs"),  # > --max-logprobs: the engine's check
        ({"stop": ["a", ""]}, "stop"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_sampling_errors_name_the_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        chat(**fields).to_sampling_params(default_max_tokens=100)
    assert info.value.status == 400 and info.value.param == param
    assert param in info.value.message


def test_stop_type_checked() -> None:
    assert api_error_of(ChatCompletionRequest, {"messages": USER, "stop": 5}).param == "stop"
    assert chat(stop=["a", "b"]).to_sampling_params(5).stop == ["a", "b"]


# ---------------------------------------------------------------------- tokenize
def test_tokenize_requests() -> None:
    assert TokenizeRequest.model_validate({"prompt": "x"}).prompt == "x"
    assert TokenizeRequest.model_validate({"messages": USER}).messages is not None
    with pytest.raises(ValidationError):
        TokenizeRequest.model_validate({})
    with pytest.raises(ValidationError):
        TokenizeRequest.model_validate({"prompt": "x", "messages": USER})
    assert DetokenizeRequest.model_validate({"tokens": [1, 2]}).tokens == [1, 2]
    with pytest.raises(ValidationError):
        DetokenizeRequest.model_validate({"tokens": ["a"]})


def test_malformed_json_error() -> None:
    exc = RequestValidationError(
        [{"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode error", "input": {}, "ctx": {"error": "x"}}]
    )
    err = validation_error_to_api_error(exc)
    assert err.status == 400 and err.code == "invalid_json" and err.param is None
    assert err.body()["error"].keys() == {"message", "type", "param", "code"}


# ---------------------------------------------------------------------- logprobs formatting
def test_logprob_bytes_of_partial_utf8_tokens() -> None:
    from pagoda.entrypoints.openai.logprobs import LogprobFormatter
    from pagoda.outputs import Logprob
    from tests.e2e.fake_engine import load_tokenizer

    tokenizer = load_tokenizer()
    fmt = LogprobFormatter(tokenizer)
    ids = tokenizer.encode(" 😀", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's four bytes are split over byte-level tokens
    positions = [{t: Logprob(-float("inf") if i else -0.5, 1, None)} for i, t in enumerate(ids)]
    entries = fmt.chat(ids, positions, top_n=1)
    # Each token's text alone is not valid UTF-8, but its bytes are exact and join up.
    assert b"".join(bytes(e.bytes or []) for e in entries) == " 😀".encode()
    assert entries[1].logprob == -9999.0  # JSON has no -inf
    completion, offset = fmt.completion(ids, positions, 1, 0)
    assert completion.text_offset[0] == 0 and offset == sum(len(t) for t in completion.tokens)
