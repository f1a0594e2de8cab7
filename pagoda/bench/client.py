"""The load generator of `pagoda bench serve`: streamed requests over httpx, timed per chunk.

One `RequestResult` per request. The clock is `time.perf_counter()`; a chunk's time is
when its SSE line was read, i.e. when the client could have shown its text.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx

from pagoda.bench.datasets import Conversation, Turn, chat_history, completion_history
from pagoda.bench.metrics import RequestResult


@dataclass
class RequestSpec:
    """What every request of a run shares."""

    api_url: str
    model: str
    chat: bool                      # /v1/chat/completions (messages) or /v1/completions (prompt)
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] | None = None
    headers: dict[str, str] | None = None


def build_payload(spec: RequestSpec, turn: Turn, history: list[tuple[str, str]], max_tokens: int) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": spec.model,
        "max_tokens": max_tokens,
        "temperature": spec.temperature,
        "stream": True,
        # Output tokens are counted from the final usage chunk, not from chunks: a chunk
        # may carry several tokens, or none (text held back until it decodes cleanly).
        "stream_options": {"include_usage": True},
    }
    if spec.chat:
        payload["messages"] = turn.messages if turn.messages is not None else chat_history(history, turn.prompt or "")
    else:
        if turn.messages is not None:
            raise ValueError("a JSONL line with 'messages' needs --endpoint /v1/chat/completions")
        payload["prompt"] = turn.prompt if not history else completion_history(history, turn.prompt or "")
    if spec.ignore_eos:
        payload["ignore_eos"] = True   # an extra field that pagoda, vLLM and llama-server accept
    if spec.extra_body:
        payload.update(spec.extra_body)
    return payload


def _chunk_text(event: dict[str, Any], chat: bool) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if chat:
        delta = c.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return c.get("text") or ""


async def send_request(
    client: httpx.AsyncClient,
    spec: RequestSpec,
    payload: dict[str, Any],
    count_tokens: Callable[[str], int] | None = None,
) -> RequestResult:
    r = RequestResult()
    text_parts: list[str] = []
    usage: dict[str, Any] | None = None
    num_chunks = 0
    r.start_time = time.perf_counter()
    try:
        async with client.stream("POST", spec.api_url, json=payload, headers=spec.headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                r.error = f"HTTP {resp.status_code}: {body[:300]}"
                r.end_time = time.perf_counter()
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue   # blank separators, SSE comments (keep-alives)
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    r.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    break
                text = _chunk_text(event, spec.chat)
                if text:
                    r.chunk_times.append(now)
                    text_parts.append(text)
                    num_chunks += 1
                if event.get("usage"):
                    usage = event["usage"]
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        r.error = f"{type(e).__name__}: {e}"
    r.end_time = time.perf_counter()
    r.generated_text = "".join(text_parts)
    if r.error:
        return r
    if usage and usage.get("completion_tokens") is not None:
        r.output_tokens, r.output_tokens_source = int(usage["completion_tokens"]), "usage"
        r.prompt_len = int(usage.get("prompt_tokens") or 0)
    elif count_tokens is not None:
        r.output_tokens, r.output_tokens_source = count_tokens(r.generated_text), "tokenizer"
    else:
        r.output_tokens, r.output_tokens_source = num_chunks, "chunks"
    if not r.chunk_times:
        r.error = "the stream carried no generated text"
        return r
    r.success = True
    return r


def arrival_delays(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps before each of n arrivals: gamma-distributed with mean 1/rate; shape = burstiness
    (1 = Poisson arrivals, < 1 burstier, > 1 more regular). An infinite rate sends all at once."""
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


async def run_load(
    client: httpx.AsyncClient,
    spec: RequestSpec,
    conversations: list[Conversation],
    max_concurrency: int | None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Run every conversation; returns each turn's result (in conversation order) and the
    wall time from the first send to the last reply.

    A conversation holds its concurrency slot through all its turns (one user, one
    session), and each turn is sent as soon as the previous reply ends."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[list[RequestResult]] = [[] for _ in conversations]

    async def one(i: int, conv: Conversation) -> None:
        history: list[tuple[str, str]] = []
        for turn in conv.turns:
            payload = build_payload(spec, turn, history, turn.output_len)
            res = await send_request(client, spec, payload, count_tokens)
            if res.success and not res.prompt_len:
                res.prompt_len = turn.prompt_len if not history else (
                    count_tokens(str(payload.get("prompt") or payload.get("messages"))) if count_tokens else 0)
            results[i].append(res)
            if on_done is not None:
                on_done(res)
            if not res.success:
                break   # the conversation cannot go on without this reply
            history.append((turn.prompt or "", res.generated_text))

    async def limited(i: int, conv: Conversation) -> None:
        if sem is None:
            await one(i, conv)
        else:
            async with sem:
                await one(i, conv)

    delays = arrival_delays(len(conversations), request_rate, burstiness, seed)
    start = time.perf_counter()
    tasks = []
    for i, (conv, delay) in enumerate(zip(conversations, delays)):
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(i, conv)))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return [r for rs in results for r in rs], duration


def make_client(max_connections: int | None, timeout_s: float | None) -> httpx.AsyncClient:
    # trust_env=False: a proxy from the environment must not sit between client and server.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        trust_env=False,
    )
