"""GPT-OSS (the Harmony format) on the wire, through the real server and the official clients,
over a scripted fake engine whose vocabulary has Harmony's markers as special tokens and whose
template writes ``<|channel|>``: no parser flags, and the prompt is Harmony's, the analysis
channel is ``reasoning_content`` (a ``reasoning`` item, a ``thinking`` block), calls are
``tool_calls`` and come back into the prompt as Harmony messages, streams carry no markup, and
``reasoning_effort`` sets the system message's ``Reasoning:`` line."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pagoda.engine.output_processor import OutputProcessor
from pagoda.reasoning.harmony import CALL, RETURN
from tests.e2e.conftest import MODEL
from tests.e2e.fake_engine import FakeEngine
from tests.e2e.server_utils import RunningServer, running_server, sse_events
from tests.e2e.test_responses_wire import read_events
from tests.harmony_tokenizer import harmony_tokenizer

ASK = [{"role": "user", "content": "Weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": CITY}}]
THOUGHT = "The user wants the weather in Paris; call get_weather."
CALLING = (f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>commentary "
           'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}')
ANSWERING = ("<|channel|>analysis<|message|>Sunny, it says.<|end|><|start|>assistant<|channel|>final<|message|>"
             "It is sunny in Paris.")
ANSWER = "It is sunny in Paris."


class HarmonyEngine(FakeEngine):
    """The fake engine with a Harmony vocabulary (``eos``: the tokens that end generation)."""

    def __init__(self, max_model_len: int = 4096, step_delay: float = 0.0, eos: tuple[str, ...] = (RETURN, CALL)):
        super().__init__(max_model_len, step_delay)
        tok = harmony_tokenizer(eos)
        self.tokenizer, self.eos_token_ids, self.vocab_size = tok, tok.eos_token_ids, tok.vocab_size
        self.processor = OutputProcessor(tok)
        self._init_args = (max_model_len, step_delay, eos)  # type: ignore[assignment]

    def say(self, text: str, end: str = RETURN) -> None:
        """Generate ``text``, then ``end`` (``<|return|>`` after an answer, ``<|call|>`` after a call)."""
        self.script = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.token_to_id(end)]


@pytest.fixture(scope="module")
def _shared_server() -> Iterator[tuple[HarmonyEngine, RunningServer]]:
    engine = HarmonyEngine()
    with running_server(engine) as running:   # no parser flags: a Harmony model gets GPT-OSS's parsers
        yield engine, running


def _stream(client: openai.OpenAI, **kwargs: Any) -> tuple[list[tuple[str, str]], list[tuple[str | None, str]], str]:
    """A chat stream's (part, text) pieces in order, its call pieces (name, arguments), its finish reason."""
    pieces, calls, finish = [], [], ""
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        if (delta.model_extra or {}).get("reasoning_content"):
            pieces.append(("reasoning", delta.model_extra["reasoning_content"]))
        if delta.content:
            pieces.append(("content", delta.content))
        calls += [(c.function.name, c.function.arguments or "") for c in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    return pieces, calls, finish


# ---------------------------------------------------------------------- chat completions
def test_reasoning_and_content_from_a_harmony_prompt(client: openai.OpenAI, engine: HarmonyEngine) -> None:
    engine.say(ANSWERING)
    choice = client.chat.completions.create(model=MODEL, messages=ASK).choices[0]
    assert choice.message.content == ANSWER and choice.message.model_extra["reasoning_content"] == "Sunny, it says."
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    call = engine.calls[0]
    assert call.prompt.startswith("<|start|>system<|message|>You are ChatGPT, a large language model trained by "
                                  "OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: ")  # fmt: skip
    assert "\n\nReasoning: medium\n\n" in call.prompt and "<|start|>developer" not in call.prompt
    assert call.prompt.endswith("<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant")
    # The markers are special tokens: decoded into the text the parsers read. <|return|> and <|call|> end
    # generation as the model's own end-of-generation tokens, so no stop tokens are added.
    assert call.params.skip_special_tokens is False and not call.params.stop_token_ids


def test_tool_call_round_trip(client: openai.OpenAI, engine: HarmonyEngine) -> None:
    engine.say(CALLING, end=CALL)
    choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == THOUGHT
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = engine.calls[0].prompt
    assert "Calls to these tools must go to the commentary channel: 'functions'.<|end|>" in prompt
    assert ("<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n// The weather in a "
            "city.\ntype get_weather = (_: {\ncity?: string,\n}) => any;\n\n} // namespace functions<|end|>") in prompt
    # The call and its result sent back: rendered as Harmony messages, with the reasoning before the call.
    engine.say(ANSWERING)
    messages = ASK + [
        {"role": "assistant", "content": None, "reasoning_content": THOUGHT, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
    ]  # fmt: skip
    again = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS).choices[0]
    assert again.message.content == ANSWER and again.finish_reason == "stop"
    assert engine.calls[1].prompt.endswith(
        f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant to=functions.get_weather"
        '<|channel|>commentary json<|message|>{"city":"Paris"}<|call|><|start|>functions.get_weather to=assistant'
        '<|channel|>commentary<|message|>{"sky": "clear"}<|end|><|start|>assistant')


def test_without_tools_a_call_is_left_out(client: openai.OpenAI, engine: HarmonyEngine) -> None:
    engine.say(CALLING, end=CALL)
    message = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none") \
        .choices[0].message  # fmt: skip
    assert message.content is None and message.tool_calls is None
    assert message.model_extra["reasoning_content"] == THOUGHT and "namespace functions" not in engine.calls[0].prompt


def test_streamed_deltas(client: openai.OpenAI, engine: HarmonyEngine) -> None:
    engine.say(ANSWERING)
    pieces, calls, finish = _stream(client)
    kinds = [kind for kind, _ in pieces]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning") and kinds.count("content") > 1
    assert "".join(t for k, t in pieces if k == "reasoning") == "Sunny, it says."
    assert "".join(t for k, t in pieces if k == "content") == ANSWER
    assert not any("<|" in t for _, t in pieces) and calls == [] and finish == "stop"
    engine.say(CALLING, end=CALL)
    pieces, calls, finish = _stream(client, tools=TOOLS)
    assert [k for k, _ in pieces] == ["reasoning"] * len(pieces) and "".join(t for _, t in pieces) == THOUGHT
    assert [name for name, _ in calls if name] == ["get_weather"] and len(calls) > 2   # the arguments in fragments
    assert json.loads("".join(arguments for _, arguments in calls)) == {"city": "Paris"} and finish == "tool_calls"


def test_reasoning_effort(client: openai.OpenAI, engine: HarmonyEngine) -> None:
    engine.say(ANSWERING)
    client.chat.completions.create(model=MODEL, messages=ASK, reasoning_effort="high")
    client.chat.completions.create(model=MODEL, messages=ASK, extra_body={"chat_template_kwargs": {
        "reasoning_effort": "low"}})  # (the variable of GPT-OSS's own template)
    assert ["\n\nReasoning: high\n\n" in engine.calls[0].prompt, "\n\nReasoning: low\n\n" in engine.calls[1].prompt]
    for fields, param in (({"reasoning_effort": "minimal"}, "reasoning_effort"),
                          ({"extra_body": {"chat_template_kwargs": {"builtin_tools": ["python"]}}},
                           "chat_template_kwargs")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, **fields)
        assert e.value.body["param"] == param
    assert len(engine.calls) == 2


def test_forced_call_grammar(client: openai.OpenAI, engine: HarmonyEngine) -> None:
    from pagoda.structured_output.backend import LLGuidanceBackend

    engine.say(CALLING, end=CALL)
    choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required").choices[0]
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    tok = engine.tokenizer
    backend = LLGuidanceBackend(tok.backend.to_str(), tok.vocab_size, tok.eos_token_ids)
    grammar = backend.compile(engine.calls[0].params.structured_outputs)

    def accepted(text: str) -> bool:
        matcher = backend.matcher(grammar)
        return all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and \
            matcher._m.is_accepting()  # fmt: skip

    assert accepted(CALLING) and not accepted(ANSWERING)


def test_stop_tokens_the_vocabulary_does_not_end_generation_with() -> None:
    """A checkpoint whose end-of-generation ids miss <|call|> (no generation_config.json) still
    stops after a call: the request names it as a stop token."""
    engine = HarmonyEngine(eos=(RETURN,))
    with running_server(engine) as s, openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="x", max_retries=0) as c:
        engine.say(CALLING, end=CALL)
        choice = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS).choices[0]
        assert engine.calls[0].params.stop_token_ids == [engine.tokenizer.token_to_id(CALL)]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"


