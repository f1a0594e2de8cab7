"""Hybrid models (#48): layers that keep a fixed-size state per request (LFM2's gated short
convolutions, Mamba-2, Gated DeltaNet) in a slot of the runner's state pool beside the
attention layers' paged KV cache. Every family of tests/model/hybrid_families.py against
transformers on a tiny random checkpoint: prompt logprobs within 1e-3 and greedy tokens equal
through chunked prefill, a second pass, preemption by recompute and by swap, and aborts; every
state slot and KV block back; what a hybrid model cannot combine with yet is refused."""

from __future__ import annotations

import weakref

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.model.models import model_class
from tests.model import helpers
from tests.model.helpers import compare_greedy, top2_gap
from tests.model.hf_to_gguf import write_gguf
from tests.model.hybrid_families import all_families

FAMILIES = all_families()

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hybrid(request, tmp_path_factory):
    family = FAMILIES[request.param]
    config = family.config()
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for m in hf.modules():
            if getattr(m, "expert_bias", None) is not None:   # zeros at init: make it choose
                m.expert_bias.normal_(0, 0.3)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path / "hf", safe_serialization=True)
    # llama.cpp's names and keys, the same tensors
    gguf = None
    if family.gguf_writer is not None:
        gguf = family.gguf_writer(hf, str(path / "model.gguf"), str(path / "hf"))
    elif family.gguf_arch:
        gguf = write_gguf(hf, str(path / "model.gguf"), family.gguf_arch, str(path / "hf"))
    return hf, str(path / "hf"), gguf, family.block, family


# transformers' greedy runs, per model and prompt: the tests of a family ask for the same
# prompts' continuations again (both passes and both sources of the first test, both
# preemption modes, the speculative test's prompts among the preemption test's, the five
# turns twice), and a run is deterministic, its first n tokens and logits those of a run of n.
_HF_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hf_greedy(hf, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """helpers.hf_greedy, each prompt run once per model (again only for more tokens)."""
    runs = _HF_RUNS.setdefault(hf, {})
    key = tuple(prompt_ids)
    if key not in runs or len(runs[key][0]) < max_new_tokens:
        runs[key] = helpers.hf_greedy(hf, prompt_ids, max_new_tokens)
    tokens, logits = runs[key]
    return tokens[:max_new_tokens], logits[:max_new_tokens]


def assert_greedy_matches_hf(hf, prompts: list[list[int]], outputs, max_tokens: int, label: str) -> None:
    """helpers.assert_greedy_matches_hf on the remembered runs."""
    helpers.assert_greedy_matches_hf(hf, prompts, outputs, max_tokens, label, greedy=hf_greedy)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 5, 17, 33, 70)]


def _free(llm: LLM) -> tuple[int, int]:
    return llm.engine.kv_manager.num_free_blocks, llm.engine.scheduler.states.num_free


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_hybrid_matches_transformers_through_chunks_and_a_second_pass(hybrid, source):
    hf, path, gguf, block, family = hybrid
    tol = family.logprob_tol
    if source == "gguf":
        from pagoda.ops import cpu_kernels

        if gguf is None:
            pytest.skip("no GGUF file of this family yet")
        if cpu_kernels.kernels() is None:
            pytest.skip("GGUF files are served from their blocks by pagoda's CPU kernels")
        path = gguf
    prompts = _prompts()
    # Small blocks and a small step budget: prompts in chunks of up to 32 tokens.
    llm = LLM(path, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=64, block_size=block,
              max_num_batched_tokens=32, max_num_seqs=8)
    assert llm.engine.kv_manager.enable_caching
    assert type(llm.engine.runner.model) is model_class(hf.config.architectures[0])
    free = _free(llm)
    assert free == (64, 8)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    kv = llm.engine.kv_manager
    for run in range(2):   # a second pass: prefix hits, the states restored from the blocks' ends
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_greedy_matches_hf(hf, prompts, outputs, 16, "hybrid")
        assert (kv.prefix_hits > 0) == (run == 1)
        llm.engine.check_integrity()
        assert _free(llm) == free
    # Prompt logprobs read every position: no prefix hit, the states computed chunk by chunk.
    logprobs = SamplingParams(max_tokens=1, prompt_logprobs=1)
    for ids, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], logprobs, use_tqdm=False)):
        with torch.inference_mode():
            want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        got = [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], ids[1:])]
        ref = [want[i, tok].item() for i, tok in enumerate(ids[1:])]
        assert max((abs(a - b) for a, b in zip(got, ref)), default=0.0) < tol


