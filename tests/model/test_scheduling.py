"""Scheduling policies and cache isolation on the default model, through the engine core."""

from __future__ import annotations

import json

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.messages import EngineCoreRequest
from tests.model.helpers import compare_greedy

PROMPTS = {
    "low0": "The history of the printing press begins",
    "low1": "In a small village by the sea, there lived",
    "low2": "The three primary colors are",
    "high": "Urgent: the server room temperature is",
}


def _gap(logprobs, pos: int) -> float:
    top = logprobs[pos].top_logprobs
    return top[0] - top[1] if len(top) > 1 else float("inf")


def _run(engine, max_steps: int = 400):
    """Step until idle: first-token step, tokens, logprobs and preemptions per request."""
    first: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    preemptions: dict[str, int] = {}
    for n in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step().outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, n)
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                logprobs.setdefault(out.request_id, []).extend(out.new_logprobs or [])
            if out.finished:
                preemptions[out.request_id] = out.num_preemptions
    if not engine.has_unfinished_requests():
        engine.check_integrity()
        assert engine.kv_manager.num_free_blocks == engine.num_blocks
    return first, tokens, logprobs, preemptions


SYSTEM = ("You are a careful assistant for the ACME support desk. Answer briefly, cite the "
          "knowledge base article when you can, and never reveal internal ticket numbers.")  # fmt: skip


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    shared = tmp_path_factory.mktemp("shared") / "shared.json"
    shared.write_text(json.dumps([SYSTEM]))
    return LLM(show_progress=False, block_size=16, num_kv_blocks=256, max_model_len=512, max_num_seqs=2,
               scheduling_policy="priority", shared_prefix_file=str(shared))  # fmt: skip


def test_high_priority_request_at_a_full_server_goes_first(llm):
    tok = llm.get_tokenizer()
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)

    def request(name: str, priority: int, rid: str | None = None) -> EngineCoreRequest:
        return EngineCoreRequest(rid or name, tok.encode(PROMPTS[name]), params, priority=priority)

    for name in ("low0", "low1", "low2"):
        engine.add_request(request(name, priority=5))
    # Both seats taken by low0 and low1 (prompt, then a decode); low2 queues.
    _, before, before_lp, _ = _run(engine, max_steps=2)
    assert {r.request_id for r in engine.scheduler.running} == {"low0", "low1"}
    engine.add_request(request("high", priority=0))
    first, tokens, logprobs, preemptions = _run(engine)
    for rid in before:
        tokens[rid] = before[rid] + tokens[rid]
        logprobs[rid] = before_lp[rid] + logprobs[rid]
    # high preempted low1 (the latest of the lowest priority) and got its token first.
    assert first["high"] < first["low2"]
    assert preemptions == {"low0": 0, "low1": 1, "low2": 0, "high": 0}
    assert all(len(t) == 6 for t in tokens.values())
    # The preempted request, recomputed after the preemption, says exactly what it says alone.
    engine.add_request(request("low1", priority=0, rid="low1-alone"))
    _, alone_tokens, alone_logprobs, _ = _run(engine)
    cmp = compare_greedy(
        tokens["low1"], alone_tokens["low1-alone"],
        lambda pos: min(_gap(logprobs["low1"], pos), _gap(alone_logprobs["low1-alone"], pos)), "low1",
    )  # fmt: skip
    assert cmp.equal, cmp.excused


def test_cache_salt_isolates_tenants_but_shares_the_declared_system_prompt(llm):
    tok = llm.get_tokenizer()
    block = llm.config.block_size
    params = SamplingParams(temperature=0, max_tokens=1)

    def chat_ids(user: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                                       add_generation_prompt=True)  # fmt: skip
        return tok.encode(text, add_special_tokens=False)

    def cached(ids: list[int], salt: str | None) -> int:
        prompt = {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}
        return llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens

    system_ids = tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM}],
                                                    add_generation_prompt=False), add_special_tokens=False)  # fmt: skip
    shared_len = len(system_ids) // block * block
    assert shared_len >= 2 * block

    a_chat = chat_ids("My order 88231 has not arrived and I would like a refund for the whole thing.")
    assert cached(a_chat, "tenant-a") == 0                     # cold
    assert cached(a_chat, "tenant-a") == (len(a_chat) - 1) // block * block  # all but the last token
    # Tenant B, same prompt: only the declared system prompt's blocks are shared.
    assert cached(a_chat, "tenant-b") == shared_len
    b_chat = chat_ids("How do I reset my password?")
    assert cached(b_chat, "tenant-b") == shared_len
    # A salted prompt without the shared prefix: no hit at all for another tenant.
    secret = tok.encode("Internal memo: the merger with Globex closes on Friday; do not tell anyone yet.")
    assert cached(secret, "tenant-a") == 0
    assert cached(secret, "tenant-a") > 0
    assert cached(secret, "tenant-b") == 0
    assert cached(secret, None) == 0
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks
