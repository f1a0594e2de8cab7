"""/v1/responses on the wire, over a scripted fake engine: the Response object, the SSE events
(``event:`` lines, sequence numbers, OpenAI's order, no [DONE]), tool calls, the store and its
bounds, errors in OpenAI's shape, and aborts on disconnect and timeout."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL
from tests.e2e.fake_engine import FakeEngine
from tests.e2e.server_utils import RunningServer, running_server
from tests.e2e.test_server_lifecycle import assert_cleaned_up, wait_until

TOOLS = [{"type": "function", "name": "get_weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
EOS = 2  # <|im_end|>


class EosFakeEngine(FakeEngine):
    """The fake engine with a way to script its answer (it ends a request at EOS, as the
    real engine does)."""

    def say(self, text: str) -> None:
        """Generate ``text``, then EOS."""
        self.script = self.tokenizer.encode(text, add_special_tokens=False) + [EOS]


@pytest.fixture(scope="module")
def _shared_server() -> Iterator[tuple[EosFakeEngine, RunningServer]]:
    """(The engine, server and client fixtures of tests/e2e/conftest.py run on this one.)"""
    engine = EosFakeEngine()
    with running_server(engine) as running:
        yield engine, running


def read_events(response: httpx.Response) -> list[dict[str, Any]]:
    """The events of a Responses stream, checking each block's ``event:`` line against its data."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        event_line, data_line = block.split("\n")
        assert data_line != "data: [DONE]"
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


