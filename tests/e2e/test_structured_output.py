"""Structured output and tool calling on the real server, real engine and default model
(SmolLM2-135M), through the openai client. One server for the module; small schemas and
max_tokens so that every constrained output completes."""

from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from pagoda.config import EngineConfig
from tests.e2e.server_utils import running_server

# Many long constrained generations on the real model: run by `make test-all`.
pytestmark = pytest.mark.slow

MODEL = "smollm2"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "job": {"enum": ["engineer", "artist", "doctor", "teacher", "farmer"]},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 2},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "floor": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}},
            "required": ["city", "floor"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "job", "rating", "hobbies", "home"],
    "additionalProperties": False,
}  # fmt: skip
SUBJECTS = [
    "a retired pilot", "a young painter", "a village doctor", "a chess teacher", "a rice farmer", "a robot engineer",
    "my grandmother", "a famous chef", "a marathon runner", "a shy poet", "a pirate captain", "a jazz drummer",
    "a museum guard", "a space tourist", "a bakery owner", "a math student", "a tired nurse", "a tennis coach",
    "a sculptor in Rome", "a beekeeper",
]  # fmt: skip

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                         "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
        "required": ["a", "b"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client():
    from pagoda.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_config(EngineConfig(show_progress=False, num_kv_blocks=1024, max_model_len=2048))
    with running_server(engine, served_model_name=MODEL, shutdown_engine=True) as running:
        with openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="x", max_retries=0, timeout=300) as c:
            yield c


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def concurrently(calls: list[Any]) -> list[Any]:
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda f: f(), calls))


def test_json_schema_nested(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(i: int, subject: str):
        return lambda: client.chat.completions.create(
            model=MODEL, messages=user(f"Describe {subject} as a JSON object."), response_format=fmt,
            max_tokens=128, temperature=0.8, seed=i,
        )

    for r in concurrently([ask(i, s) for i, s in enumerate(SUBJECTS)]):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_regex_choice_grammar(client: openai.OpenAI) -> None:
    def chat(prompt: str, **kwargs: Any):
        return lambda: client.chat.completions.create(
            model=MODEL, messages=user(prompt), max_tokens=48, temperature=0, **kwargs
        ).choices[0]

    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]{0,3}/\n'
    gbnf = 'root ::= ("yes" | "no") ", because " [a-z ]{1,20} "."\n'
    obj, date, pick, answer, because, vllm_choice = concurrently([
        chat("Give a JSON object with the name and age of Alice, who is 30.", response_format={"type": "json_object"}),
        chat("When did the Berlin wall fall? Answer with a date.",
             extra_body={"structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}}),
        chat("Is 'I love this movie!' positive or negative?", extra_body={"guided_choice": ["positive", "negative"]}),
        chat("What is 12 times 12?", extra_body={"structured_outputs": {"grammar": lark}}),
        chat("Is the sky blue?", extra_body={"guided_grammar": gbnf}),
        chat("Pick a color.", extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}}),
    ])  # fmt: skip
    assert isinstance(json.loads(obj.message.content), dict)
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.message.content)
    assert pick.message.content in ("positive", "negative")
    assert re.fullmatch(r"The answer is [1-9][0-9]{0,3}\.", answer.message.content)
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", because.message.content)
    assert vllm_choice.message.content in ("red", "green", "blue")
    assert all(c.finish_reason == "stop" for c in (obj, date, pick, answer, because, vllm_choice))
    comp = client.completions.create(model=MODEL, prompt="The year the first moon landing happened:", max_tokens=8,
                                     temperature=0, extra_body={"guided_regex": "[12][0-9]{3}"})  # fmt: skip
    assert re.fullmatch(r"[12][0-9]{3}", comp.choices[0].text)


