"""/v1/responses over the real engine and the default model, driven by the official openai
client: the same greedy text and token counts as /v1/chat/completions, streaming (raw events and
the SDK's accumulator), the store and previous_response_id, a forced function call round trip,
json_schema output, and the SDK's typed errors."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.server_utils import real_engine_server
from tests.e2e.test_real_engine import MODEL, _wait_idle

QUESTION = "What is the capital of France? Answer with one word."
TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                         "additionalProperties": False}}]  # fmt: skip


@pytest.fixture(scope="module")
def real_server():
    with real_engine_server(served_model_name=MODEL) as (engine, running):
        yield engine, running


@pytest.fixture
def client(real_server):
    _, running = real_server
    with openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def _prompt_tokens(running: Any, messages: list[dict[str, Any]]) -> int:
    r = httpx.post(f"{running.base_url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=30)
    return int(r.json()["count"])


def test_same_text_and_counts_as_chat(real_server, client: openai.OpenAI) -> None:
    _, running = real_server
    messages = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": QUESTION}]  # fmt: skip
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    r = client.responses.create(model=MODEL, instructions=messages[0]["content"], input=QUESTION,
                                max_output_tokens=24, temperature=0)  # fmt: skip
    assert r.output_text == chat.choices[0].message.content and "Paris" in r.output_text
    assert r.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    assert r.usage.input_tokens == chat.usage.prompt_tokens == _prompt_tokens(running, messages)
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    _wait_idle(running)


def test_streaming_assembles_the_same_text(real_server, client: openai.OpenAI) -> None:
    _, running = real_server
    plain = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    assert plain.status == "completed"
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0,
                                          stream=True))  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0) as stream:
        snapshots = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == plain.output_text == snapshots[-1]
    _wait_idle(running)


def test_store_continue_retrieve_delete(real_server, client: openai.OpenAI) -> None:
    _, running = real_server
    first = client.responses.create(model=MODEL, input="My name is Ada. Reply with OK.", max_output_tokens=16,
                                    temperature=0)  # fmt: skip
    assert first.store is True and client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=16, temperature=0)  # fmt: skip
    # The stored conversation came first: the same prompt, and text, as the whole chat.
    messages = [{"role": "user", "content": "My name is Ada. Reply with OK."},
                {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"}]  # fmt: skip
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert second.usage.input_tokens == _prompt_tokens(running, messages) == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content and second.previous_response_id == first.id
    assert [i.content[0].text for i in client.responses.input_items.list(second.id).data] == ["What is my name?"]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Again?", previous_response_id=first.id, max_output_tokens=4)
    assert client.responses.retrieve(second.id).id == second.id  # continuations do not depend on their parent
    _wait_idle(running)


def test_forced_function_call_round_trip(real_server, client: openai.OpenAI) -> None:
    _, running = real_server
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64,
                                temperature=0)  # fmt: skip
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and r.status == "completed"
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, TOOLS[0]["parameters"])
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, tools=TOOLS, max_output_tokens=16,
                                     temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                            "output": "Sunny, 24 C"}])  # fmt: skip
    assert follow.status in ("completed", "incomplete") and follow.output
    # The call and its result are in the prompt: more tokens than the first turn's prompt and call.
    assert follow.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
    _wait_idle(running)


def test_json_schema_output_validates(real_server, client: openai.OpenAI) -> None:
    _, running = real_server
    schema = {"type": "object", "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["answer", "confidence"], "additionalProperties": False}  # fmt: skip
    r = client.responses.create(model=MODEL, input="Is Paris in France? Reply in JSON.", max_output_tokens=48,
                                temperature=0, text={"format": {"type": "json_schema", "name": "verdict",
                                                                "schema": schema, "strict": True}})  # fmt: skip
    assert r.status == "completed" and r.text.format.type == "json_schema" and r.text.format.name == "verdict"
    jsonschema.validate(json.loads(r.output_text), schema)
    _wait_idle(running)


def test_typed_errors(real_server, client: openai.OpenAI) -> None:
    _, running = real_server
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/cat.png"}]}])  # fmt: skip
    # The bundled model reads no images: the part is refused as such.
    assert "takes text only" in e.value.message and e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi " * 3000)  # longer than the context
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    _wait_idle(running)
