"""Swap preemption on a tiny random model: the KV goes to the host pool and back unchanged."""

from __future__ import annotations

import torch

from pagoda.config import EngineConfig
from pagoda.engine.engine_core import EngineCore
from pagoda.engine.messages import EngineCoreRequest
from pagoda.sampling_params import SamplingParams
from tests.model.helpers import compare_greedy


def poison(core: EngineCore) -> EngineCore:
    """Fill the KV pools with NaN, as uninitialized memory may be: only slots that were
    written may ever influence an output (padded decode positions read unwritten ones)."""
    for kv in core.runner.kv_buffers + core.runner.host_kv_buffers:
        if isinstance(kv, torch.Tensor):
            kv.fill_(float("nan"))
        else:
            kv.scales.fill_(float("nan"))
    return core


def _run(core: EngineCore, prompts: list[list[int]], max_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{i}", p, params))
    tokens: dict[str, list[int]] = {}
    gaps: dict[str, list[float]] = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            for lp in out.new_logprobs or []:
                gaps.setdefault(out.request_id, []).append(lp.top_logprobs[0] - lp.top_logprobs[1])
        core.check_integrity()
    core.scheduler.schedule()  # the step after the last swap-in releases its host blocks
    core.check_integrity()
    assert core.kv_manager.num_free_blocks == core.num_blocks
    assert core.scheduler.host.num_free_blocks == core.scheduler.host.num_blocks
    return tokens, gaps


def test_forced_swap_preemption_keeps_greedy_outputs(tiny_llama_dir):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (20,), generator=gen).tolist() for _ in range(4)]
    base = dict(model=tiny_llama_dir, show_progress=False, block_size=16, max_model_len=64, max_num_batched_tokens=64,
                enable_prefix_caching=False)  # fmt: skip
    roomy = poison(EngineCore(EngineConfig(**base, num_kv_blocks=64), collect_stats=False))
    want, want_gaps = _run(roomy, prompts, 24)
    assert roomy.scheduler.num_preemptions == 0
    # 7 blocks of 16 for four requests that grow to 44 tokens (3 blocks each): preemptions.
    tight = poison(EngineCore(EngineConfig(**base, num_kv_blocks=7, preemption_mode="swap", swap_space=1 << 20),
                              loaded=roomy.loaded, collect_stats=False))  # fmt: skip
    got, got_gaps = _run(tight, prompts, 24)
    stats = tight.scheduler.make_stats()
    assert stats.num_preemptions > 0 and stats.num_swap_preemptions == stats.num_preemptions
    assert stats.num_swapped_out_blocks == stats.num_swapped_in_blocks > 0
    for rid in want:
        cmp = compare_greedy(got[rid], want[rid], lambda pos: min(got_gaps[rid][pos], want_gaps[rid][pos]), rid)
        assert cmp.equal, cmp.excused
