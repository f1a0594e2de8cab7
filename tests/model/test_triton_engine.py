"""The engine on the Triton attention backend (in Triton's interpreter on the CPU): the
tokens of the CPU backend, decode steps replayed from captured graphs (a CPU stand-in
for CUDA graphs) with the eager tokens, and a decode step free of host syncs."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagoda import LLM, SamplingParams
from pagoda.worker.cuda_graphs import RecordingCapture, capture_sizes

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _interpreted():
    from pagoda.ops import triton_attention

    if not triton_attention.interpreted() and not torch.cuda.is_available():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1 and there is no GPU")


def _prompts(sizes: tuple[int, ...] = (5, 17, 33, 40, 9)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in sizes]


def _llm(path: str, backend: str, **kw) -> LLM:
    # Small blocks and step budget: chunked prefill over several blocks.
    return LLM(path, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=64, block_size=16,
               max_num_batched_tokens=32, attention_backend=backend, **kw)


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int]):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in max_tokens]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_triton_backend_gives_the_cpu_backends_tokens(tiny_llama_dir):
    """Mixed steps (decodes beside prompt chunks), a decode crossing into a new block (the
    last prompt's) and prefix-cache hits on the second pass: the same greedy tokens and
    logprobs (test_families.py runs every family, windowed ones included, through this
    backend against transformers)."""
    path = tiny_llama_dir
    # Steps 2-4 decode 2-3 requests beside prompt chunks; the decodes end soon after the
    # prompts do (each step is slow in the interpreter), the 14-token prompt's at position 16.
    prompts, lengths = _prompts((5, 17, 33, 40, 14)), [6, 4, 5, 3, 4]
    want = _generate(_llm(path, "auto"), prompts, lengths)
    llm = _llm(path, "triton")
    assert llm.engine.runner.attn_backend.name == "triton"
    for _ in range(2):
        got = _generate(llm, prompts, lengths)
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            lp_g = [e[t].logprob for e, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)]
            lp_w = [e[t].logprob for e, t in zip(w.outputs[0].logprobs, w.outputs[0].token_ids)]
            assert lp_g == pytest.approx(lp_w, abs=1e-4)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks
    llm.engine.check_integrity()


@pytest.mark.parametrize("model", ["tiny_llama_dir", pytest.param("tiny_gemma3_dir", marks=pytest.mark.slow)])
def test_decode_graphs_replay_the_eager_tokens(model, request):
    """Decode steps of 5, 4, 3, ... requests replay the graphs of 8 and 4 (padded rows write
    no cache slot), over buffers that are never reallocated: the eager run's tokens; Gemma 3
    with a windowed KV group beside its global one (static buffers per group)."""
    path = request.getfixturevalue(model)
    # (decode-only steps of 5, 4, 3 and 2 requests: graphs 8, 4, 4, 2)
    prompts, lengths = _prompts(), [7, 5, 7, 3, 5]
    want = _generate(_llm(path, "auto"), prompts, lengths)   # (the CPU backend's tokens: the Triton backend's)
    llm = _llm(path, "triton", max_model_len=128)
    runner = llm.engine.runner
    capture = RecordingCapture()
    assert runner.capture_graphs(capture, max_batch=8, max_model_len=llm.engine.max_model_len) is None
    graphs = runner.graphs
    assert graphs.sizes == [1, 2, 4, 8] and len(capture.captured) == 4
    buffers = [graphs.input_ids, graphs.positions, graphs.output, graphs.workspace, *graphs.slots, *graphs.tables,
               *graphs.seq_lens]
    addresses = [t.data_ptr() for t in buffers]
    # Captured with every row padded: no cache slot was written.
    assert all(bool((s == -1).all()) for s in graphs.slots)
    got = _generate(llm, prompts, lengths)
    assert capture.replays > 0
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    assert [t.data_ptr() for t in buffers] == addresses
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.slow   # (CI time: graphs and overlapped steps each have their own test in the default run)
def test_graphs_and_overlapped_steps_together(tiny_llama_dir):
    """The GPU's configuration (Triton backend, decode graphs, overlapped steps): the tokens
    of the CPU backend's synchronous steps."""
    prompts, lengths = _prompts(), [9, 5, 9, 3, 7]
    want = _generate(_llm(tiny_llama_dir, "auto"), prompts, lengths)
    llm = _llm(tiny_llama_dir, "triton", max_model_len=128, async_scheduling=True)
    capture = RecordingCapture()
    assert llm.engine.runner.capture_graphs(capture, max_batch=8, max_model_len=llm.engine.max_model_len) is None
    got = _generate(llm, prompts, lengths)
    assert capture.replays > 0 and llm.engine.overlap
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


def test_capture_sizes_are_vllms_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]


