"""The attention-backend interface (pagoda/attention): which backend runs where and why,
each backend's metadata from the same scheduler numbers, and the Triton backend (in
Triton's interpreter on the CPU) against the torch reference over mixed steps."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda.attention import AttentionMetadata, paged_attention, select_backend
from pagoda.attention.cpu import CpuBackend
from pagoda.attention.kv_quant import QuantizedKVCache
from pagoda.attention.selector import AttentionBackendError
from pagoda.attention.torch_ref import TorchBackend
from pagoda.config import EngineConfig
from pagoda.ops import cpu_kernels

CPU = torch.device("cpu")


def _triton_backend():
    pytest.importorskip("triton")
    from pagoda.ops import triton_attention

    if not triton_attention.interpreted() and not torch.cuda.is_available():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1 and there is no GPU")
    backend, _ = select_backend("triton", CPU, torch.float32, torch.float32)
    return backend


def test_auto_picks_the_cpu_kernels_for_float32_and_says_why_not_otherwise():
    backend, why = select_backend("auto", CPU, torch.float32, torch.float32)
    if cpu_kernels.kernels() is None:
        assert type(backend) is TorchBackend and "not built" in why
    else:
        assert type(backend) is CpuBackend and why == "auto on the CPU"
    backend, why = select_backend("auto", CPU, torch.bfloat16, torch.bfloat16)
    assert type(backend) is TorchBackend and "float32 queries" in why
    backend, why = select_backend("auto", CPU, torch.float8_e4m3fn, torch.float32)
    assert type(backend) is TorchBackend and "float8" in why


def test_a_backend_named_outright_that_cannot_run_here_is_refused(monkeypatch):
    with pytest.raises(AttentionBackendError, match="float32 queries"):
        select_backend("cpu", CPU, torch.float32, torch.bfloat16)
    with pytest.raises(AttentionBackendError, match="must be one of auto, cpu, torch, triton"):
        select_backend("flash", CPU, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="attention_backend must be auto, cpu, torch or triton"):
        EngineConfig(attention_backend="flashinfer")
    pytest.importorskip("triton")
    from pagoda.ops import triton_attention  # noqa: F401  (its kernels defined as conftest set the interpreter)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(AttentionBackendError, match="TRITON_INTERPRET=1"):
        select_backend("triton", CPU, torch.float32, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(AttentionBackendError, match="float64"):
        select_backend("triton", CPU, torch.float64, torch.float32)


def test_the_cli_flag_reaches_the_engine_config():
    from pagoda.entrypoints.cli import build_parser, config_from_args

    args = build_parser().parse_args(["serve", "--attention-backend", "torch"])
    config = config_from_args(args)
    assert config.attention_backend == "torch"
    assert not config.enforce_eager and config.async_scheduling is None   # (graphs and overlap: CUDA's defaults)
    assert config.max_num_batched_tokens == 512   # the CPU's step budget
    config = config_from_args(build_parser().parse_args(["serve", "--enforce-eager", "--no-async-scheduling"]))
    assert config.enforce_eager and config.async_scheduling is False
    assert EngineConfig(device="cuda").max_num_batched_tokens == 8192
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--attention-backend", "flash"])


# Two decodes, a chunk after a cached prefix, a whole prompt; block size 4 over shuffled blocks.
QUERY_LENS, CONTEXT_LENS = [1, 1, 5, 7], [9, 2, 6, 0]
TABLES = [[11, 3, 7], [0], [4, 9, 1], [2, 8]]


def test_triton_metadata_holds_the_reference_slots_and_reuses_its_buffers():
    backend = _triton_backend()
    ref = AttentionMetadata.build(QUERY_LENS, CONTEXT_LENS, TABLES, 4, CPU)
    meta = backend.build(QUERY_LENS, CONTEXT_LENS, TABLES, 4, CPU)
    assert torch.equal(meta.slot_mapping, ref.slot_mapping)
    assert meta.num_decodes == 2 and meta.num_prefills == 2
    assert meta.seq_lens.tolist() == [10, 3, 11, 7]
    assert meta.query_start_loc.tolist() == [0, 5, 12]
    assert meta.max_query_len == 7 and meta.max_decode_len == 10
    for row, table in zip(meta.block_tables.tolist(), TABLES):
        assert row[:len(table)] == table
    # Steps that fit reuse two alternating buffer sets: the same addresses every other step.
    first = meta.slot_mapping.data_ptr()
    second = backend.build([1], [3], [[5]], 4, CPU).slot_mapping.data_ptr()
    third = backend.build(QUERY_LENS, CONTEXT_LENS, TABLES, 4, CPU)
    assert second != first and third.slot_mapping.data_ptr() == first
    assert torch.equal(third.slot_mapping, ref.slot_mapping)   # the smaller step left nothing behind
    # Each KV group has its own buffers (both groups' metadata live through a step).
    other = backend.build(QUERY_LENS, CONTEXT_LENS, TABLES, 4, CPU, group=1)
    assert other.slot_mapping.data_ptr() not in (first, second)


@pytest.mark.parametrize("kv", ["float32", "float16", "int8", "fp8"])
def test_triton_backend_matches_the_torch_backend_over_a_mixed_step(kv):
    """Store, decodes and prompt chunks of one step: the Triton backend's output and cache
    equal the torch reference's, with GQA, a window, soft-capping and sinks."""
    backend = _triton_backend()
    torch.manual_seed(0)
    heads, kv_heads, d, bs, blocks = 4, 2, 16, 4, 12
    t = sum(QUERY_LENS)
    q, k, v = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
    sinks = torch.randn(heads)
    for window, softcap, layer_sinks in ((None, None, None), (6, 30.0, sinks)):
        outs, caches = [], []
        for name in ("torch", "triton"):
            torch.manual_seed(1)
            if kv in ("int8", "fp8"):
                cache = QuantizedKVCache(blocks, bs, kv_heads, d, torch.int8 if kv == "int8" else torch.float8_e4m3fn,
                                         CPU)
                QuantizedKVCache.write(cache, torch.arange(blocks * bs), torch.randn(blocks * bs, kv_heads, d),
                                       torch.randn(blocks * bs, kv_heads, d))
            else:
                cache = torch.randn(2, blocks, bs, kv_heads, d).to(getattr(torch, kv))
            b = TorchBackend() if name == "torch" else backend
            meta = b.build(QUERY_LENS, CONTEXT_LENS, TABLES, bs, CPU)
            outs.append(paged_attention(q, k, v, cache, meta, d ** -0.5, window=window, softcap=softcap,
                                        sinks=layer_sinks))
            caches.append(cache.data if kv in ("int8", "fp8") else cache)
        assert torch.equal(caches[0], caches[1])
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5 if kv == "float32" else 2e-5)
