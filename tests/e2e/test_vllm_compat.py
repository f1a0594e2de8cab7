"""vLLM's extras to the OpenAI API, as a vLLM user sends them (fake engine, real HTTP server):
request fields, /tokenize with chat options, /tokenizer_info, /invocations, /load, ORCA load
headers, vllm: metric names, tool schemas with $defs, vLLM's error words, runtime LoRA policy."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import threading
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.hub.paths import default_model_path
from tests.e2e.conftest import MODEL
from tests.e2e.fake_engine import FakeEngine
from tests.e2e.server_utils import running_server, sse_events

HI = [{"role": "user", "content": "Hello there"}]


def error_of(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return r.json()["error"]


def stream(http: httpx.Client, path: str, body: dict[str, Any], **kwargs: Any) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={**body, "stream": True}, **kwargs) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    return events[:-1]


# ---------------------------------------------------------------------- chat template controls
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.reasoning_content %}[reasoning: {{ m.reasoning_content }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_server():
    """A server whose chat template reads a chat_template_kwargs variable and an extra message key."""
    engine = FakeEngine()
    engine.tokenizer = copy.copy(engine.tokenizer)
    engine.tokenizer.chat_template = THINKING_TEMPLATE
    with running_server(engine) as running, httpx.Client(base_url=running.base_url, timeout=30) as http:
        yield engine, http


def test_chat_template_kwargs_reach_the_template(thinking_server) -> None:
    engine, http = thinking_server
    client = openai.OpenAI(base_url=f"{str(http.base_url).rstrip('/')}/v1", api_key="x", max_retries=0)
    for kwargs, thinks in (({"enable_thinking": False}, False), ({"enable_thinking": True}, True), (None, True)):
        extra = {"chat_template_kwargs": kwargs} if kwargs is not None else {}
        out = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, extra_body=extra)
        assert out.choices[0].message.content
        assert ("<think></think>" not in engine.calls[-1].prompt) == thinks
    err = error_of(http.post("/v1/chat/completions", json={"messages": HI, "chat_template_kwargs": {"messages": []}}))
    assert err["param"] == "chat_template_kwargs" and "messages" in err["message"]


def test_extra_message_keys_and_custom_roles_reach_the_template(thinking_server, http: httpx.Client) -> None:
    engine, thinking = thinking_server
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "reasoning_content": "be nice"},
                {"role": "narrator", "content": "Time passes."}, {"role": "user", "content": "Bye"}]  # fmt: skip
    r = thinking.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    prompt = engine.calls[-1].prompt
    assert "Hello[reasoning: be nice]" in prompt and "<|im_start|>narrator\nTime passes." in prompt
    # Unknown top-level fields are still refused.
    err = error_of(http.post("/v1/chat/completions", json={"messages": HI, "thinking_budget": 3}))
    assert err["code"] == "unknown_parameter" and err["param"] == "thinking_budget"


def test_continue_final_message(http: httpx.Client, engine: FakeEngine) -> None:
    messages = [*HI, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": messages, "max_tokens": 2, "continue_final_message": True}
    err = error_of(http.post("/v1/chat/completions", json=body))  # add_generation_prompt defaults to true
    assert err["message"] == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    r = http.post("/v1/chat/completions", json={**body, "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    prompt = engine.calls[-1].prompt
    assert prompt.endswith("<|im_start|>assistant\nThe answer is")  # open: no <|im_end|> after it
    # Without it the turn is closed, and add_generation_prompt=false opens no new one.
    http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "add_generation_prompt": False})
    assert engine.calls[-1].prompt.endswith("The answer is<|im_end|>\n")
    tokenize = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    tokens = http.post("/tokenize", json=tokenize).json()["tokens"]
    assert tokens == engine.calls[-2].prompt_token_ids


def test_chat_echo(http: httpx.Client) -> None:
    """vLLM's chat echo: the reply starts with the last message when it has the reply's role
    (an assistant message being continued), streamed or not; otherwise nothing is added."""
    messages = [*HI, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": messages, "max_tokens": 3, "continue_final_message": True, "add_generation_prompt": False,
            "echo": True}
    r = http.post("/v1/chat/completions", json=body).json()
    content = r["choices"][0]["message"]["content"]
    assert content.startswith("The answer is") and len(content) > len("The answer is")
    plain = http.post("/v1/chat/completions", json={**body, "echo": False}).json()
    assert content == "The answer is" + plain["choices"][0]["message"]["content"]
    events = stream(http, "/v1/chat/completions", body)
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert streamed == content
    # A user message last, a reply opened for the assistant: the roles differ, nothing is echoed.
    r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 3, "echo": True}).json()
    again = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 3}).json()
    assert r["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]


# ---------------------------------------------------------------------- token ids in responses
def test_return_token_ids(client: openai.OpenAI, http: httpx.Client, engine: FakeEngine) -> None:
    out = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, extra_body={"return_token_ids": True})
    raw = out.model_dump()
    assert raw["prompt_token_ids"] == engine.calls[-1].prompt_token_ids
    assert engine.tokenizer.decode(raw["choices"][0]["token_ids"]) == out.choices[0].message.content
    plain = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]

    chunks = stream(http, "/v1/chat/completions", {"messages": HI, "max_tokens": 5, "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == engine.calls[-1].prompt_token_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert len(ids) == 5 and engine.tokenizer.decode(ids) == text

    comp = http.post("/v1/completions", json={"prompt": ["One", "Two"], "max_tokens": 3, "return_token_ids": True})
    for choice, call in zip(comp.json()["choices"], engine.calls[-2:], strict=True):
        assert choice["prompt_token_ids"] == call.prompt_token_ids
        assert engine.tokenizer.decode(choice["token_ids"]) == choice["text"]
    chunks = stream(http, "/v1/completions", {"prompt": "One", "max_tokens": 3, "return_token_ids": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == engine.calls[-1].prompt_token_ids
    assert "prompt_token_ids" not in chunks[1]["choices"][0]
    assert engine.tokenizer.decode([t for c in chunks for t in c["choices"][0]["token_ids"]]) == "".join(
        c["choices"][0]["text"] for c in chunks)


def test_return_tokens_as_token_ids(http: httpx.Client, engine: FakeEngine) -> None:
    body = {"messages": HI, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True,
            "return_token_ids": True}  # fmt: skip
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", alt["token"]) for e in entries for alt in e["top_logprobs"])
    # bytes stay the token's own bytes.
    assert bytes(b for e in entries for b in e["bytes"]).decode() == choice["message"]["content"]
    comp = http.post("/v1/completions", json={"prompt": "One", "max_tokens": 3, "logprobs": 1,
                                              "return_tokens_as_token_ids": True, "return_token_ids": True}).json()
    lp = comp["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in comp["choices"][0]["token_ids"]]
    assert all(all(k.startswith("token_id:") for k in top) for top in lp["top_logprobs"])


# ---------------------------------------------------------------------- truncation and usage
def test_truncate_prompt_tokens(http: httpx.Client, engine: FakeEngine) -> None:
    ids = list(range(100, 150))
    out = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 10}).json()
    assert out["usage"]["prompt_tokens"] == 10 and engine.calls[-1].prompt_token_ids == ids[-10:]
    full = http.post("/tokenize", json={"messages": HI}).json()["tokens"]
    out = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "truncate_prompt_tokens": 4})
    assert out.json()["usage"]["prompt_tokens"] == 4 and engine.calls[-1].prompt_token_ids == full[-4:]
    # Shorter prompts are kept whole; -1 means max_model_len.
    http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert engine.calls[-1].prompt_token_ids == ids
    err = error_of(http.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": 100000}))
    assert err["message"].startswith("truncate_prompt_tokens value (100000) is greater than max_model_len (512)")
    for bad in (0, -2):
        assert error_of(http.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": bad}))[
            "param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats(http: httpx.Client, path: str) -> None:
    body = {"max_tokens": 4, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            **({"messages": HI} if "chat" in path else {"prompt": "One"})}  # fmt: skip
    chunks = stream(http, path, body)
    assert all(c["usage"] is not None for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4
    assert chunks[-1]["choices"] == [] and len({c["usage"]["prompt_tokens"] for c in chunks}) == 1
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)  # fmt: skip


def test_force_include_usage() -> None:
    engine = FakeEngine()
    with running_server(engine, enable_force_include_usage=True) as s, httpx.Client(base_url=s.base_url) as http:
        for path, body in (("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "One"})):
            chunks = stream(http, path, {**body, "max_tokens": 3})
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------------- /tokenize, /tokenizer_info, /v1/models
def test_tokenize_chat_options(http: httpx.Client, engine: FakeEngine) -> None:
    plain = http.post("/tokenize", json={"messages": HI, "return_token_strs": True}).json()
    assert plain["token_strs"] == [engine.tokenizer.id_to_token(t) for t in plain["tokens"]]
    chat = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1}).json()
    assert plain["count"] == chat["usage"]["prompt_tokens"] == len(engine.calls[-1].prompt_token_ids)
    bare = http.post("/tokenize", json={"messages": HI, "add_generation_prompt": False}).json()
    assert plain["tokens"][: bare["count"]] == bare["tokens"] and bare["count"] < plain["count"]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with_tools = http.post("/tokenize", json={"messages": HI, "tools": [tool]}).json()
    assert "get_weather" in engine.tokenizer.decode(with_tools["tokens"])
    assert "token_strs" not in with_tools or with_tools["token_strs"] is None
    err = error_of(http.post("/tokenize", json={"prompt": "x", "tools": [tool]}))
    assert err["param"] == "tools"
    err = error_of(http.post("/tokenize", json={"messages": HI, "continue_final_message": True}))
    assert "continue_final_message" in err["message"]


def test_tokenizer_info_and_model_root(http: httpx.Client, engine: FakeEngine) -> None:
    info = http.get("/tokenizer_info").json()
    tok = engine.tokenizer
    assert info["tokenizer_class"] and info["chat_template"] == tok.chat_template
    assert info["eos_token"] == tok.id_to_token(tok.eos_token_id) and info["model_max_length"] == engine.max_model_len
    assert info["added_tokens_decoder"][str(tok.eos_token_id)]["content"] == info["eos_token"]
    card = http.get("/v1/models").json()["data"][0]
    assert card["root"] == default_model_path() and card["parent"] is None


# ---------------------------------------------------------------------- /invocations, /load, ORCA
def test_invocations_dispatch_on_the_body(http: httpx.Client) -> None:
    chat = http.post("/invocations", json={"messages": HI, "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"]
    comp = http.post("/invocations", json={"prompt": "One", "max_tokens": 2}).json()
    assert comp["object"] == "text_completion" and comp["choices"][0]["text"]
    chunks = stream(http, "/invocations", {"messages": HI, "max_tokens": 2})
    assert chunks[0]["object"] == "chat.completion.chunk"
    err = error_of(http.post("/invocations", json={"messages": HI, "temprature": 1}))
    assert err["param"] == "temprature"  # the chosen API's own checks
    assert "messages" in error_of(http.post("/invocations", json={"input": "x"}))["message"]


def test_invocations_need_the_api_key() -> None:
    with running_server(FakeEngine(), api_key="sekret") as s, httpx.Client(base_url=s.base_url) as http:
        body = {"prompt": "One", "max_tokens": 1}
        assert error_of(http.post("/invocations", json=body), 401)["code"] == "invalid_api_key"
        ok = http.post("/invocations", json=body, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


def test_load_counts_requests_in_flight(http: httpx.Client, engine: FakeEngine) -> None:
    assert http.get("/load").json() == {"server_load": 0}
    engine.hold_first_token = True
    done = threading.Event()

    def run() -> None:
        with httpx.Client(base_url=str(http.base_url), timeout=30) as other:
            other.post("/v1/completions", json={"prompt": "One", "max_tokens": 2})
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        for _ in range(200):
            if http.get("/load").json()["server_load"] == 1:
                break
            threading.Event().wait(0.01)
        assert http.get("/load").json() == {"server_load": 1}
    finally:
        engine.hold_first_token = False
        thread.join(30)
    assert done.is_set() and http.get("/load").json() == {"server_load": 0}


def test_orca_load_header(http: httpx.Client) -> None:
    body = {"messages": HI, "max_tokens": 1}
    text = http.post("/v1/chat/completions", json=body, headers={"endpoint-load-metrics-format": "text"})
    header = text.headers["endpoint-load-metrics"]
    assert header.startswith("TEXT ")
    pairs = dict(item.split("=") for item in header[len("TEXT "):].split(", "))
    assert float(pairs["named_metrics.kv_cache_usage_perc"]) == 0.25  # the fake engine's figure
    assert float(pairs["named_metrics.num_requests_waiting"]) == 0.0
    as_json = http.post("/v1/completions", json={"prompt": "One", "max_tokens": 1},
                        headers={"endpoint-load-metrics-format": "JSON"}).headers["endpoint-load-metrics"]
    assert as_json.startswith("JSON ") and json.loads(as_json[5:])["named_metrics"]["kv_cache_usage_perc"] == 0.25
    chunks_response = http.post("/v1/chat/completions", json={**body, "stream": True},
                                headers={"endpoint-load-metrics-format": "text"})
    assert chunks_response.headers["endpoint-load-metrics"].startswith("TEXT ")
    assert "endpoint-load-metrics" not in http.post("/v1/chat/completions", json=body).headers
    unknown = http.post("/v1/chat/completions", json=body, headers={"endpoint-load-metrics-format": "bin"})
    assert unknown.status_code == 200 and "endpoint-load-metrics" not in unknown.headers


def test_vllm_metric_names(http: httpx.Client) -> None:
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits"):
        ours, theirs = families[f"pagoda:{name}"], families[f"vllm:{name}"]
        assert [s.value for s in ours.samples] == [s.value for s in theirs.samples]
        assert [s.labels for s in ours.samples] == [s.labels for s in theirs.samples]
    assert families["vllm:kv_cache_usage_perc"].samples[0].value == 0.25
    assert "vllm:kv_cache_num_blocks" not in families  # only names vLLM has


# ---------------------------------------------------------------------- tools, errors
def test_tool_schema_with_defs(http: httpx.Client, engine: FakeEngine) -> None:
    params = {"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"],
              "$defs": {"Item": {"type": "object", "properties": {"n": {"type": "integer"},
                                                                  "child": {"$ref": "#/$defs/Item"}}}}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": n, "parameters": params}} for n in ("a", "b")]
    for choice in ({"type": "function", "function": {"name": "b"}}, "required"):
        r = http.post("/v1/chat/completions", json={"messages": HI, "tools": tools, "tool_choice": choice,
                                                    "max_tokens": 2})  # fmt: skip
        assert r.status_code == 200, r.text
        assert "/properties/arguments/$defs/Item" in engine.calls[-1].params.structured_outputs.grammar


def test_vllm_error_words(http: httpx.Client) -> None:
    err = error_of(http.post("/v1/completions", json={"prompt": "", "max_tokens": 1}))
    assert err["message"] == "The decoder prompt cannot be empty"
    err = error_of(http.post("/v1/completions", json={"prompt": [1, 999999], "max_tokens": 1}))
    assert err["message"].startswith("Token id 999999 is out of vocabulary")
    err = error_of(http.post("/v1/completions", json={"prompt": [999998, 999999]}))
    assert err["message"].startswith("Token ids [999998, 999999] are out of vocabulary")
    err = error_of(http.post("/v1/chat/completions", json={"messages": HI, "logit_bias": {"a": 1, "7": 1, "b": 2}}))
    assert "'a'" in err["message"] and "'b'" in err["message"] and "'7'" not in err["message"]
    assert err["param"] == "logit_bias"
    err = error_of(http.post("/v1/chat/completions", json={"messages": HI, "logit_bias": {"999998": 1, "999999": 1}}))
    assert "[999998, 999999] contain out-of-vocab token ids" in err["message"]


# ---------------------------------------------------------------------- runtime LoRA loading
def _adapter(folder: os.PathLike[str] | str) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        f.write("{}")
    return str(folder)


def test_runtime_lora_is_off_unless_allowed(tmp_path) -> None:
    engine = FakeEngine()
    engine.config = dataclasses.replace(engine.config, enable_lora=True)
    adapter = _adapter(tmp_path / "root" / "mine")
    with running_server(engine) as s, httpx.Client(base_url=s.base_url) as http:
        err = error_of(http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapter}))
        assert err["code"] == "runtime_lora_disabled"
        assert error_of(http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}))["code"] == "runtime_lora_disabled"
    with pytest.raises(ValueError, match="--lora-root"), running_server(engine, allow_runtime_lora=True):
        pass


def test_runtime_lora_only_from_the_roots(tmp_path) -> None:
    engine = FakeEngine()
    engine.config = dataclasses.replace(engine.config, enable_lora=True)
    root = tmp_path / "root"
    inside = _adapter(root / "good")
    outside = _adapter(tmp_path / "elsewhere")
    os.symlink(outside, root / "link")
    (root / "a_file").write_text("x")
    os.makedirs(root / "empty")
    refused = [outside, str(root / "link"), str(root / "good" / ".." / ".." / "elsewhere"), "../elsewhere",
               str(root / "missing"), str(root / "a_file"), str(root / "empty"), str(root), "/etc", "/etc/passwd"]
    with running_server(engine, allow_runtime_lora=True, lora_roots=(str(root),)) as s, \
            httpx.Client(base_url=s.base_url) as http:  # fmt: skip
        messages = set()
        for i, path in enumerate(refused):
            err = error_of(http.post("/v1/load_lora_adapter", json={"lora_name": f"x{i}", "lora_path": path}))
            assert err["param"] == "lora_path" and err["code"] == "invalid_lora_path"
            messages.add(err["message"])
        assert len(messages) == 1 and str(tmp_path) not in messages.pop()  # one answer, no path echoed
        for name, path in (("abs", inside), ("rel", "good")):
            r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            assert r.status_code == 200, r.text
        cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        assert cards["abs"]["root"] == cards["rel"]["root"] == os.path.realpath(inside)
        assert cards["abs"]["parent"] == MODEL
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "rel"}).status_code == 200
