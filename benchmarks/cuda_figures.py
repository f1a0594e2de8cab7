"""The figures of the GPU issue (#45), measured by benchmarks/cuda_check.py's parts `roof`,
`backends`, `latency` and `e2e8b`; each adds its numbers to the run's summary.json.

- roof: the device's copy bandwidth (a 4 GiB device-to-device copy: 2 x bytes / time, the
  memory roof every decode figure is judged against) and its bfloat16 matmul rate (8192^3).
- backends: which attention backend `auto` picks here and why; the Triton kernels against
  the torch reference on one mixed step (float32 and bfloat16); their first-call (compile)
  time apart from a steady call.
- latency: decode step times of a checkpoint at batch 1, 8, 16, 32, 64, 128 over 512-token
  contexts, eager and with CUDA graphs, against (weight bytes + KV bytes read) / bandwidth.
- e2e8b: the 8B shape (random weights, written here): decode at batch 1 against the roof,
  batch 8 x (32 in, 128 out) end to end (vLLM's CI: 833 ms on an H200), and the prefill of
  8 x 2,048 tokens against the matmul rate.

On a CPU (--device cpu) every part runs on tiny shapes, as a smoke test of this file.
"""

from __future__ import annotations

import os
import statistics
import time

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str, repeats: int) -> float:
    """Seconds per call of ``fn`` (after one warm-up call)."""
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / repeats


def roof(device: str, summary: dict) -> str:
    gib = 4 if device.startswith("cuda") else 1 / 64
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), device, 10)
    bandwidth = 2 * src.numel() * 2 / seconds
    del src, dst
    size = 8192 if device.startswith("cuda") else 512
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    flops = 2 * size**3 / _timed(lambda: a @ b, device, 10)
    summary["bandwidth_bytes_per_s"] = bandwidth
    summary["bf16_matmul_flops"] = flops
    return f"copy bandwidth {bandwidth / 1e12:.2f} TB/s ({gib:g} GiB copy); bf16 matmul {flops / 1e12:.1f} TFLOP/s"


def backends(device: str, summary: dict) -> str:
    from pagoda.attention import AttentionMetadata, paged_attention, select_backend
    from pagoda.attention.torch_ref import TorchBackend

    dev = torch.device(device)
    auto, why = select_backend("auto", dev, torch.bfloat16, torch.bfloat16)
    lines = [f"auto: {auto.name} ({why})"]
    summary["attention_backend"] = f"{auto.name} ({why})"
    if device.startswith("cuda"):
        q = torch.randn(1, 8, 128, 64, device=dev, dtype=torch.bfloat16)
        choice = torch._fused_sdp_choice(q, q, q)
        lines.append(f"SDPA's choice for a plain call: {choice} (cuDNN enabled: "
                     f"{torch.backends.cuda.cudnn_sdp_enabled()})")
    try:
        triton_backend, _ = select_backend("triton", dev, torch.float32, torch.float32)
    except ValueError as e:
        return "; ".join(lines + [f"triton: {e}"])
    query_lens, context_lens = [1] * 6 + [37, 100], [700, 31, 5, 260, 1024, 90, 64, 0]
    block = 16
    tables, at = [], 0
    for q_len, ctx in zip(query_lens, context_lens):
        n = -(-(q_len + ctx) // block)
        tables.append(list(range(at, at + n)))
        at += n
    heads, kv_heads, d = 32, 8, 128
    t = sum(query_lens)
    gen = torch.Generator(device=dev).manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(t, heads, d, device=dev, generator=gen).to(dtype)
        k = torch.randn(t, kv_heads, d, device=dev, generator=gen).to(dtype)
        v = torch.randn(t, kv_heads, d, device=dev, generator=gen).to(dtype)
        cache = torch.randn(2, at, block, kv_heads, d, device=dev, generator=gen).to(dtype)
        outs, times = [], []
        for backend in (TorchBackend(), triton_backend):
            meta = backend.build(query_lens, context_lens, tables, block, dev)
            c = cache.clone()
            start = time.perf_counter()
            outs.append(paged_attention(q, k, v, c, meta, d ** -0.5, window=None))
            _sync(device)
            first = time.perf_counter() - start
            steady = _timed(lambda: paged_attention(q, k, v, c, meta, d ** -0.5), device, 5)
            times.append((first, steady))
        err = (outs[0].float() - outs[1].float()).abs().max().item()
        lines.append(f"{str(dtype)[6:]}: triton vs torch max |diff| {err:.2e}; first call (compile) "
                     f"{times[1][0]:.2f} s; a step's attention {1e3 * times[1][1]:.2f} ms (torch "
                     f"{1e3 * times[0][1]:.2f} ms)")
        summary[f"triton_vs_torch_max_diff_{str(dtype)[6:]}"] = err
        summary[f"triton_compile_s_{str(dtype)[6:]}"] = times[1][0]
    return "; ".join(lines)


def _kv_bytes(core, batch: int, context: int) -> int:
    """Bytes of K/V a decode step at ``batch`` x ``context`` reads (every layer's cache)."""
    model = core.runner.model
    c = model.config
    elem = torch.empty(0, dtype=core.runner.kv_caches[0].dtype).element_size()
    return batch * context * len(model.model.layers) * 2 * c.num_key_value_heads * c.head_dim * elem


def decode_sweep(path: str, device: str, label: str, summary: dict, batches=(1, 8, 32, 64, 128), context: int = 512,
                 steps: int = 16, modes=("eager", "graphs")) -> str:  # fmt: skip
    """Median decode step (ms) per batch and mode, against the roof of the bytes it reads."""
    from pagoda.bench.latency import run_batch
    from pagoda.config import EngineConfig
    from pagoda.engine.engine_core import EngineCore
    from pagoda.model.loader import parameter_bytes

    bandwidth = summary.get("bandwidth_bytes_per_s")
    lines = []
    for mode in modes:
        if mode == "graphs" and not device.startswith("cuda"):
            continue
        start = time.perf_counter()
        config = EngineConfig(model=path, device=device, dtype="bfloat16" if device.startswith("cuda") else "auto",
                              enforce_eager=mode == "eager", max_num_seqs=max(batches), show_progress=False,
                              max_model_len=context + steps + 16)
        core = EngineCore(config, collect_stats=True)
        ready = time.perf_counter() - start
        weights = parameter_bytes(core.runner.model)
        vocab = core.vocab_size
        gen = torch.Generator().manual_seed(1)
        lines.append(f"{label} {mode}: ready in {ready:.1f} s, weights {weights / 2**30:.2f} GiB"
                     + (f", graphs {core.runner.graphs.sizes[-1]} max" if core.runner.graphs else ""))
        for batch in batches:
            def prompts():
                return [torch.randint(3, vocab, (context,), generator=gen).tolist() for _ in range(batch)]

            run_batch(core, prompts(), 3, f"warm-{mode}-{batch}")
            records = run_batch(core, prompts(), steps, f"{mode}-{batch}")
            decode = [r["time_s"] for r in records if r["kind"] == "decode"]
            ms = 1e3 * statistics.median(decode)
            key = f"{label}/{mode}/b{batch}"
            summary.setdefault("decode_step_ms", {})[key] = ms
            text = f"  batch {batch}: decode step median {ms:.2f} ms"
            if bandwidth:
                roof_ms = 1e3 * (weights + _kv_bytes(core, batch, context)) / bandwidth
                summary.setdefault("decode_roof_ratio", {})[key] = ms / roof_ms
                text += f" = {ms / roof_ms:.2f} x the roof ({roof_ms:.2f} ms)"
            lines.append(text)
        del core
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return "\n".join(lines)


def write_8b_checkpoint(tmp: str, tokenizer_dir: str, device: str) -> str:
    """A Llama-3.1-8B-shaped bfloat16 checkpoint (random weights, ~16 GB; on a CPU a
    small one of the same family) with the bundled tokenizer."""
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig

    big = device.startswith("cuda")
    path = os.path.join(tmp, "llama-8b" if big else "llama-8b-tiny")
    config = LlamaConfig(vocab_size=49152 if not big else 128256, hidden_size=4096 if big else 128,
                         intermediate_size=14336 if big else 256, num_hidden_layers=32 if big else 2,
                         num_attention_heads=32 if big else 4, num_key_value_heads=8 if big else 2,
                         max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"],
                         initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="5GB")
    del model
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), path)
    if big:
        torch.cuda.empty_cache()
    return path


