"""Anthropic's ``thinking.budget_tokens`` enforced (pagoda/entrypoints/openai/thinking_budget.py),
over a fake engine scripted to think for longer than the budget: the thinking block stops at
the budget, ``</think>`` is written for the model, which answers in a second engine request
continuing the first; one message, summed usage, every request ended. Within the budget: one
request, as without a budget."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL
from tests.e2e.fake_engine import FakeEngine
from tests.e2e.server_utils import RunningServer, running_server
from tests.e2e.test_anthropic_wire import sse
from tests.e2e.test_server_lifecycle import assert_cleaned_up, wait_until

EOS = 2  # <|im_end|>
HI = [{"role": "user", "content": "Weather in Paris?"}]
BUDGET = 1024
THINKING = {"type": "enabled", "budget_tokens": BUDGET}
CLOSING = "\n</think>\n\n"  # what the qwen3 parser writes to end a reasoning cut short


class PhasedFakeEngine(FakeEngine):
    """Says ``scripts[i]`` for its i-th request (the last one for any later), with ``delays[i]``
    between tokens: a model whose continuation the test decides."""

    def __init__(self, max_model_len: int = 4096, step_delay: float = 0.0) -> None:
        super().__init__(max_model_len, step_delay)
        self.scripts: list[list[int]] = []
        self.delays: list[float] = []

    def _add(self, req: Any) -> None:
        i = len(self.calls) - 1  # the front end recorded the call before sending it here
        if self.scripts:
            self.script = self.scripts[min(i, len(self.scripts) - 1)]
        if self.delays:
            self.step_delay = self.delays[min(i, len(self.delays) - 1)]
        super()._add(req)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def _shared_server() -> Iterator[tuple[FakeEngine, RunningServer]]:
    engine = PhasedFakeEngine()
    with running_server(engine, reasoning_parser="qwen3") as running:
        yield engine, running


@pytest.fixture
def ac(server: RunningServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def long_thought(engine: PhasedFakeEngine, answer: str = "Sunny.") -> list[int]:
    """Phase 1 thinks past the budget (never closing); phase 2 says ``answer``. Phase 1's script."""
    thinking = engine.encode("<think>" + " step" * (BUDGET + 200))
    engine.scripts = [thinking, engine.encode(answer) + [EOS]]
    return thinking


def test_budget_cuts_the_thinking_and_the_answer_follows(ac: anthropic.Anthropic, engine: PhasedFakeEngine,
                                                          server: RunningServer) -> None:  # fmt: skip
    thinking = long_thought(engine)
    max_tokens = BUDGET + 100
    m = ac.messages.create(model=MODEL, max_tokens=max_tokens, messages=HI, thinking=THINKING)
    first, second = engine.calls
    closing = engine.encode(CLOSING)
    # Phase 1 may think for the budget; phase 2 continues it after "</think>", with what is left.
    assert first.params.max_tokens == BUDGET
    assert second.prompt_token_ids == [*first.prompt_token_ids, *thinking[:BUDGET], *closing]
    assert second.params.max_tokens == max_tokens - BUDGET - len(closing)
    assert [b.type for b in m.content] == ["thinking", "text"]
    cut = engine.tokenizer.decode(thinking[:BUDGET])
    assert m.content[0].thinking == cut.removeprefix("<think>") + "\n"
    assert len(engine.encode("<think>" + m.content[0].thinking)) <= BUDGET + 1  # + the "\n" of the closing
    assert m.content[1].text == "\n\nSunny."
    assert m.stop_reason == "end_turn"
    assert m.usage.output_tokens == BUDGET + len(closing) + len(engine.scripts[1])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(first.prompt_token_ids)
    # Both requests ended by themselves, one after the other; nothing is left running.
    assert engine.finished == [first.request_id, second.request_id] and engine.aborted == []
    assert_cleaned_up(server)


