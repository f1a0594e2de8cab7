"""The Responses API's pieces without a server: input items -> chat messages, the output
builder's items and event order, the SSE writer, and the bounded response store."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pagoda.entrypoints.openai.responses_output import EventWriter, OutputBuilder
from pagoda.entrypoints.openai.responses_protocol import (
    ResponsesRequest,
    to_chat_messages,
)
from pagoda.entrypoints.openai.responses_store import ResponseStore, StoredResponse


# ---------------------------------------------------------------------- input items
def test_items_become_chat_messages() -> None:
    body = ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}', "id": "fc_1"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
    ]})  # fmt: skip
    assert to_chat_messages(body.input_items()) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        # The calls join the assistant message before them: one turn, two tool_calls.
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]  # fmt: skip


def test_a_call_without_a_message_before_it_opens_an_assistant_turn() -> None:
    body = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]})  # fmt: skip
    assert to_chat_messages(body.input_items())[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}  # fmt: skip


@pytest.mark.parametrize(("body", "words"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "file_id"),
    ({"input": [{"type": "input_file", "file_id": "f"}]}, "'input_file'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "'item_reference'"),
    ({"input": [{"role": "tool", "content": "x"}]}, "role"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "'file_search'"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "letters, digits"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "'required'"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "'name' and 'schema'"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "16"),
])  # fmt: skip
def test_unsupported_input_is_a_validation_error_naming_it(body: dict, words: str) -> None:
    with pytest.raises(ValidationError) as e:
        ResponsesRequest.model_validate(body)
    assert words in str(e.value)


# ---------------------------------------------------------------------- output builder
def _types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def test_builder_text_then_calls_in_openais_order() -> None:
    b = OutputBuilder()
    events = b.text("Hel") + b.text("lo") + b.start_call("f") + b.call_arguments('{"a"') + b.call_arguments(": 1}")
    events += b.start_call("g") + b.call_arguments("{}") + b.finish("completed")
    assert _types(events) == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
    ]  # fmt: skip
    message, f, g = b.items
    assert message.content[0].text == "Hello" and message.status == "completed"
    assert (f.name, f.arguments, g.name, g.arguments) == ("f", '{"a": 1}', "g", "{}")
    assert f.call_id != g.call_id and f.call_id.startswith("call_") and f.id.startswith("fc_")
    # Every event names the item it belongs to and its place in the output.
    assert [e["output_index"] for e in events] == [0] * 7 + [1] * 5 + [2] * 4
    assert {e["item_id"] for e in events if "item_id" in e} == {message.id, f.id, g.id}
    assert events[4]["text"] == "Hello" and events[10]["arguments"] == '{"a": 1}'
    # The added event shows the item as it started, the done event as it ended.
    assert events[0]["item"]["status"] == "in_progress" and events[0]["item"]["content"] == []
    assert events[6]["item"]["status"] == "completed" and events[6]["item"]["content"][0]["text"] == "Hello"


def test_builder_cut_short_and_empty_outputs() -> None:
    b = OutputBuilder()
    b.text("partial")
    events = b.finish("incomplete")
    assert b.items[0].status == "incomplete" and events[-1]["item"]["status"] == "incomplete"
    empty = OutputBuilder()
    events = empty.finish("completed")
    # Nothing generated: still one (empty) message, announced in full.
    assert _types(events)[:2] == ["response.output_item.added", "response.content_part.added"]
    assert len(empty.items) == 1 and empty.items[0].content[0].text == ""
    with pytest.raises(TypeError):
        OutputBuilder().call_arguments("{}")


def test_event_writer_numbers_events_and_writes_event_lines() -> None:
    write = EventWriter()
    first, second = write({"type": "response.created", "x": 1}), write({"type": "response.in_progress"})
    for text, number in ((first, 0), (second, 1)):
        event_line, data_line, *rest = text.split("\n")
        assert rest == ["", ""]
        payload = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {payload['type']}" and payload["sequence_number"] == number
    assert json.loads(first.split("\n")[1][6:])["x"] == 1


# ---------------------------------------------------------------------- store
def _entry(response_id: str, tenant: str | None = None, text: str = "") -> StoredResponse:
    response = {"id": response_id, "output": [{"type": "message", "id": f"msg_{response_id}", "content": text}]}
    return StoredResponse(response, [{"type": "message", "id": "in"}], [], tenant)


def test_store_evicts_least_recently_used_by_count() -> None:
    store = ResponseStore(max_entries=2, max_bytes=1 << 20)
    store.put(_entry("a"))
    store.put(_entry("b"))
    assert store.get("a", None) is not None  # a is now the most recently used
    store.put(_entry("c"))
    assert store.get("b", None) is None and store.get("a", None) is not None and store.get("c", None) is not None
    assert len(store) == 2


def test_store_evicts_by_bytes_and_refuses_what_can_never_fit() -> None:
    one = _entry("a", text="x" * 1000)
    store = ResponseStore(max_entries=100, max_bytes=2 * one.size + 10)
    for name in "abc":
        assert store.put(_entry(name, text="x" * 1000))
    assert [n for n in "abc" if store.get(n, None)] == ["b", "c"] and store.num_bytes == 2 * one.size
    assert not store.put(_entry("big", text="x" * 10_000))
    assert store.get("big", None) is None and len(store) == 2
    assert store.delete("b", None) and not store.delete("b", None) and store.num_bytes == one.size


def test_store_keeps_tenants_apart() -> None:
    store = ResponseStore()
    store.put(_entry("a", tenant="alice"))
    assert store.get("a", "bob") is None and store.get("a", None) is None
    assert not store.delete("a", "bob") and store.get("a", "alice") is not None


def test_conversation_is_history_then_inputs_then_outputs() -> None:
    entry = StoredResponse({"id": "r", "output": [{"id": "o"}]}, [{"id": "i"}], [{"id": "h"}])
    assert [item["id"] for item in entry.conversation()] == ["h", "i", "o"]
    assert not ResponseStore(max_entries=0).enabled