# ---------------------------------------------------------------------- the Responses API
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]  # fmt: skip


def test_responses_reasoning_item_and_effort(client: openai.OpenAI, engine: HarmonyEngine) -> None:
    engine.say(ANSWERING)
    r = client.responses.create(model=MODEL, input="Weather in Paris?", instructions="Be brief.",
                                reasoning={"effort": "low"})  # fmt: skip
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == ["Sunny, it says."]
    assert message.type == "message" and r.output_text == ANSWER and r.reasoning.effort == "low"
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    prompt = engine.calls[0].prompt
    assert "\n\nReasoning: low\n\n" in prompt
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>" in prompt
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", reasoning={"effort": "xhigh"})
    assert e.value.body["param"] == "reasoning.effort"


def test_responses_function_call_round_trip(client: openai.OpenAI, engine: HarmonyEngine) -> None:
    engine.say(CALLING, end=CALL)
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=RESPONSES_TOOLS)
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    engine.say(ANSWERING)
    again = client.responses.create(model=MODEL, previous_response_id=r.id, tools=RESPONSES_TOOLS, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}])
    assert again.output_text == ANSWER
    # The reasoning item went back in before the call it led to (the turn is being continued).
    assert engine.calls[1].prompt.endswith(
        f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant to=functions.get_weather"
        '<|channel|>commentary json<|message|>{"city":"Paris"}<|call|><|start|>functions.get_weather to=assistant'
        '<|channel|>commentary<|message|>{"sky": "clear"}<|end|><|start|>assistant')


