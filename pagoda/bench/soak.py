"""`pagoda bench soak`: a chaos / soak client for a running pagoda server.

A bounded pool of async clients on one base URL sends a seeded random mix of
well-formed requests (completions and chat, streamed or not, random valid
sampling parameters), clients that disconnect mid-stream, abort-then-retry
pairs, requests over max_model_len, and malformed ones (bad JSON, wrong types,
unknown fields, invalid UTF-8, huge n / max_tokens, negative values, empty
messages, unknown models). Every response is checked as it comes:

- well-formed: 200, and usage.completion_tokens equals the tokens received
  (counted through logprobs, which carry one entry per token), and a choice
  finished by "length" has exactly max_tokens tokens;
- bad: a 4xx with an OpenAI-style error body ({"error": {message, type, param, code}});
- never a 5xx.

Afterwards (``check_server``) the engine must be idle with an empty KV cache and
POST /debug/check_integrity (``pagoda serve --enable-debug-endpoints``) must pass.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

WORDS = ("the sea river mountain quiet number seven blue fast story garden light paper "
         "engine window market autumn letter music bridge winter").split()
WELL_FORMED = ("completion", "chat", "stream_completion", "stream_chat", "abort_retry")
BAD = ("malformed_json", "wrong_type", "unknown_field", "invalid_utf8", "huge_n", "huge_max_tokens",
       "negative_value", "empty_messages", "unknown_model", "too_long_prompt", "too_long_max_tokens")


@dataclass
class SoakConfig:
    num_requests: int = 300
    concurrency: int = 16
    max_tokens: int = 16
    disconnect_frac: float = 0.3
    bad_frac: float = 0.25
    seed: int = 0
    timeout: float = 120.0


@dataclass
class SoakReport:
    categories: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    duration_s: float = 0.0

    def fail(self, category: str, message: str) -> None:
        self.failures.append(f"{category}: {message}")

    @property
    def num_5xx(self) -> int:
        return sum(v for k, v in self.statuses.items() if isinstance(k, int) and k >= 500)

    def as_dict(self) -> dict[str, Any]:
        return {"categories": dict(sorted(self.categories.items())),
                "statuses": {str(k): v for k, v in sorted(self.statuses.items(), key=lambda kv: str(kv[0]))},
                "num_5xx": self.num_5xx, "num_failures": len(self.failures), "failures": self.failures[:50],
                "completion_tokens": self.completion_tokens, "duration_s": round(self.duration_s, 2)}


def _prompt(rng: random.Random, lo: int = 3, hi: int = 40) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _random_params(rng: random.Random, max_tokens: int) -> dict[str, Any]:
    p: dict[str, Any] = {"max_tokens": rng.randint(1, max_tokens), "n": rng.choice((1, 1, 1, 2))}
    if rng.random() < 0.5:
        p["temperature"] = round(rng.uniform(0.0, 1.5), 2)
    if rng.random() < 0.3:
        p["top_p"] = round(rng.uniform(0.1, 1.0), 2)
    if rng.random() < 0.3:
        p["top_k"] = rng.randint(1, 50)
    if rng.random() < 0.3:
        p["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.2:
        p["presence_penalty"] = round(rng.uniform(-1.0, 1.0), 2)
    if rng.random() < 0.3:
        p["ignore_eos"] = True
    return p


def make_request(kind: str, rng: random.Random, model: str, max_tokens: int,
                 max_model_len: int) -> tuple[str, dict[str, Any] | bytes]:
    """(path, JSON body or raw bytes) for a request of this kind."""
    chat = kind in ("chat", "stream_chat") or (kind not in ("completion", "stream_completion") and rng.random() < 0.5)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": model, **_random_params(rng, max_tokens)}
    if chat:
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
        body["logprobs"] = True
        if rng.random() < 0.3:
            body["top_logprobs"] = rng.randint(0, 3)
    else:
        body["prompt"] = _prompt(rng)
        body["logprobs"] = rng.randint(0, 2)
    if kind.startswith("stream") or kind in ("abort_retry", "disconnect"):
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if kind == "malformed_json":
        return path, json.dumps(body).encode()[: rng.randint(1, 20)]
    if kind == "invalid_utf8":
        return path, json.dumps(body).encode().replace(b'"model"', b'"mo\xff\xfedel"', 1)
    if kind == "wrong_type":
        key = rng.choice(("max_tokens", "temperature", "n", "stream"))
        body[key] = rng.choice(("16", [1], {"x": 1}, "yes"))
    elif kind == "unknown_field":
        body[f"unknown_{rng.randint(0, 99)}"] = 1
    elif kind == "huge_n":
        body["n"] = rng.choice((10**3, 10**6, 2**40))
    elif kind == "huge_max_tokens":
        body["max_tokens"] = rng.choice((10**6, 10**9, 2**63))
    elif kind == "negative_value":
        key, value = rng.choice((("max_tokens", -1), ("n", -2), ("temperature", -0.5), ("top_p", -1.0),
                                 ("top_k", -5), ("min_tokens", -3)))
        body[key] = value
    elif kind == "empty_messages":
        path = "/v1/chat/completions"
        body.pop("prompt", None)
        body.pop("logprobs", None)
        body["messages"] = []
    elif kind == "unknown_model":
        body["model"] = f"no-such-model-{rng.randint(0, 999)}"
    elif kind == "too_long_prompt":
        text = " ".join(rng.choice(WORDS) for _ in range(max_model_len + 50))
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
    elif kind == "too_long_max_tokens":
        body["max_tokens"] = max_model_len
    return path, body


def _count_tokens(choice: dict[str, Any]) -> int:
    lp = choice.get("logprobs") or {}
    if "content" in lp:
        return len(lp.get("content") or [])
    return len(lp.get("tokens") or [])


def check_usage(category: str, body: dict[str, Any], tokens: dict[int, int], finish: dict[int, str],
                max_tokens: int, n: int, report: SoakReport) -> None:
    """Token accounting: usage.completion_tokens == tokens received; "length" ⇒ max_tokens tokens."""
    usage = body.get("usage")
    if not usage:
        report.fail(category, f"no usage in {body!r:.200}")
        return
    if len(finish) != n:
        report.fail(category, f"{len(finish)} finished choices, expected {n}")
    total = sum(tokens.values())
    if usage["completion_tokens"] != total:
        report.fail(category, f"usage.completion_tokens {usage['completion_tokens']} != {total} received")
    if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        report.fail(category, f"inconsistent usage {usage}")
    for i, reason in finish.items():
        if reason == "length" and tokens.get(i, 0) != max_tokens:
            report.fail(category, f"choice {i} finished by length with {tokens.get(i, 0)} != {max_tokens} tokens")
    report.completion_tokens += total


async def _one(client: httpx.AsyncClient, kind: str, rng: random.Random, cfg: SoakConfig, model: str,
               max_model_len: int, report: SoakReport) -> None:
    path, body = make_request(kind, rng, model, cfg.max_tokens, max_model_len)
    report.categories[kind] += 1
    if kind == "abort_retry":
        assert isinstance(body, dict)
        await _stream(client, kind, path, body, report, disconnect_after=rng.randint(0, 3))
        await _stream(client, kind, path, body, report, disconnect_after=None)
    elif kind == "disconnect":
        assert isinstance(body, dict)
        await _stream(client, kind, path, body, report, disconnect_after=rng.randint(0, 8))
    elif kind in BAD:
        await _bad(client, kind, path, body, report)
    elif isinstance(body, dict) and body.get("stream"):
        await _stream(client, kind, path, body, report, disconnect_after=None)
    else:
        assert isinstance(body, dict)
        r = await client.post(path, json=body)
        report.statuses[r.status_code] += 1
        if r.status_code != 200:
            report.fail(kind, f"status {r.status_code}: {r.text[:200]}")
            return
        data = r.json()
        tokens = {c["index"]: _count_tokens(c) for c in data["choices"]}
        finish = {c["index"]: c["finish_reason"] for c in data["choices"]}
        check_usage(kind, data, tokens, finish, body["max_tokens"], body["n"], report)


async def _stream(client: httpx.AsyncClient, kind: str, path: str, body: dict[str, Any], report: SoakReport,
                  disconnect_after: int | None) -> None:
    tokens: Counter = Counter()
    finish: dict[int, str] = {}
    last: dict[str, Any] = {}
    done = False
    async with client.stream("POST", path, json=body) as r:
        report.statuses[r.status_code] += 1
        if r.status_code != 200:
            report.fail(kind, f"status {r.status_code}: {(await r.aread())[:200]!r}")
            return
        events = 0
        async for line in r.aiter_lines():
            if disconnect_after is not None and events >= disconnect_after:
                return  # leaving the block closes the connection mid-stream
            if not line.startswith("data: "):
                continue
            events += 1
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                report.fail(kind, f"error event {event['error']}")
                return
            for c in event.get("choices") or []:
                tokens[c["index"]] += _count_tokens(c)
                if c.get("finish_reason"):
                    finish[c["index"]] = c["finish_reason"]
            if event.get("usage"):
                last = event
    if disconnect_after is not None and not done:
        return
    if not done:
        report.fail(kind, "stream ended without [DONE]")
        return
    check_usage(kind, last, dict(tokens), finish, body["max_tokens"], body["n"], report)


async def _bad(client: httpx.AsyncClient, kind: str, path: str, body: dict[str, Any] | bytes,
               report: SoakReport) -> None:
    if isinstance(body, bytes):
        r = await client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = await client.post(path, json=body)
    report.statuses[r.status_code] += 1
    if not 400 <= r.status_code < 500:
        report.fail(kind, f"expected a 4xx, got {r.status_code}: {r.text[:200]}")
        return
    try:
        err = r.json()["error"]
        assert {"message", "type", "param", "code"} <= set(err) and err["message"]
    except Exception:
        report.fail(kind, f"not an OpenAI-style error body: {r.text[:200]}")


def pick_kind(rng: random.Random, cfg: SoakConfig) -> str:
    x = rng.random()
    if x < cfg.bad_frac:
        return rng.choice(BAD)
    if x < cfg.bad_frac + cfg.disconnect_frac:
        return "disconnect"
    return rng.choice(WELL_FORMED)


async def run_soak(base_url: str, model: str, cfg: SoakConfig, max_model_len: int) -> SoakReport:
    """Send cfg.num_requests requests with at most cfg.concurrency in flight."""
    report = SoakReport()
    rng = random.Random(cfg.seed)
    # Every kind at least once (when num_requests allows), the rest drawn at random.
    kinds = [*BAD, *WELL_FORMED, "disconnect"][: cfg.num_requests]
    kinds += [pick_kind(rng, cfg) for _ in range(cfg.num_requests - len(kinds))]
    rng.shuffle(kinds)
    jobs = [(kind, random.Random(rng.getrandbits(64))) for kind in kinds]
    sem = asyncio.Semaphore(cfg.concurrency)
    limits = httpx.Limits(max_connections=cfg.concurrency * 2, max_keepalive_connections=cfg.concurrency)
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, timeout=cfg.timeout, limits=limits) as client:

        async def job(kind: str, r: random.Random) -> None:
            async with sem:
                state = r.getstate()
                try:
                    await _one(client, kind, r, cfg, model, max_model_len, report)
                except Exception as e:  # a hang (timeout), a dropped connection, a bad body
                    again = random.Random()
                    again.setstate(state)
                    path, body = make_request(kind, again, model, cfg.max_tokens, max_model_len)
                    report.fail(kind, f"{type(e).__name__}: {e} on {path} {body!r:.300}")

        await asyncio.gather(*(job(k, r) for k, r in jobs))
    report.duration_s = time.monotonic() - start
    return report


def check_server(base_url: str, idle_timeout: float = 30.0) -> dict[str, Any]:
    """Health 200, the engine idle with kv_cache_usage 0, and /debug/check_integrity ok.
    Returns the integrity answer (with engine_pid and stats); raises AssertionError otherwise."""
    with httpx.Client(base_url=base_url, timeout=30) as http:
        assert http.get("/health").status_code == 200, "the server is not healthy"
        deadline = time.monotonic() + idle_timeout
        while True:
            stats = http.get("/v1/engine/stats").json()
            if stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0 and stats["kv_cache_usage"] == 0:
                break
            assert time.monotonic() < deadline, f"engine not idle after the soak: {stats}"
            time.sleep(0.2)
        r = http.post("/debug/check_integrity")
        assert r.status_code == 200 and r.json()["ok"], f"integrity check failed: {r.status_code} {r.text}"
        result: dict[str, Any] = r.json()
        assert result["stats"]["num_free_blocks"] == result["stats"]["num_blocks"], result
        return result


def rss_kib(pid: int) -> int | None:
    """VmRSS of a local process in KiB (None if it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def add_soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="a server started with `pagoda serve --enable-debug-endpoints`")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--num-requests", type=int, default=2000, help="per round")
    p.add_argument("--rounds", type=int, default=2, help="soak rounds; engine RSS is read after each")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", default=None, help="write the report as JSON here")


def run_soak_command(args: argparse.Namespace) -> int:
    with httpx.Client(base_url=args.base_url, timeout=30) as http:
        card = http.get("/v1/models").json()["data"][0]
    model = args.model or card["id"]
    pid = check_server(args.base_url)["engine_pid"]
    rounds: list[dict[str, Any]] = []
    rss = [rss_kib(pid)]
    for i in range(args.rounds):
        cfg = SoakConfig(num_requests=args.num_requests, concurrency=args.concurrency,
                         max_tokens=args.max_tokens, seed=args.seed + i)
        report = asyncio.run(run_soak(args.base_url, model, cfg, card["max_model_len"]))
        check_server(args.base_url)
        rss.append(rss_kib(pid))
        rounds.append(report.as_dict())
        print(f"round {i}: {json.dumps(report.as_dict(), indent=1)}")
        print(f"engine RSS after round {i}: {rss[-1]} KiB (before: {rss[0]} KiB)")
    result = {"rounds": rounds, "engine_rss_kib": rss, "num_requests": args.num_requests,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens}
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=1)
    ok = all(r["num_5xx"] == 0 and r["num_failures"] == 0 for r in rounds)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1