def test_streamed_as_one_message(http: httpx.Client, engine: PhasedFakeEngine, server: RunningServer) -> None:
    long_thought(engine)
    body = {"model": MODEL, "max_tokens": BUDGET + 100, "messages": HI, "thinking": THINKING, "stream": True}
    events = sse(http.post("/v1/messages", json=body).text)
    names = [n for n, _ in events]
    assert names.count("message_start") == names.count("message_stop") == 1
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    thinking = "".join(d.get("thinking", "") for d in deltas)
    text = "".join(d.get("text", "") for d in deltas)
    assert thinking == engine.tokenizer.decode(engine.scripts[0][:BUDGET]).removeprefix("<think>") + "\n"
    assert text == "\n\nSunny."
    final = events[-2][1]
    assert final["delta"]["stop_reason"] == "end_turn"
    assert final["usage"]["output_tokens"] == BUDGET + len(engine.encode(CLOSING)) + len(engine.scripts[1])
    assert len(engine.calls) == 2 and engine.aborted == []
    assert_cleaned_up(server)


def test_within_the_budget_one_request(ac: anthropic.Anthropic, engine: PhasedFakeEngine) -> None:
    engine.scripts = [engine.encode("<think>Look it up.</think>\n\nSunny.") + [EOS]]
    m = ac.messages.create(model=MODEL, max_tokens=BUDGET + 100, messages=HI, thinking=THINKING)
    assert len(engine.calls) == 1
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", "Look it up."), ("text", "\n\nSunny.")]  # fmt: skip
    assert m.stop_reason == "end_turn" and m.usage.output_tokens == len(engine.scripts[0])


def test_thought_ended_but_the_answer_is_long(ac: anthropic.Anthropic, engine: PhasedFakeEngine) -> None:
    # The reasoning closed within the budget: phase 2 is a plain continuation, nothing forced.
    whole = engine.encode("<think>Short.</think>" + " word" * (BUDGET + 20)) + [EOS]
    engine.scripts = [whole, whole[BUDGET:]]
    m = ac.messages.create(model=MODEL, max_tokens=BUDGET + 100, messages=HI, thinking=THINKING)
    first, second = engine.calls
    assert second.prompt_token_ids == [*first.prompt_token_ids, *whole[:BUDGET]]
    assert second.params.max_tokens == 100
    assert m.content[0].thinking == "Short." and m.content[1].text == engine.tokenizer.decode(whole[:-1]).split(
        "</think>")[1]  # fmt: skip
    assert m.stop_reason == "end_turn" and m.usage.output_tokens == len(whole)


def test_no_room_left_after_the_budget(ac: anthropic.Anthropic, engine: PhasedFakeEngine) -> None:
    # max_tokens leaves no room for "</think>" and an answer: it ends at max_tokens, as it would.
    long_thought(engine)
    m = ac.messages.create(model=MODEL, max_tokens=BUDGET + 1, messages=HI, thinking=THINKING)
    assert len(engine.calls) == 1 and m.stop_reason == "max_tokens"
    assert [b.type for b in m.content] == ["thinking"] and m.usage.output_tokens == BUDGET


def test_stop_sequence_in_phase_one_ends_the_message(ac: anthropic.Anthropic, engine: PhasedFakeEngine) -> None:
    long_thought(engine)
    m = ac.messages.create(model=MODEL, max_tokens=BUDGET + 100, messages=HI, thinking=THINKING,
                           stop_sequences=["step step step"])  # fmt: skip
    assert len(engine.calls) == 1 and m.stop_reason == "stop_sequence"


def test_disconnect_in_phase_two_aborts_it(engine: PhasedFakeEngine, server: RunningServer) -> None:
    long_thought(engine, "Sunny" + " and warm" * 300)
    engine.delays = [0.0, 0.02]  # phase 2 slow enough to leave in the middle of it
    body = {"model": MODEL, "max_tokens": BUDGET + 500, "messages": HI, "thinking": THINKING, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.base_url}/v1/messages", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"text_delta"' in line and "warm" in line:
                break  # phase 2 is generating
    assert engine.abort_event.wait(10), "phase 2 was not aborted"
    first, second = engine.calls
    assert wait_until(lambda: engine._running == 0)
    assert engine.finished == [first.request_id] and engine.aborted == [second.request_id]
    assert_cleaned_up(server)