def test_responses_stream(http: httpx.Client, engine: HarmonyEngine) -> None:
    engine.say(CALLING, end=CALL)
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Weather in Paris?", "stream": True,
                                         "tools": RESPONSES_TOOLS})  # fmt: skip
    events = read_events(r)
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    arguments = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert reasoning == THOUGHT and len(arguments) > 1 and json.loads("".join(arguments)) == {"city": "Paris"}
    assert not any(e["type"] == "response.output_text.delta" for e in events)


# ---------------------------------------------------------------------- Anthropic and Ollama
def test_anthropic_thinking_block(http: httpx.Client, engine: HarmonyEngine) -> None:
    engine.say(ANSWERING)
    body = {"model": MODEL, "max_tokens": 2048, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert [(b["type"], b.get("thinking") or b.get("text")) for b in r.json()["content"]] == [
        ("thinking", "Sunny, it says."), ("text", ANSWER)]
    assert engine.calls[0].prompt.startswith("<|start|>system<|message|>")
    engine.say(CALLING, end=CALL)
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 256, "messages": ASK, "tools": tools})
    assert r.json()["stop_reason"] == "tool_use"
    assert [(b["type"], b.get("input")) for b in r.json()["content"]] == [("tool_use", {"city": "Paris"})]


def test_ollama_answers_without_markup(http: httpx.Client, engine: HarmonyEngine) -> None:
    engine.say(ANSWERING)
    r = http.post("/api/chat", json={"model": MODEL, "messages": ASK, "stream": False})
    assert r.json()["message"]["content"] == ANSWER and not r.json()["message"].get("thinking")
    engine.say(ANSWERING)
    lines = [json.loads(line) for line in http.post("/api/chat", json={"model": MODEL, "messages": ASK,
                                                                        "think": True}).text.splitlines()]
    assert "".join(line["message"].get("thinking") or "" for line in lines) == "Sunny, it says."
    assert "".join(line["message"]["content"] for line in lines) == ANSWER


# ---------------------------------------------------------------------- reasoning_effort elsewhere
def test_reasoning_effort_on_other_models() -> None:
    """A chat template with a ``reasoning_effort`` variable gets the value; other models refuse it."""
    plain = FakeEngine()
    reads = FakeEngine()
    reads.tokenizer = copy.copy(reads.tokenizer)
    reads.tokenizer.chat_template = ("{% for m in messages %}{{ m.content }}\n{% endfor %}"
                                     "effort={{ reasoning_effort | default('none') }}")  # fmt: skip
    body = {"messages": ASK, "reasoning_effort": "high", "max_tokens": 2}
    with running_server(plain) as s:
        r = httpx.post(f"{s.base_url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    with running_server(reads) as s:
        r = httpx.post(f"{s.base_url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200 and reads.calls[0].prompt.endswith("effort=high")
        stream = httpx.post(f"{s.base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=30)
        assert sse_events(stream.text)[-1] == "[DONE]"