# ---------------------------------------------------------------------- the Response object
def test_response_object_and_echo(client: openai.OpenAI, engine: EosFakeEngine) -> None:
    engine.say("It is sunny.")
    r = client.responses.create(
        model=MODEL, input="Weather?", instructions="Answer briefly.", temperature=0.5, top_p=0.9,
        max_output_tokens=50, metadata={"k": "v"}, user="u1", store=False,
    )  # fmt: skip
    call = engine.calls[0]
    assert call.prompt.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>")
    assert (call.params.temperature, call.params.top_p, call.params.max_tokens) == (0.5, 0.9, 50)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "It is sunny." and r.incomplete_details is None and r.error is None
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.content[0].annotations == []
    assert (r.instructions, r.temperature, r.top_p, r.max_output_tokens) == ("Answer briefly.", 0.5, 0.9, 50)
    assert (r.metadata, r.user, r.store, r.tool_choice, r.tools, r.truncation) == ({"k": "v"}, "u1", False, "auto", [],
                                                                                 "disabled")  # fmt: skip
    assert r.text.format.type == "text" and r.parallel_tool_calls is True and r.model == MODEL
    assert r.usage.input_tokens == len(call.prompt_token_ids)
    assert r.usage.output_tokens == len(engine.script) and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_cut_short_is_incomplete(client: openai.OpenAI, engine: EosFakeEngine) -> None:
    engine.say("one two three four five six seven eight")
    r = client.responses.create(model=MODEL, input="count", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3 and r.output_text


# ---------------------------------------------------------------------- streaming
def test_stream_events_in_openais_order(server: RunningServer, engine: EosFakeEngine) -> None:
    engine.say("Hi there.")
    r = httpx.post(f"{server.base_url}/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}, timeout=30)
    events = read_events(r)
    types = [e["type"] for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 2 and types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert text == "Hi there." == final["output"][0]["content"][0]["text"]
    assert final["status"] == "completed" and final["id"] == events[0]["response"]["id"]
    assert final["output"][0]["id"] == events[2]["item"]["id"] == events[4]["item_id"]
    assert final["usage"]["output_tokens"] == len(engine.script)


def test_streamed_tool_calls(client: openai.OpenAI, engine: EosFakeEngine) -> None:
    engine.say("Checking. " + CALL)
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=TOOLS) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert "<tools>" in engine.calls[0].prompt and "get_weather" in engine.calls[0].prompt
    first_call = types.index("response.function_call_arguments.delta") - 1
    assert types[first_call - 1:first_call + 1] == ["response.output_item.done", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    message, call = final.output
    assert message.content[0].text.strip() == "Checking." and final.status == "completed"
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    # The same output without streaming.
    plain = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS)
    assert [(o.type, getattr(o, "name", None)) for o in plain.output] == [("message", None), ("function_call", "get_weather")]
    assert plain.output[1].arguments == call.arguments


def test_forced_tool_and_the_round_trip(client: openai.OpenAI, engine: EosFakeEngine) -> None:
    engine.say(CALL)
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS,
                                tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    assert engine.calls[0].params.structured_outputs is not None  # a grammar forces the call
    [call] = r.output
    assert call.type == "function_call" and r.tool_choice.name == "get_weather"
    engine.say("Sunny.")
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, tools=TOOLS, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24C"}])  # fmt: skip
    prompt = engine.calls[1].prompt
    assert prompt.index("Weather in Paris?") < prompt.index('"city": "Paris"') < prompt.index("sunny, 24C")
    assert follow.output_text == "Sunny." and follow.previous_response_id == r.id
    # The call and its output sent back by the client, without the store, give the same prompt.
    engine.say("Sunny.")
    client.responses.create(model=MODEL, tools=TOOLS, store=False, input=[
        {"role": "user", "content": "Weather in Paris?"}, *[o.model_dump(exclude_none=True) for o in r.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24C"}])  # fmt: skip
    assert engine.calls[2].prompt == prompt


# ---------------------------------------------------------------------- the store
def test_store_retrieve_list_delete(client: openai.OpenAI, engine: EosFakeEngine, server: RunningServer) -> None:
    engine.say("First.")
    first = client.responses.create(model=MODEL, input=[{"role": "user", "content": "one"},
                                                        {"role": "user", "content": "two"}])  # fmt: skip
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = client.responses.input_items.list(first.id)
    assert [i.content[0].text for i in items.data] == ["two", "one"]  # newest first by default
    asc = client.responses.input_items.list(first.id, order="asc", limit=1)
    assert [i.content[0].text for i in asc.data] == ["one"] and asc.has_more and asc.first_id == asc.last_id
    rest = client.responses.input_items.list(first.id, order="asc", after=asc.last_id)
    assert [i.content[0].text for i in rest.data] == ["two"] and not rest.has_more
    deleted = httpx.delete(f"{server.base_url}/v1/responses/{first.id}", timeout=10)
    assert deleted.json() == {"id": first.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="more", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(client: openai.OpenAI, engine: EosFakeEngine) -> None:
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="hi", previous_response_id=r.id)


def test_store_bound_and_tenants() -> None:
    engine = EosFakeEngine()
    with running_server(engine, responses_store_max_entries=2) as s, httpx.Client(base_url=s.base_url) as http:
        def create(tenant: str = "a") -> str:
            r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}, headers={"X-Tenant": tenant})
            return str(r.json()["id"])

        first, second = create(), create()
        assert http.get(f"/v1/responses/{first}", headers={"X-Tenant": "a"}).status_code == 200  # now the newest
        create()  # evicts the least recently used: second
        assert http.get(f"/v1/responses/{second}", headers={"X-Tenant": "a"}).status_code == 404
        assert http.get(f"/v1/responses/{first}", headers={"X-Tenant": "a"}).status_code == 200
        # Another tenant cannot see, continue or delete it.
        other = {"X-Tenant": "b"}
        assert http.get(f"/v1/responses/{first}", headers=other).status_code == 404
        assert http.delete(f"/v1/responses/{first}", headers=other).status_code == 404
        r = http.post("/v1/responses", json={"input": "x", "previous_response_id": first}, headers=other)
        assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"
    with running_server(EosFakeEngine(), responses_store_max_entries=0) as s:
        r = httpx.post(f"{s.base_url}/v1/responses", json={"input": "hi", "store": True}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "store"
        r = httpx.post(f"{s.base_url}/v1/responses", json={"input": "hi", "max_output_tokens": 2}, timeout=10)
        assert r.status_code == 200 and r.json()["store"] is True  # the default: stored if the server can


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize(("fields", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without include ["message.output_text.logprobs"]
    ({"include": ["file_search_call.results"]}, "include"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "json_object"}}, "tools": TOOLS, "tool_choice": "required"}, "text.format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"model": "no-such-model"}, "model"),
])  # fmt: skip
def test_bad_requests_are_400s_naming_the_parameter(client: openai.OpenAI, engine: EosFakeEngine,
                                                    fields: dict[str, Any], param: str) -> None:  # fmt: skip
    body = {"model": MODEL, "input": "hi", **fields}
    expected = openai.NotFoundError if param == "model" else openai.BadRequestError
    with pytest.raises(expected) as e:
        client.responses.create(**body)
    assert e.value.body["param"] == param and e.value.body["message"]
    assert engine.calls == []  # nothing reached the engine


# ---------------------------------------------------------------------- aborts
def test_disconnect_mid_stream_aborts() -> None:
    engine = EosFakeEngine(step_delay=0.02)
    with running_server(engine) as s, httpx.Client(base_url=s.base_url) as http:
        body = {"input": "hi", "max_output_tokens": 400, "stream": True}
        with http.stream("POST", "/v1/responses", json=body) as r:
            lines = r.iter_lines()
            created = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            assert next(line for line in lines if "response.output_text.delta" in line)
        assert engine.abort_event.wait(5)
        assert engine.aborted == [engine.calls[0].request_id] and engine.finished == []
        assert_cleaned_up(s)
        # Nothing half-done was stored.
        assert http.get(f"/v1/responses/{created['response']['id']}").status_code == 404


def test_timeout_ends_the_stream_with_an_error_and_response_failed() -> None:
    engine = EosFakeEngine(step_delay=0.02)
    with running_server(engine, request_timeout=0.3) as s, httpx.Client(base_url=s.base_url, timeout=30) as http:
        r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 400})
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        events = read_events(http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 400,
                                                               "stream": True}))  # fmt: skip
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert events[-2]["code"] == "request_timeout"
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert wait_until(lambda: len(engine.aborted) == 2) and engine.finished == []
        assert http.get(f"/v1/responses/{failed['id']}").status_code == 404
        assert_cleaned_up(s)