def test_unconstrained_requests_unchanged_by_constrained_neighbours(client: openai.OpenAI) -> None:
    prompts = ["Name three fruits.", "What is the capital of Italy?", "Write a haiku about rain."]

    def plain(prompt: str):
        return lambda: client.chat.completions.create(
            model=MODEL, messages=user(prompt), max_tokens=32, temperature=0, logprobs=True
        ).choices[0]

    def constrained(subject: str):
        return lambda: client.chat.completions.create(
            model=MODEL, messages=user(f"Describe {subject}."), max_tokens=96, temperature=0.8,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        )

    alone = [plain(p)() for p in prompts]
    mixed = concurrently([constrained(s) for s in SUBJECTS[:4]] + [plain(p) for p in prompts])[4:]
    for a, m in zip(alone, mixed):
        assert m.message.content == a.message.content
        assert [t.token for t in m.logprobs.content] == [t.token for t in a.logprobs.content]


def _check_calls(message: Any, allowed: set[str]) -> list[tuple[str, dict]]:
    assert message.tool_calls, message.content
    calls = []
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_forced_tool_calls(client: openai.OpenAI) -> None:
    questions = ["What's the weather in Paris and in Rome?", "How warm is it in Tokyo right now, in fahrenheit?",
                 "What is 17 plus 25?", "Tell me a joke."]  # fmt: skip

    def ask(question: str, tool_choice: Any, **kwargs: Any):
        return lambda: client.chat.completions.create(
            model=MODEL, messages=user(question), tools=TOOLS, tool_choice=tool_choice, max_tokens=96,
            temperature=0.8, n=2, **kwargs,
        )

    named = {"type": "function", "function": {"name": "get_weather"}}
    runs = [ask(q, "required", parallel_tool_calls=False) for q in questions]  # exactly one call
    runs += [ask(q, named) for q in questions]  # one call of get_weather
    runs += [ask(q, "required") for q in questions[:2]]  # parallel_tool_calls defaults to true: one or more
    results = concurrently(runs)
    for i, r in enumerate(results):
        parallel = i >= 2 * len(questions)
        for choice in r.choices:
            # Several calls may run into max_tokens: the completed ones are still returned.
            assert choice.finish_reason == "tool_calls" or (parallel and choice.finish_reason == "length")
            named_run = len(questions) <= i < 2 * len(questions)
            calls = _check_calls(choice.message, {"get_weather"} if named_run else set(SCHEMAS))
            assert len(calls) == 1 or parallel


def test_streaming_tool_call_matches_non_streaming(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=user("What's the weather in Madrid?"), tools=TOOLS, max_tokens=96,
                  temperature=0, tool_choice="required")  # fmt: skip
    full = client.chat.completions.create(**kwargs)
    expected = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
    calls: dict[int, list[str]] = {}
    finish = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                assert d.index not in calls and d.function.name and d.type == "function"
                calls[d.index] = [d.function.name, d.function.arguments or ""]
            else:
                calls[d.index][1] += d.function.arguments
        if choice.finish_reason:
            finish.append(choice.finish_reason)
    assert [tuple(calls[i]) for i in sorted(calls)] == expected
    assert finish == ["tool_calls"]


def test_tool_round_trip(client: openai.OpenAI) -> None:
    messages: list[dict[str, Any]] = user("What's the weather in Paris?")
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=96, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ).choices[0]
    [(name, arguments)] = _check_calls(first.message, {"get_weather"})
    call = first.message.tool_calls[0]
    messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"city": arguments["city"], "temperature": 21, "sky": "sunny"})})
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=48, temperature=0).choices[0]  # fmt: skip
    assert final.finish_reason in ("stop", "length") and final.message.tool_calls is None
    assert final.message.content and final.message.content.strip()


@pytest.mark.parametrize(
    "kwargs, param, words",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
         "response_format", "foo"),
        ({"extra_body": {"guided_regex": "(abc"}}, "guided_regex", "unclosed group"),
        ({"extra_body": {"structured_outputs": {"grammar": "start: undefined_rule"}}}, "structured_outputs",
         "undefined_rule"),
        ({"extra_body": {"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}}, "guided_json",
         "minimum"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
          "tool_choice": "required"}, "tools", "bogus"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
    ],
)  # fmt: skip
def test_invalid_specs_are_400(client: openai.OpenAI, kwargs: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=4, **kwargs)
    assert info.value.status_code == 400 and info.value.param == param
    assert words in info.value.message