# Ops that make the host wait for the device (or whose output size depends on device data).
_SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
            "aten.repeat_interleave.Tensor", "aten.unique2.default", "aten._unique2.default"}


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.ops.append(name)
        if name in _SYNCING:
            self.syncs.append(name)
        if name.startswith("aten.index.Tensor") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            self.syncs.append(name + " (boolean mask)")
        if name.startswith(("aten.copy_", "aten._to_copy")):
            src = args[1] if name.startswith("aten.copy_") else args[0]
            dst_device = args[0].device if name.startswith("aten.copy_") else kwargs.get("device", src.device)
            if src.device.type != "cpu" and torch.device(dst_device).type == "cpu":
                self.syncs.append(name + " (device to host)")
        return func(*args, **(kwargs or {}))


def test_a_decode_step_forward_head_and_sampler_never_sync(tiny_llama_dir, monkeypatch):
    """A decode step's metadata, forward, LM head and sampler under a dispatch mode that fails
    on any op making the host wait; and a bound on the ops a layer issues (a Triton launch
    counts as one: the interpreter's own tensor work for it is not recorded)."""
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime import interpreter

    from pagoda.sample.sampler import SamplingMetadata

    launch = interpreter.GridExecutor.__call__

    def recorded_launch(self, *args, **kwargs):
        mode = torch.utils._python_dispatch._get_current_dispatch_mode()
        if isinstance(mode, _OpRecorder):
            mode.ops.append(f"triton {self.fn.__name__}")
        with _disable_current_modes():
            return launch(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", recorded_launch)

    llm = _llm(tiny_llama_dir, "triton")
    runner = llm.engine.runner
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7, max_tokens=4, ignore_eos=True)]
    steps = []
    real_start = runner.start_batch

    def start_batch(so, grammar_masks=None):
        decode_only = so.num_scheduled_tokens and all(n == 1 for n in so.num_scheduled_tokens.values())
        if not decode_only:
            return real_start(so, grammar_masks)
        with _OpRecorder() as rec:
            b = real_start(so, grammar_masks)
            forward_ops = len(rec.ops)
            logits = runner.model.compute_logits(b.hidden)
            # (the GPU's counter-based draws for the random row: no per-row loop there)
            md = SamplingMetadata.from_rows(b.sampling_rows, logits.shape[-1], runner.device, counter_rng=True)
            assert md.random_seeds is not None
            runner.sampler(logits, md)
        steps.append((rec, forward_ops))
        return b

    runner.start_batch = start_batch
    llm.generate([{"prompt_token_ids": p} for p in _prompts()[:2]], params, use_tqdm=False)
    assert steps, "no decode-only step ran"
    layers = len(runner.model.model.layers)
    for rec, _ in steps:
        assert rec.syncs == []
    # (the first decode step allocates the second set of persistent buffers)
    for rec, forward_ops in steps[1:]:
        # One layer's ops: from one layer's KV store to the next's (norms, projections,
        # RoPE, store, decode, MLP), a bound that catches a per-layer regression.
        stores = [i for i, op in enumerate(rec.ops[:forward_ops]) if op == "triton _store_kv_kernel"]
        assert len(stores) == layers
        assert stores[1] - stores[0] <= 30, rec.ops[stores[0]:stores[1]]
        assert forward_ops - (stores[1] - stores[0]) * layers <= 60, rec.ops[:forward_ops]


def test_moe_models_are_not_captured(tiny_mixtral_dir):
    """MoE layers route on the host (a sync): their decode steps stay eager, and say why."""
    llm = _llm(tiny_mixtral_dir, "triton")
    why = llm.engine.runner.capture_graphs(RecordingCapture(), max_batch=4, max_model_len=llm.engine.max_model_len)
    assert why is not None and "MoE" in why and llm.engine.runner.graphs is None
