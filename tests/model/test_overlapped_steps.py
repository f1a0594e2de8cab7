"""Overlapped steps (--async-scheduling): step N+1 scheduled and launched while N runs, its
input tokens taken from N's sampled ids on the device. On the CPU the forward itself runs
synchronously, but every other part is the GPU's: the same tokens, stops and finish
reasons as steps one after another, through preemption, aborts and requests that need
their output history (which turn the overlap off while they run)."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine.engine_core import EngineCore
from pagoda.engine.messages import EngineCoreRequest


def _prompts(n: int = 6) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (length,), generator=gen).tolist() for length in (5, 17, 33, 40, 9, 21)[:n]]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[0]),   # may stop early on its token
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=15, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    ]


def _run(path: str, overlap: bool, params: list[SamplingParams], **kw):
    llm = LLM(path, skip_tokenizer_init=True, show_progress=False, block_size=16, max_num_batched_tokens=32,
              async_scheduling=overlap, **kw)
    steps = []
    step = llm.engine.step

    def counted():
        out = step()
        steps.append(len(llm.engine._in_flight))
        return out

    llm.engine.step = counted
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(len(params))], params, use_tqdm=False)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], steps, llm


def test_overlapped_steps_give_the_synchronous_tokens(tiny_llama_dir, monkeypatch):
    from pagoda.worker.model_runner import ModelRunner

    filled = []
    fill = ModelRunner._fill_from_previous

    def counted(self, b, rid, at, missing):
        filled.append(rid)
        return fill(self, b, rid, at, missing)

    monkeypatch.setattr(ModelRunner, "_fill_from_previous", counted)
    params = _params()
    want, _, _ = _run(tiny_llama_dir, False, params, num_kv_blocks=64)
    assert not filled
    got, in_flight, llm = _run(tiny_llama_dir, True, params, num_kv_blocks=64)
    assert llm.engine.overlap
    assert got == want
    assert sum(in_flight) > 10   # most calls left a step in flight
    assert len(filled) > 20      # input tokens taken from the step before's ids on the device


def test_overlapped_steps_under_preemption(tiny_llama_dir):
    """A pool too small for the batch: requests with a token in flight are preempted and
    recomputed, and still give the synchronous engine's tokens."""
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True) for _ in range(4)]
    want, _, _ = _run(tiny_llama_dir, False, params, num_kv_blocks=6)
    got, _, llm = _run(tiny_llama_dir, True, params, num_kv_blocks=6)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == want


def test_a_request_with_penalties_turns_the_overlap_off_while_it_runs(tiny_llama_dir):
    params = _params()
    params[3] = SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3, min_tokens=2)
    want, _, _ = _run(tiny_llama_dir, False, params, num_kv_blocks=64)
    got, in_flight, _ = _run(tiny_llama_dir, True, params, num_kv_blocks=64)
    assert got == want
    assert 0 in in_flight and any(in_flight)   # both kinds of step ran


def test_aborts_between_overlapped_steps_give_every_block_back(tiny_llama_dir):
    core = EngineCore(EngineConfig(model=tiny_llama_dir, skip_tokenizer_init=True, show_progress=False,
                                   block_size=16, num_kv_blocks=64, async_scheduling=True))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(_prompts(4)):
        core.add_request(EngineCoreRequest(f"r{i}", p, params))
    tokens: dict[str, list[int]] = {}
    n = 0
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        n += 1
        if n == 6:   # (a step is in flight: r1's and r2's next positions are computed already)
            assert core._in_flight
            core.abort_requests(["r1", "r2"])
    assert len(tokens["r0"]) == 40 and len(tokens["r3"]) == 40
    assert len(tokens.get("r1", [])) < 40
    assert core.kv_manager.num_free_blocks == core.num_blocks
    core.check_integrity()


def test_async_scheduling_refuses_what_it_cannot_overlap(tiny_llama_dir):
    with pytest.raises(ValueError, match="speculative decoding"):
        EngineCore(EngineConfig(model=tiny_llama_dir, skip_tokenizer_init=True, show_progress=False,
                                num_kv_blocks=64, async_scheduling=True,
                                speculative_config={"method": "ngram", "num_speculative_tokens": 2}))
