"""/v1/responses with --reasoning-parser, over a scripted fake engine and the official openai SDK:
the reasoning item before the message, its stream events, usage's reasoning_tokens, reasoning
items in a continued conversation, the ``reasoning`` parameter, and structured output after
the reasoning."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL
from tests.e2e.server_utils import RunningServer, running_server
from tests.e2e.test_responses_wire import EOS, EosFakeEngine, read_events

THOUGHT = "The user asks about the weather; 2 < 3 and </b> are not tags."
ANSWER = "\n\nIt is sunny."


@pytest.fixture(scope="module")
def _shared_server() -> Iterator[tuple[EosFakeEngine, RunningServer]]:
    """(The engine, server and client fixtures of tests/e2e/conftest.py run on this one.)"""
    engine = EosFakeEngine()
    with running_server(engine, reasoning_parser="qwen3") as running:
        yield engine, running


def think_then_answer(engine: EosFakeEngine, thought: str = THOUGHT, answer: str = ANSWER) -> int:
    """Script ``<think>thought</think>answer`` then EOS; the number of tokens up to and with
    ``</think>`` (tokenized apart, so that the section ends exactly at a token boundary)."""
    encode = engine.tokenizer.encode
    reasoning = encode(f"<think>{thought}</think>", add_special_tokens=False)
    engine.script = reasoning + encode(answer, add_special_tokens=False) + [EOS]
    return len(reasoning)


def test_reasoning_item_then_message(client: openai.OpenAI, engine: EosFakeEngine) -> None:
    num_reasoning = think_then_answer(engine)
    r = client.responses.create(model=MODEL, input="Weather?")
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.status == "completed"
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", THOUGHT)]
    assert reasoning.summary == [] and reasoning.encrypted_content is None
    assert message.type == "message" and r.output_text == ANSWER and message.status == "completed"
    assert r.usage.output_tokens == len(engine.script)
    assert r.usage.output_tokens_details.reasoning_tokens == num_reasoning


def test_without_think_tags_there_is_no_reasoning_item(client: openai.OpenAI, engine: EosFakeEngine) -> None:
    engine.say("It is sunny.")
    r = client.responses.create(model=MODEL, input="Weather?")
    assert [o.type for o in r.output] == ["message"] and r.output_text == "It is sunny."
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_cut_short_while_thinking(client: openai.OpenAI, engine: EosFakeEngine) -> None:
    think_then_answer(engine)
    r = client.responses.create(model=MODEL, input="Weather?", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [reasoning] = r.output
    assert reasoning.type == "reasoning" and reasoning.status == "incomplete"
    assert THOUGHT.startswith(reasoning.content[0].text) and reasoning.content[0].text
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 5


def test_stream_events_in_order(server: RunningServer, engine: EosFakeEngine) -> None:
    num_reasoning = think_then_answer(engine)
    body = {"model": MODEL, "input": "Weather?", "stream": True}
    events = read_events(httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=30))
    types = [e["type"] for e in events]
    thinking, texts = types.count("response.reasoning_text.delta"), types.count("response.output_text.delta")
    assert thinking > 1 and texts > 1
    assert types == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", *["response.reasoning_text.delta"] * thinking,
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", *["response.output_text.delta"] * texts,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    added = events[2]
    assert added["item"]["type"] == "reasoning" and added["output_index"] == 0
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}
    deltas = [e for e in events if e["type"] == "response.reasoning_text.delta"]
    assert {(e["item_id"], e["output_index"], e["content_index"]) for e in deltas} == {(added["item"]["id"], 0, 0)}
    assert "".join(e["delta"] for e in deltas) == THOUGHT
    done = next(e for e in events if e["type"] == "response.reasoning_text.done")
    assert done["text"] == THOUGHT
    message_added = events[types.index("response.output_item.added", 3)]
    assert message_added["output_index"] == 1 and message_added["item"]["type"] == "message"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == ANSWER
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == num_reasoning


def test_sdk_stream_accumulates_the_reasoning(client: openai.OpenAI, engine: EosFakeEngine) -> None:
    think_then_answer(engine)
    with client.responses.stream(model=MODEL, input="Weather?") as stream:
        pieces = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        final = stream.get_final_response()
    assert "".join(pieces) == THOUGHT
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THOUGHT
    assert message.content[0].text == ANSWER and final.output_text == ANSWER


def test_continuing_a_conversation_with_a_reasoning_item(client: openai.OpenAI, engine: EosFakeEngine) -> None:
    think_then_answer(engine)
    first = client.responses.create(model=MODEL, input="Weather?")
    engine.say("Take a hat.")
    follow = client.responses.create(model=MODEL, input="And tomorrow?", previous_response_id=first.id)
    assert follow.output_text == "Take a hat."
    prompt = engine.calls[1].prompt
    # The earlier answer is in the prompt, its reasoning is not (as the reasoning templates do).
    assert prompt.index("Weather?") < prompt.index("It is sunny.") < prompt.index("And tomorrow?")
    assert THOUGHT not in prompt and "<think>" not in prompt
    # The same conversation sent back by the client, reasoning item included, gives the same prompt.
    engine.say("Take a hat.")
    client.responses.create(model=MODEL, store=False, input=[
        {"role": "user", "content": "Weather?"}, *[o.model_dump(exclude_none=True) for o in first.output],
        {"role": "user", "content": "And tomorrow?"}])  # fmt: skip
    assert engine.calls[2].prompt == prompt
    # The continuation's stored conversation (with the reasoning item) can be continued again.
    engine.say("Yes.")
    again = client.responses.create(model=MODEL, input="Sure?", previous_response_id=follow.id)
    assert again.output_text == "Yes." and engine.calls[3].prompt.index("Take a hat.") > 0


def test_reasoning_input_item_is_listed_with_the_input(client: openai.OpenAI, engine: EosFakeEngine) -> None:
    engine.say("Ok.")
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "hm"}]}  # fmt: skip
    r = client.responses.create(model=MODEL, input=[{"role": "user", "content": "a"}, reasoning,
                                                    {"role": "assistant", "content": "b"},
                                                    {"role": "user", "content": "c"}])  # fmt: skip
    items = client.responses.input_items.list(r.id, order="asc")
    assert [i.type for i in items.data] == ["message", "reasoning", "message", "message"]
    assert items.data[1].id == "rs_1" and items.data[1].content[0].text == "hm"
    assert "hm" not in engine.calls[0].prompt


@pytest.mark.parametrize(("reasoning", "param"), [
    ({"summary": "detailed"}, "reasoning.summary"),
    ({"generate_summary": "concise"}, "reasoning.generate_summary"),
    ({"context": "all_turns"}, "reasoning.context"),
    ({"mode": "pro"}, "reasoning.mode"),
    ({"effort": "extreme"}, "reasoning.effort"),
    ({"effort": "high"}, "reasoning.effort"),   # (this model's template has no reasoning effort: test_harmony_wire.py)
])  # fmt: skip
def test_reasoning_parameters_it_cannot_honour(client: openai.OpenAI, engine: EosFakeEngine,
                                               reasoning: dict[str, Any], param: str) -> None:  # fmt: skip
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", reasoning=reasoning)
    assert e.value.body["param"] == param and engine.calls == []


def test_reasoning_parameters_accepted_and_echoed(client: openai.OpenAI, engine: EosFakeEngine) -> None:
    think_then_answer(engine)
    r = client.responses.create(model=MODEL, input="Weather?",
                                reasoning={"summary": "auto", "context": "current_turn"})  # fmt: skip
    assert (r.reasoning.summary, r.reasoning.context) == ("auto", "current_turn")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    # They do not change the request the engine runs.
    think_then_answer(engine)
    client.responses.create(model=MODEL, input="Weather?")
    assert engine.calls[0].params == engine.calls[1].params


def test_structured_output_after_the_reasoning(client: openai.OpenAI, engine: EosFakeEngine) -> None:
    from pagoda.structured_output.backend import LLGuidanceBackend

    schema = {"type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"]}
    think_then_answer(engine, "Look outside.", '{"sunny": true}')
    r = client.responses.create(model=MODEL, input="Weather?",
                                text={"format": {"type": "json_schema", "name": "w", "schema": schema}})  # fmt: skip
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Look outside." and json.loads(r.output_text) == {"sunny": True}
    tok = engine.tokenizer
    backend = LLGuidanceBackend(tok.backend.to_str(), tok.vocab_size, tok.eos_token_ids)
    constraint = engine.calls[0].params.structured_outputs

    def accepted(text: str) -> bool:
        matcher = backend.matcher(backend.compile(constraint))
        return all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and \
            matcher._m.is_accepting()

    assert accepted('<think>Look outside.</think>\n{"sunny": true}')
    assert not accepted('<think>Look outside.</think>{"sunny": "yes"}')
    assert not accepted('{"sunny": true}<think>late</think>')
