"""The state layers' C++ kernels (pagoda/csrc/recurrent.cpp) against their torch paths
(pagoda/model/layers/gated_deltanet.py, mamba2.py) on one step of decodes and prompt
chunks: the outputs, every slot's state and every saved state agree (Gated DeltaNet with
grouped and tiled value heads; Mamba-2 with and without a convolution bias), a prefix hit
restoring a state another sequence of the step saves; the step's attention backend choosing them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagoda.attention.state import StateCache, StepStates
from pagoda.model.arch import ModelArchConfig
from pagoda.model.layers.gated_deltanet import GatedDeltaNet
from pagoda.model.layers.mamba2 import Mamba2Mixer
from pagoda.ops import cpu_kernels


@pytest.mark.parametrize("order", ["grouped", "tiled"])
def test_the_kernel_agrees_with_the_torch_path(order):
    ops = cpu_kernels.kernels()
    if ops is None:
        pytest.skip("pagoda's CPU kernels are not built here")
    config = ModelArchConfig(
        architecture="Qwen3_5ForCausalLM", vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=256, tie_word_embeddings=True, attention_bias=False,
        linear_attn_layers=(True,), linear_attn=dict(k_heads=2, v_heads=4, k_dim=8, v_dim=12, conv_kernel=4,
                                                     v_order=order))
    torch.manual_seed(0)
    layer = GatedDeltaNet(config).float()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        layer.A.copy_(-layer.A.abs())
    size = GatedDeltaNet.state_size(config)
    # Two decodes (slots 3, 0), a fresh prompt chunk of 9 (slot 1) saving states after 4
    # and 8 tokens, and a prefix hit (slot 2) restoring the state the chunk saves after 8.
    spans = [(0, 1, 5), (1, 1, 7), (2, 9, 0), (11, 5, 8)]
    meta = SimpleNamespace(num_decodes=2, prefills=[SimpleNamespace(token_start=a, query_len=n, context_len=c)
                                                    for a, n, c in spans[2:]],
                           states=StepStates([3, 0, 1, 2], [-1, -1, -1, 1], [[(1, 2)], [], [(4, 0), (8, 1)], []]))
    x = torch.randn(16, 48)
    start = torch.randn(4, size) * 0.5
    start[1] = 0   # the fresh chunk's slot, zeroed at admission
    results = []
    for path in ("kernel", "torch"):
        cache = StateCache(start.clone(), torch.zeros(3, size))
        if path == "torch":
            with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
                mp.setattr("pagoda.model.layers.gated_deltanet.state_kernels", lambda states, meta=None: None)
                y = layer(x, cache, meta)
        else:
            with torch.no_grad():
                y = layer(x, cache, meta)
        results.append((y, cache.slots, cache.blocks))
    (y, slots, saved), (y_ref, slots_ref, saved_ref) = results
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(slots, slots_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(saved, saved_ref, rtol=1e-4, atol=1e-5)
    assert saved.abs().sum(-1).min() > 0   # every saved state written


def _step():
    """Two decodes (slots 3, 0), a fresh prompt chunk of 9 (slot 1) saving states after 4
    and 8 tokens, and a prefix hit (slot 2) restoring the state the chunk saves after 8."""
    spans = [(0, 1, 5), (1, 1, 7), (2, 9, 0), (11, 5, 8)]
    return SimpleNamespace(num_decodes=2, prefills=[SimpleNamespace(token_start=a, query_len=n, context_len=c)
                                                    for a, n, c in spans[2:]],
                           states=StepStates([3, 0, 1, 2], [-1, -1, -1, 1], [[(1, 2)], [], [(4, 0), (8, 1)], []]))


@pytest.mark.parametrize("conv_bias", [False, True])
def test_the_mamba2_kernel_agrees_with_the_torch_path(conv_bias):
    if cpu_kernels.kernels() is None:
        pytest.skip("pagoda's CPU kernels are not built here")
    config = ModelArchConfig(
        architecture="GraniteMoeHybridForCausalLM", vocab_size=64, hidden_size=48, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=1e4, max_position_embeddings=256, tie_word_embeddings=True, attention_bias=False,
        mamba_layers=(True,), mamba=dict(heads=4, head_dim=8, groups=2, d_state=6, d_conv=4, intermediate=32,
                                         conv_bias=conv_bias, proj_bias=False, dt_min=0.0, dt_max=float("inf")))
    torch.manual_seed(0)
    layer = Mamba2Mixer(config).float()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        layer.A.copy_(-layer.A.abs())
    size = Mamba2Mixer.state_size(config)
    x = torch.randn(16, 48)
    start = torch.randn(4, size) * 0.5
    start[1] = 0
    results = []
    for path in ("kernel", "torch"):
        cache = StateCache(start.clone(), torch.zeros(3, size))
        with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
            if path == "torch":
                mp.setattr("pagoda.model.layers.mamba2.state_kernels", lambda states, meta=None: None)
            y = layer(x, cache, _step())
        results.append((y, cache.slots, cache.blocks))
    (y, slots, saved), (y_ref, slots_ref, saved_ref) = results
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(slots, slots_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(saved, saved_ref, rtol=1e-4, atol=1e-5)
    assert saved.abs().sum(-1).min() > 0


def test_the_step_backend_chooses_the_state_kernels(tmp_path, monkeypatch):
    """The state layers take their kernels from the step's attention backend: the CPU
    backend's C++ kernels for float32 states, the torch reference backend none (the layers'
    torch path). A Qwen3.5 checkpoint served with either gives the same greedy tokens."""
    from pagoda import LLM, SamplingParams
    from pagoda.attention.cpu import CpuBackend
    from pagoda.attention.torch_ref import TorchBackend
    from pagoda.model.layers import gated_deltanet, hybrid

    transformers = pytest.importorskip("transformers")
    from tests.model.hybrid_qwen3_5 import FAMILIES

    states = torch.zeros(2, 8)
    assert TorchBackend().state_kernels(states) is None
    assert CpuBackend().state_kernels(states.double()) is None
    assert CpuBackend().state_kernels(states) is cpu_kernels.kernels()
    if cpu_kernels.kernels() is None:
        pytest.skip("pagoda's CPU kernels are not built here")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(FAMILIES["qwen35"].config()).save_pretrained(tmp_path)
    calls = {"torch": 0, "cpu": 0}

    def counting(states, meta=None):
        ops = hybrid.state_kernels(states, meta)
        calls["torch" if ops is None else "cpu"] += 1
        return ops

    monkeypatch.setattr(gated_deltanet, "state_kernels", counting)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend, other in (("cpu", "torch"), ("torch", "cpu")):
        llm = LLM(str(tmp_path), skip_tokenizer_init=True, show_progress=False, num_kv_blocks=16,
                  attention_backend=backend, max_num_batched_tokens=16)
        before = dict(calls)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert calls[backend] > before[backend] and calls[other] == before[other]
    assert tokens["cpu"] == tokens["torch"]