def test_timeout_in_phase_two_aborts_it() -> None:
    engine = PhasedFakeEngine()
    long_thought(engine, "Sunny" + " and warm" * 300)
    engine.delays = [0.0, 0.05]
    body = {"model": MODEL, "max_tokens": BUDGET + 500, "messages": HI, "thinking": THINKING}
    with running_server(engine, reasoning_parser="qwen3", request_timeout=5.0) as s:
        r = httpx.post(f"{s.base_url}/v1/messages", json=body, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        assert wait_until(lambda: engine._running == 0)
        first, second = engine.calls
        assert engine.finished == [first.request_id] and engine.aborted == [second.request_id]
        assert_cleaned_up(s)


# ---------------------------------------------------------------------- chat: vLLM's thinking_token_budget
@pytest.fixture
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_chat_thinking_token_budget(client: openai.OpenAI, engine: PhasedFakeEngine, server: RunningServer) -> None:
    budget = 40
    engine.scripts = [engine.encode("<think>" + " step" * 100), engine.encode("Sunny.") + [EOS]]
    closing = engine.encode(CLOSING)
    cut = engine.tokenizer.decode(engine.scripts[0][:budget]).removeprefix("<think>") + "\n"
    extra = {"thinking_token_budget": budget}
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=200, extra_body=extra)
    first, second = engine.calls
    assert first.params.max_tokens == budget and second.params.max_tokens == 200 - budget - len(closing)
    assert second.prompt_token_ids == [*first.prompt_token_ids, *engine.scripts[0][:budget], *closing]
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == cut and message.content == "\n\nSunny."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == budget + len(closing) + len(engine.scripts[1])
    assert r.usage.prompt_tokens == len(first.prompt_token_ids)
    # Streamed: the reasoning, then the content, one finish, the usage of both phases.
    engine.scripts *= 2  # the same two phases again
    stream = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=200, extra_body=extra,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    reasoning, content, finishes, usage = "", "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
            finishes += [choice.finish_reason] if choice.finish_reason else []
    assert (reasoning, content, finishes) == (cut, "\n\nSunny.", ["stop"])
    assert usage.completion_tokens == r.usage.completion_tokens
    assert len(engine.calls) == 4 and engine.aborted == []
    assert_cleaned_up(server)


@pytest.mark.parametrize("fields", [
    {"n": 2}, {"logprobs": True}, {"response_format": {"type": "json_object"}}, {"thinking_token_budget": 0},
])  # fmt: skip
def test_chat_budget_conflicts_are_400s(client: openai.OpenAI, engine: PhasedFakeEngine,
                                        fields: dict[str, Any]) -> None:  # fmt: skip
    body = {"thinking_token_budget": 10, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=20, extra_body=body)
    assert e.value.body["param"] == "thinking_token_budget" and engine.calls == []


def test_chat_budget_without_a_reasoning_parser_is_a_400() -> None:
    engine = FakeEngine()
    with running_server(engine) as s, openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError, match="reasoning parser"):
            c.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, extra_body={"thinking_token_budget": 2})
        assert engine.calls == []


def test_chat_min_tokens_spans_both_phases(client: openai.OpenAI, engine: PhasedFakeEngine) -> None:
    engine.scripts = [engine.encode("<think>" + " step" * 100), engine.encode("Sunny.") + [EOS]]
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=200,
                                   extra_body={"thinking_token_budget": 40, "min_tokens": 60})  # fmt: skip
    first, second = engine.calls
    closing = len(engine.encode(CLOSING))
    assert (first.params.min_tokens, second.params.min_tokens) == (40, 60 - 40 - closing)
