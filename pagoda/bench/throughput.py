"""`pagoda bench throughput`: offline throughput through LLM.generate.

N random prompts of exactly ``input_len`` tokens, ``output_len`` tokens each
(ignore_eos, greedy). With --compare-hf the same prompts go through HF
transformers' ``generate()`` with a static batch, in the same run, so the
ratio is meaningful on a noisy shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from pagoda.config import EngineConfig


def random_prompts(num: int, length: int, vocab_size: int, special: set[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(num):
        ids = torch.randint(0, vocab_size, (length * 2,), generator=gen).tolist()
        prompts.append([t for t in ids if t not in special][:length])
    return prompts


def bench_pagoda(config: EngineConfig, prompts: list[list[int]], output_len: int) -> dict:
    from pagoda import LLM, SamplingParams

    llm = LLM(**{**vars(config), "show_progress": False})
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    # Warm-up: one short request (first-call allocations, thread pools).
    llm.generate({"prompt_token_ids": prompts[0][:16]}, SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return _result("pagoda", elapsed, len(prompts), sum(map(len, prompts)), n_out)


def hf_placement(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """Where and in what dtype the HF comparison runs: pagoda's device and dtype (auto =
    float32; on the CPU the bf16 mode's config says float32, the HF reference stays so)."""
    from pagoda.model.loader import parse_dtype

    return torch.device(config.device), parse_dtype(config.dtype)


def load_hf(model_path: str, config: EngineConfig, auto_class: str = "AutoModelForCausalLM"):
    """transformers' model of ``model_path`` (an HF folder or a GGUF file) on pagoda's device and dtype."""
    import transformers

    device, dtype = hf_placement(config)
    cls = getattr(transformers, auto_class)
    if os.path.isdir(model_path):
        model = cls.from_pretrained(model_path, dtype=dtype)
    else:
        model = cls.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=dtype)
    return model.to(device).eval()


def bench_hf(model_path: str, config: EngineConfig, prompts: list[list[int]], output_len: int,
             batch_size: int) -> dict:
    model = load_hf(model_path, config)
    device, dtype = model.device, model.dtype

    def generate(batch: torch.Tensor, new_tokens: int) -> torch.Tensor:
        out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out

    n_out = 0
    with torch.inference_mode():
        # Warm-up, as pagoda's: one short request (first-call allocations, kernels, thread pools).
        generate(torch.tensor([prompts[0][:16]], device=device), 4)
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i:i + batch_size], device=device)   # equal lengths: no padding needed
            out = generate(batch, output_len)
            n_out += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    elapsed = time.perf_counter() - start
    place = "" if device.type == "cpu" and dtype == torch.float32 else f", {device.type} {str(dtype).removeprefix('torch.')}"
    return _result(f"hf-transformers (static batch {batch_size}{place})", elapsed, len(prompts),
                   sum(map(len, prompts)), n_out)


def _result(name: str, elapsed: float, n_req: int, n_in: int, n_out: int) -> dict:
    return {
        "engine": name, "elapsed_s": round(elapsed, 3), "requests": n_req,
        "input_tokens": n_in, "output_tokens": n_out,
        "requests_per_s": round(n_req / elapsed, 3),
        "output_tokens_per_s": round(n_out / elapsed, 2),
        "total_tokens_per_s": round((n_in + n_out) / elapsed, 2),
    }


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--compare-hf", action="store_true",
                   help="also run HF transformers generate() with a static batch, same prompts")
    p.add_argument("--hf-batch-size", type=int, default=None, help="static batch size for HF (default: all)")
    p.add_argument("--save-result", default=None, help="write the results as JSON here")


def run_throughput(args: argparse.Namespace, config: EngineConfig) -> int:
    from pagoda.tokenizer import load_tokenizer
    from pagoda.model.loader import resolve_model_path

    tokenizer = load_tokenizer(config)
    prompts = random_prompts(args.num_prompts, args.input_len, tokenizer.vocab_size,
                             set(tokenizer.all_special_ids), seed=config.seed)
    results = [bench_pagoda(config, prompts, args.output_len)]
    print(json.dumps(results[-1]))
    if args.compare_hf:
        path = resolve_model_path(config.model)
        results.append(bench_hf(path, config, prompts, args.output_len, args.hf_batch_size or len(prompts)))
        print(json.dumps(results[-1]))
        ratio = results[0]["output_tokens_per_s"] / results[1]["output_tokens_per_s"]
        print(f"pagoda / hf output tokens/s: {ratio:.2f}x")
    report = {
        "benchmark": "throughput",
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "results": results,
    }
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(report, f, indent=2)
    return 0