def e2e_8b(path: str, device: str, summary: dict) -> str:
    """The 8B figures: batch 8, 32 in / 128 out end to end; 8 x 2,048-token prefill rate."""
    from pagoda.bench.latency import run_batch
    from pagoda.config import EngineConfig
    from pagoda.engine.engine_core import EngineCore
    from pagoda.model.loader import parameter_bytes

    big = device.startswith("cuda")
    config = EngineConfig(model=path, device=device, dtype="bfloat16" if big else "auto", max_num_seqs=64,
                          show_progress=False, max_model_len=4096, max_num_batched_tokens=16384)
    core = EngineCore(config)
    vocab = core.vocab_size
    gen = torch.Generator().manual_seed(2)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(n)]

    lines = []
    run_batch(core, prompts(8, 32), 8, "warm")
    start = time.perf_counter()
    run_batch(core, prompts(8, 32), 128, "e2e")
    e2e = time.perf_counter() - start
    summary["e2e_8b_b8_32in_128out_ms"] = 1e3 * e2e
    lines.append(f"batch 8, 32 in / 128 out: {1e3 * e2e:.0f} ms end to end (vLLM's CI on an H200: 833 ms)")
    length = 2048 if big else 256
    run_batch(core, prompts(8, length), 1, "warm-prefill")
    records = run_batch(core, prompts(8, length), 1, "prefill")
    prefill_s = sum(r["time_s"] for r in records if r["kind"] == "prefill")
    tokens = 8 * length
    weights = parameter_bytes(core.runner.model)
    flops = 2 * (weights / 2) * tokens   # 2 FLOPs per bfloat16 weight per token (attention not counted)
    rate = flops / prefill_s
    summary["prefill_8x2048_tok_per_s"] = tokens / prefill_s
    text = f"prefill 8 x {length}: {prefill_s * 1e3:.0f} ms, {tokens / prefill_s:.0f} tok/s, {rate / 1e12:.1f} TFLOP/s"
    if summary.get("bf16_matmul_flops"):
        summary["prefill_matmul_ratio"] = rate / summary["bf16_matmul_flops"]
        text += f" = {rate / summary['bf16_matmul_flops']:.2f} of the measured matmul rate"
    lines.append(text)
    del core
    return "\n".join(lines)