def test_hybrid_five_turns_compute_only_their_new_tokens(hybrid):
    """A conversation of five turns: each later turn hits the prefix cache up to the last
    whole block of the turn before, restores the states saved there, and computes at most
    its new tokens plus one block; its tokens are transformers' greedy ones. The state
    slots, saved states and restores are in the metrics (/metrics' gauges and counters)."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagoda.config import EngineConfig
    from pagoda.metrics.prometheus import make_registry, render

    hf, path, _, block, _ = hybrid
    llm = _five_turns(hf, path, block)
    stats = llm.engine.scheduler.make_stats()

    class Source:
        metrics = None
        config = EngineConfig()
        replicas = ()
        lora_token_counts: dict[str, list[int]] = {}

        def latest_stats(self):
            return stats

    families = {f.name: f.samples[0].value for f in text_string_to_metric_families(render(make_registry(Source(), "x"))
                                                                                 .decode()) if f.samples}
    slots = llm.engine.scheduler.states.num_slots
    assert families["pagoda:state_slots"] == slots > 0 and families["pagoda:state_slots_used"] == 0
    assert families["pagoda:saved_states"] == len(llm.engine.scheduler.checkpoints) > 0
    # (each later turn whose history passed a saved state's block end restored one)
    assert families["pagoda:state_restores"] == llm.engine.scheduler.checkpoints.num_restores >= 1


def _five_turns(hf, path: str, block: int) -> LLM:
    llm = LLM(path, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=64, block_size=block,
              max_num_batched_tokens=32)
    gen = torch.Generator().manual_seed(2)
    history: list[int] = []
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    for turn in range(5):
        new = torch.randint(3, 512, (11 + 3 * turn,), generator=gen).tolist()
        prompt = history + new
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        computed = len(prompt) - out.num_cached_tokens
        if turn:
            assert computed <= len(new) + block, (turn, computed)   # its new tokens and at most one block
            assert out.num_cached_tokens > 0 or len(history) <= block
        assert_greedy_matches_hf(hf, [prompt], [out], 8, f"hybrid turn {turn}")
        history = prompt + list(out.outputs[0].token_ids)
    llm.engine.check_integrity()
    return llm


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_hybrid_under_preemption_and_aborts(hybrid, mode):
    """Room for about one request at a time: the others are preempted, recomputed from their
    first token or swapped out (KV blocks and state to host memory, back into a slot that
    may be another one) and resumed where they were."""
    hf, path, _, block, _ = hybrid
    prompts = _prompts()[1:]
    blocks, max_tokens = (8, 24) if block == 16 else (3, 40)   # requests cross a block's end, the pool runs out
    swap = {"preemption_mode": "swap", "swap_space": 64 << 20} if mode == "swap" else {}
    llm = LLM(path, skip_tokenizer_init=True, show_progress=False, block_size=block, num_kv_blocks=blocks,
              max_num_seqs=4, **swap)
    free = _free(llm)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0
    if mode == "swap":
        assert scheduler.num_swap_preemptions > 0 and scheduler.host.num_swapped_in > 0
        assert scheduler.host_states.num_free == scheduler.host_states.num_slots
    for ids, out in zip(prompts, outputs):
        want, want_logits = hf_greedy(hf, ids, max_tokens)
        result = compare_greedy(out.outputs[0].token_ids, want, lambda pos: top2_gap(want_logits[pos]), "hybrid")
        assert result.equal, result.excused
    assert _free(llm) == free
    # Aborted mid-way: every slot and block comes back.
    engine = llm.engine
    from pagoda.engine.messages import EngineCoreRequest

    for i, ids in enumerate(prompts):
        engine.add_request(EngineCoreRequest(f"abort-{i}", ids, SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.step()
    engine.step()
    engine.abort_requests([f"abort-{i}" for i in range(len(prompts))])
    engine.step()
    engine.check_integrity()
    assert _free(llm) == free


class _OracleProposer:
    """Drafts from transformers' greedy continuation of each prompt, every other proposal
    with one token wrong (at a place that cycles), so that steps accept all, some and none
    of their drafts."""

    needs_sync = False

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations
        self.calls = 0

    def propose(self, requests):
        drafts = []
        for r in requests:
            prompt = next(p for p in self.continuations if tuple(r.token_ids[:len(p)]) == p)
            done = len(r.token_ids) - len(prompt)
            draft = list(self.continuations[prompt][done:done + r.num_drafts])
            self.calls += 1
            if self.calls % 2 and draft:
                draft[(self.calls // 2) % len(draft)] ^= 1   # a wrong token
            drafts.append(draft)
        return drafts

    def sync(self, input_ids, positions, metas) -> None:
        pass


def test_hybrid_speculative_decoding_keeps_the_states_of_accepted_tokens(hybrid):
    """Drafts verified in one step of k + 1 tokens: the state layers save each sequence's
    state after every token but the last, and where drafts are rejected the state after the
    accepted ones replaces the slot's. With drafts from transformers' own continuation,
    every other proposal wrong in one place (so steps accept all, some and none), greedy
    tokens equal transformers' (chunked prompts; every slot and block back). The n-gram
    proposer's engine, its proposer replaced."""
    hf, path, _, block, _ = hybrid
    prompts = _prompts()[2:]
    max_tokens = 20
    want = {tuple(p): hf_greedy(hf, p, max_tokens) for p in prompts}
    llm = LLM(path, skip_tokenizer_init=True, show_progress=False, block_size=block, num_kv_blocks=32,
              max_num_batched_tokens=32, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    llm.engine.runner.proposer = _OracleProposer({p: w[0] for p, w in want.items()})
    free = _free(llm)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    scheduler = llm.engine.scheduler
    drafted, accepted = scheduler.spec_num_draft_tokens, scheduler.spec_num_accepted_tokens
    assert 0 < accepted < drafted, (accepted, drafted)
    for ids, out in zip(prompts, outputs):
        tokens, logits = want[tuple(ids)]
        result = compare_greedy(out.outputs[0].token_ids, tokens, lambda pos: top2_gap(logits[pos]), "hybrid spec")
        assert result.equal, result.excused
    llm.engine.check_integrity()
    assert _free(llm) == free


# Families whose state layers split over tensor-parallel ranks (Gated DeltaNet: by key
# head), and (source, words) of a refusal for others.
_TP = {"qwen35": ("hf",), "qwen35moe": ("hf",), "qwen3next": ("hf", "gguf"), "qwen3nextmixed": ("hf",),
       "lfm2": ("hf", "gguf"), "lfm2moe": ("hf",)}
_TP_REFUSED = {"qwen35": ("gguf", "tiles its value heads"),
               "granite4h": ("hf", "cannot be served with tensor parallelism")}
# Cases that repeat another's split (run under make test-all: slow).
_TP_SLOW = {("qwen3nextmixed", "hf"), ("lfm2moe", "hf"), ("lfm2", "gguf"), ("qwen35moe", "hf"), ("qwen3next", "gguf")}


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_hybrid_under_tensor_parallelism(hybrid, source, request):
    """Two ranks (gloo): every Gated DeltaNet layer split by key head, each rank with its
    key heads' value heads (its rows of the projections, its convolution channels, decays
    and gates, its share of every state; out_proj row-parallel), LFM2's convolutions by
    channel, attention, MLP and shared experts as for any family, through chunked prompts:
    greedy tokens equal one process's. A file whose value heads are tiled (llama.cpp's
    qwen35) and families whose state layers do not split yet (Mamba-2) are refused by name."""
    from pagoda.model.loader import parameter_bytes
    from tests.model.test_tensor_parallel import _PROMPTS, _assert_same_greedy

    hf, path, gguf, block, family = hybrid
    name = next(n for n, f in FAMILIES.items() if f is family)
    path = gguf if source == "gguf" else path
    refused = _TP_REFUSED.get(name)
    if refused is not None and refused[0] == source:
        with pytest.raises(Exception, match=refused[1]):
            LLM(path, tensor_parallel_size=2, num_kv_blocks=32, skip_tokenizer_init=True, show_progress=False)
        return
    if source not in _TP.get(name, ()):
        pytest.skip(f"{name} from {source}: not one of the tensor-parallel cases")
    if (name, source) in _TP_SLOW and "not slow" in (request.config.option.markexpr or ""):
        pytest.skip(f"{name} from {source} under tensor parallelism runs under make test-all (slow)")
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    outs, held = {}, {}
    for tp in (1, 2):
        llm = LLM(path, tensor_parallel_size=tp, num_kv_blocks=32, block_size=block, max_num_batched_tokens=24,
                  skip_tokenizer_init=True, show_progress=False)
        try:
            result = llm.generate([{"prompt_token_ids": p} for p in _PROMPTS], params, use_tqdm=False)
            outs[tp] = [o.outputs[0] for o in result]
            held[tp] = (parameter_bytes(llm.engine.loaded.model), llm.engine.runner._state_caches[0].slots.shape[1])
            if tp == 2:
                llm.engine.check_integrity()
        finally:
            llm.shutdown()
    _assert_same_greedy(outs[1], outs[2], f"{name} tensor-parallel")
    (full, state), (half, state2) = held[1], held[2]
    assert half < 0.8 * full and state2 * 2 == state   # rank 0's share of the weights and of a state


def test_a_hybrid_draft_model_is_refused(hybrid):
    _, path, _, _, _ = hybrid
    with pytest.raises(ValueError, match="a hybrid draft model"):
        LLM(path, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=16,
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": path})


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"speculative_config": {"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 1}},
     "--speculative-config method layer_skip"),
])
def test_hybrid_refuses_what_it_cannot_combine_with_yet(hybrid, kwargs, words):
    _, path, _, block, _ = hybrid
    with pytest.raises(ValueError, match=f"hybrid model .* cannot be combined with {words}"):
        LLM(path, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=16, **kwargs)


