"""`pagoda router`'s choices against scripted instances (httpx's MockTransport): which pair
serves a request, what the prefill half is sent, retries while nothing reached the client,
releases of parked blocks, and the 400s for what cannot be split."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

import pagoda.entrypoints.kv_transfer.router as router_mod
from pagoda.entrypoints.kv_transfer.router import PDRouter, build_router_app

P1, P2, D1, D2 = "http://p1", "http://p2", "http://d1", "http://d2"


class Instances:
    """Scripted instances: ``down`` refuse connections, ``fail`` answer 503."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.fail: set[str] = set()
        self.calls: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        if base in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/v1/kv_transfer/info":
            role = "prefill" if base.startswith("http://p") else "decode"
            return httpx.Response(200, json={"kv_role": role, "model": "m",
                                             "kv_address": f"tcp://{request.url.host}:9" if role == "prefill" else None})
        body = json.loads(request.content)
        self.calls.append((base, body))
        if base in self.fail:
            return httpx.Response(503, json={"error": {"message": "engine dead", "code": "engine_dead"}})
        if body.get("max_tokens") == -1:
            return httpx.Response(400, json={"error": {"message": "bad max_tokens"}})
        if body.get("stream"):
            return httpx.Response(200, content=b'data: {"choices": [{"text": "hi"}]}\n\ndata: [DONE]\n\n',
                                  headers={"content-type": "text/event-stream"})
        if base.startswith("http://p") and body.get("return_token_ids"):
            return httpx.Response(200, json={"choices": [{"text": "h", "prompt_token_ids": [5, 6, 7]}]})
        return httpx.Response(200, json={"choices": [{"text": "hi" if base.startswith("http://d") else "h"}]})


@pytest.fixture
def setup(monkeypatch):
    released: list[tuple[str, str]] = []
    monkeypatch.setattr(router_mod, "release_transfer", lambda address, tid: released.append((address, tid)))
    inst = Instances()

    def make(prefill=(P1,), decode=(D1,), **kw):
        router = PDRouter(list(prefill), list(decode), transport=httpx.MockTransport(inst), cooldown_s=60, **kw)
        asyncio.run(router.start(1))
        return router

    return make, inst, released


def _post(router: PDRouter, body: dict, path: str = "/v1/completions") -> httpx.Response:
    async def go() -> httpx.Response:
        app = build_router_app(router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
            r = await c.post(path, json=body)
            await r.aread()
            await asyncio.sleep(0)   # let the release callbacks run
            return r

    return asyncio.run(go())


def test_the_prefill_half_is_one_token_unstreamed_and_the_decode_half_the_request(setup):
    make, inst, released = setup
    router = make()
    r = _post(router, {"prompt": "x", "max_tokens": 9, "min_tokens": 3, "stream": True,
                       "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and b"[DONE]" in r.content
    (p_url, p_body), (d_url, d_body) = inst.calls
    assert p_url == P1 and d_url == D1
    assert p_body["max_tokens"] == 1 and p_body["min_tokens"] == 1 and p_body["stream"] is False
    assert "stream_options" not in p_body
    tid = p_body["kv_transfer_params"]["transfer_id"]
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": tid}
    assert p_body["return_token_ids"] is True
    assert d_body["max_tokens"] == 9 and d_body["stream"] is True and d_body["min_tokens"] == 3
    assert "return_token_ids" not in d_body
    # The decode half takes the prompt as the prefill instance computed it.
    assert d_body["kv_transfer_params"] == {"do_remote_prefill": True, "transfer_id": tid,
                                            "remote_address": "tcp://p1:9", "prompt_token_ids": [5, 6, 7]}
    assert released == [] and router.counts["succeeded"] == 1


def test_chat_max_completion_tokens_is_what_the_prefill_half_caps(setup):
    make, inst, _ = setup
    r = _post(make(), {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5},
              "/v1/chat/completions")
    assert r.status_code == 200
    assert inst.calls[0][1]["max_completion_tokens"] == 1 and "max_tokens" not in inst.calls[0][1]


def test_an_unreachable_prefill_instance_is_skipped(setup):
    make, inst, released = setup
    router = make(prefill=(P1, P2))
    inst.down.add(P1)
    r = _post(router, {"prompt": "x"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hi"
    assert [u for u, _ in inst.calls] == [P2, D1]
    assert released == []
    # It stays skipped for the cooldown: the next request goes straight to the other one.
    inst.calls.clear()
    assert _post(router, {"prompt": "y"}).status_code == 200
    assert [u for u, _ in inst.calls] == [P2, D1]


def test_a_failing_decode_instance_releases_the_blocks_and_the_pair_is_retried(setup):
    make, inst, released = setup
    router = make(decode=(D1, D2))
    inst.fail.add(D1)
    r = _post(router, {"prompt": "x", "stream": True})
    assert r.status_code == 200
    urls = [u for u, _ in inst.calls]
    assert urls[:2] == [P1, D1] and urls[2:] == [P1, D2]
    first_tid = inst.calls[0][1]["kv_transfer_params"]["transfer_id"]
    assert released == [("tcp://p1:9", first_tid)]        # the parked blocks of the failed pair
    assert router.counts["retries"] == 1


def test_no_pair_left_is_a_503_naming_the_last_failure(setup):
    make, inst, released = setup
    router = make(max_attempts=2)
    inst.fail.add(D1)
    r = _post(router, {"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_instance_pair"
    assert "decode instance http://d1 answered 503: engine dead" in r.json()["error"]["message"]
    assert len(released) == 1 and router.counts["failed"] == 1


def test_a_client_error_is_passed_on_and_not_retried(setup):
    make, inst, released = setup
    router = make(decode=(D1, D2))
    # The prefill half runs it (max_tokens 1); the decode instance refuses max_tokens -1.
    r = _post(router, {"prompt": "x", "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["message"] == "bad max_tokens"
    assert [u for u, _ in inst.calls] == [P1, D1]
    assert len(released) == 1 and router.counts["retries"] == 0


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ({"prompt": "x", "prompt_logprobs": 0}, "prompt_logprobs"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x", "kv_transfer_params": {}}, "kv_transfer_params"),
])
def test_what_cannot_be_split_is_a_400(setup, body, param):
    make, inst, _ = setup
    r = _post(make(), body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert inst.calls == []


def test_start_refuses_a_role_mismatch_and_a_missing_role(setup):
    make, inst, _ = setup
    with pytest.raises(ValueError, match="configured as decode"):
        make(decode=(P2,))
    inst.down.add(D1)
    with pytest.raises(ValueError, match="no decode instance"):
        make()


@pytest.mark.parametrize("answer, ids", [
    ({"prompt_token_ids": [1, 2], "choices": [{"message": {}}]}, [1, 2]),      # chat: at the top
    ({"choices": [{"text": "h", "prompt_token_ids": [3]}]}, [3]),              # completions: in the choice
    ({"choices": [{"text": "h"}]}, None),                                      # an answer without them
    ({"choices": [{"text": "h", "prompt_token_ids": ["x"]}]}, None),
])
def test_the_prefill_answers_prompt_ids_are_read_from_either_shape(answer, ids):
    assert router_mod._prompt_token_ids(json.dumps(answer).encode()) == ids