def test_swap_space_too_small_for_a_state_is_refused(hybrid):
    from pagoda.worker.model_runner import state_bytes

    _, path, _, block, _ = hybrid
    llm = LLM(path, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=16)
    state = state_bytes(llm.engine.runner.model)
    with pytest.raises(ValueError, match="holds no request's state"):
        LLM(path, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=16, preemption_mode="swap",
            swap_space=state)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_state_pool_under_a_random_workload(hybrid, mode):
    """Admissions, aborts, preemptions (a small KV pool; recomputed, or swapped out while
    the host pool has room), prefix hits and finishes in random order, with check_integrity() after every
    step: every slot is held by one running request or free, every host slot by one waiting
    request or free."""
    import random

    from pagoda.engine.messages import EngineCoreRequest

    _, path, _, block, _ = hybrid
    swap = {"preemption_mode": "swap", "swap_space": 64 << 20} if mode == "swap" else {}
    llm = LLM(path, skip_tokenizer_init=True, show_progress=False, block_size=block,
              num_kv_blocks=max(3, 160 // block), max_num_seqs=3, max_num_batched_tokens=32, **swap)
    engine, rng = llm.engine, random.Random(0)
    free = _free(llm)
    base = [rng.randrange(3, 512) for _ in range(60)]
    live: list[str] = []
    for step in range(120):
        if rng.random() < 0.4:
            rid = f"r{step}"
            # Prefixes of one text, often: prefix hits restore the states of blocks' ends.
            ids = base[:rng.randrange(1, 60)] if rng.random() < 0.6 else [rng.randrange(3, 512) for _ in range(40)]
            engine.add_request(EngineCoreRequest(rid, ids, SamplingParams(max_tokens=rng.randrange(1, 30),
                                                                          ignore_eos=True)))
            live.append(rid)
        if live and rng.random() < 0.15:
            engine.abort_requests([live.pop(rng.randrange(len(live)))])
        engine.step()
        engine.check_integrity()
        states = engine.scheduler.states
        assert states.num_free + len(engine.scheduler.running) == states.num_slots
    while engine.scheduler.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert engine.scheduler.num_swap_preemptions == engine.scheduler.num_preemptions
    else:
        # (With a state larger than a block's KV, this workload's hits are recomputed requests
        # finding their own saved states; swapped ones come back without a lookup.)
        assert engine.kv_manager.prefix_hits > 0
    assert _free(llm) == free


@pytest.mark.parametrize("mode", ["q4", "bf16", "gguf", "int8"])
def test_hybrid_in_the_quantized_modes(hybrid, mode, monkeypatch):
    """The quantized linear layers replace a hybrid family's projections too (its state
    layers' in/out projections included); bf16, int8 and the gguf mode (a GGUF file's
    blocks, int8 activations) stay near transformers' greedy choices, q4 runs. (int8
    calibrates on the model's tokens of a text: these tiny checkpoints have no tokenizer, so
    the calibration prompt here is one of the test prompts; the state layers run in it.)"""
    from pagoda.model.layers import quantization
    from pagoda.ops import cpu_kernels

    hf, path, gguf, block, family = hybrid
    if cpu_kernels.kernels() is None:
        pytest.skip("the quantized modes need pagoda's CPU kernels")
    if mode == "int8":
        monkeypatch.setattr(quantization, "calibration_token_ids", lambda path, metadata: _prompts()[4])
    if mode == "gguf":
        if gguf is None:
            pytest.skip("no GGUF file of this family yet")
        path = gguf
    llm = LLM(path, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=16, quantization=mode,
              max_num_batched_tokens=32)
    model = llm.engine.runner.model
    converted = [m for m in model.modules() if type(m).__name__ != "Linear" and "Linear" in type(m).__name__]
    assert len(converted) >= 3 * model.config.num_hidden_layers
    ids = _prompts()[3]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0].float()
    top = [max(entry.items(), key=lambda kv: kv[1].logprob)[0] for entry in out.prompt_logprobs[1:]]
    agree = sum(int(t == w) for t, w in zip(top, want.argmax(-1)[:-1].tolist())) / len(top)
    assert all(e[t].logprob > -1e9 for e, t in zip(out.prompt_logprobs[1:], ids[1:]))
    # int8 rounds each token's activations to 8 bits over the whole row (the gguf mode per
    # 32 values): ~4x bf16's rounding, and these tiny random hybrids amplify rounding (bf16's
    # largest prompt-logprob error on Qwen3.5 here: ~0.7; a dense Llama's in int8: 0.003).
    floor = family.quantized_agree - (0.1 if mode == "int8" else 0.0)
    if mode != "q4":
        assert agree >= floor, agree
    assert _free(llm) == (16, llm.engine.scheduler.states.num_slots)


def test_a_state_larger_than_a_blocks_kv_is_saved_sparsely(hybrid):
    """A state that outweighs a 16-token block's KV (Mamba-2, Gated DeltaNet) is not kept
    beside every block: the prefix cache saves one every ceil(state / block KV) blocks of a
    long prompt and at each chunk's last block end, in a pool of its own. Prefix hits end
    where a state is saved: a second pass and a five-turn conversation still compute only
    what is new (and at most one block more), greedy-equal to transformers."""
    from pagoda.worker.model_runner import state_bytes

    hf, path, _, block, _ = hybrid
    llm = _five_turns(hf, path, 16)
    engine = llm.engine
    per_block = 16 * sum(2 * s.num_kv_heads * s.head_dim * 4 for s in engine.runner.model.kv_specs() if s)
    state = state_bytes(engine.runner.model)
    checkpoints = engine.scheduler.checkpoints
    assert engine.kv_manager.enable_caching and checkpoints is not None
    if state <= per_block:
        assert checkpoints.interval == 1 and checkpoints.capacity == engine.kv_manager.num_blocks
        return
    assert checkpoints.interval == -(-state // per_block) > 1
    assert engine.runner._state_caches[0].blocks.shape[0] == checkpoints.capacity
    assert 0 < len(checkpoints) <= checkpoints.capacity and checkpoints.num_restores >= 4
    prompts = _prompts()[2:]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    hits = engine.kv_manager.prefix_hits
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_greedy_matches_hf(hf, prompts, outputs, 8, "hybrid, sparse saved states")
    assert engine.kv_manager.prefix_hits > hits
    engine.check_integrity()


def test_a_random_qwen35_shaped_file_serves_in_every_gguf_mode(tmp_path):
    """pagoda.bench.gguf_files' Qwen3.5 shape (the hybrid speed benchmark's file, scaled
    down): Gated DeltaNet and gated attention tensors under llama.cpp's names, K-quant
    blocks, served from its blocks and in the exact mode, every slot and block back."""
    import dataclasses

    from pagoda.bench.gguf_files import SHAPES, write_model
    from pagoda.ops import cpu_kernels

    if cpu_kernels.kernels() is None:
        pytest.skip("K-quant blocks are served by pagoda's CPU kernels")
    shape = dataclasses.replace(SHAPES["qwen3.5-2b"], hidden=256, layers=8, ffn=512, heads=4, head_dim=64,
                                linear=(2, 4, 32, 32, 4))
    path = write_model(str(tmp_path / "q35.gguf"), shape, "Q4_K_M", show_progress=False)
    for mode in ("gguf", "int8", "none"):   # int8: calibrated on the file's tokens of a text
        llm = LLM(path, show_progress=False, num_kv_blocks=32, quantization=mode)
        assert llm.engine.loaded.arch.linear_attn["v_order"] == "tiled"
        assert sum(llm.engine.loaded.arch.linear_attn_layers) == 6
        free = _free(llm)
        out = llm.generate(["Hello there"] * 3, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [12] * 3
        llm.engine.check_integrity()
        assert _free(llm) == free


