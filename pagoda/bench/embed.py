"""`pagoda bench embed`: embeddings per second through LLM.embed against HF transformers, same run.

N random prompts of exactly ``input_len`` tokens (token ids, so both engines see the same
tokens) are embedded by pagoda (the engine's pooling: its --pooling-type, or the checkpoint's)
and by transformers (one forward per static batch of the base model, the same pooling, L2
normalisation), in the same process, so the ratio means something on a noisy machine. The
largest difference between the two engines' vectors is reported as a sanity check.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time

import torch

from pagoda.bench.throughput import load_hf, random_prompts
from pagoda.config import EngineConfig


def bench_pagoda(config: EngineConfig, prompts: list[list[int]]) -> tuple[dict, torch.Tensor, str]:
    from pagoda import LLM

    llm = LLM(**{**vars(config), "show_progress": False})
    llm.embed({"prompt_token_ids": prompts[0][:16]}, use_tqdm=False)   # warm-up
    start = time.perf_counter()
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    elapsed = time.perf_counter() - start
    pooler = llm.engine.pooler_config
    assert pooler is not None
    vectors = torch.tensor([o.outputs.embedding for o in outs])
    return _result("pagoda", elapsed, prompts), vectors, pooler.pooling_type


def bench_hf(model_path: str, config: EngineConfig, prompts: list[list[int]], pooling: str,
             batch_size: int) -> tuple[dict, torch.Tensor]:
    if os.path.isdir(model_path):
        model = load_hf(model_path, config, "AutoModel")
    else:   # a GGUF file: the causal LM's base model
        model = load_hf(model_path, config).model
    device = model.device
    vectors = []
    with torch.inference_mode():
        model(torch.tensor([prompts[0][:16]], device=device))   # warm-up, as pagoda's
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            hidden = model(torch.tensor(prompts[i:i + batch_size], device=device)).last_hidden_state   # equal lengths
            pooled = {"LAST": hidden[:, -1], "MEAN": hidden.mean(dim=1), "CLS": hidden[:, 0]}[pooling]
            vectors.append(torch.nn.functional.normalize(pooled.float(), dim=-1).cpu())
    elapsed = time.perf_counter() - start
    return _result(f"hf-transformers (static batch {batch_size})", elapsed, prompts), torch.cat(vectors)


def _result(name: str, elapsed: float, prompts: list[list[int]]) -> dict:
    return {"engine": name, "elapsed_s": round(elapsed, 3), "embeddings": len(prompts),
            "input_tokens": sum(map(len, prompts)), "embeddings_per_s": round(len(prompts) / elapsed, 2),
            "tokens_per_s": round(sum(map(len, prompts)) / elapsed, 1)}


def add_embed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32, help="tokens per prompt (a sentence or two)")
    p.add_argument("--hf-batch-size", type=int, default=None, help="static batch size for HF (default: all)")
    p.add_argument("--no-compare-hf", action="store_true", help="pagoda only")
    p.add_argument("--save-result", default=None, help="write the results as JSON here")


def run_embed(args: argparse.Namespace, config: EngineConfig) -> int:
    from pagoda.model.loader import resolve_model_path
    from pagoda.tokenizer import load_tokenizer

    if config.task == "auto":
        config = dataclasses.replace(config, task="embed")
    if config.task != "embed":
        raise ValueError("pagoda bench embed needs --task embed (or auto)")
    tokenizer = load_tokenizer(config)
    prompts = random_prompts(args.num_prompts, args.input_len, tokenizer.vocab_size,
                             set(tokenizer.all_special_ids), seed=config.seed)
    result, ours, pooling = bench_pagoda(config, prompts)
    results = [result]
    print(json.dumps(result))
    if not args.no_compare_hf:
        hf_result, theirs = bench_hf(resolve_model_path(config.model), config, prompts, pooling,
                                     args.hf_batch_size or len(prompts))
        hf_result["max_abs_diff_vs_pagoda"] = float((ours - theirs).abs().max())
        results.append(hf_result)
        print(json.dumps(hf_result))
        print(f"pagoda / hf embeddings/s: {result['embeddings_per_s'] / hf_result['embeddings_per_s']:.2f}x "
              f"({pooling} pooling, max |difference| {hf_result['max_abs_diff_vs_pagoda']:.1e})")
    report = {
        "benchmark": "embed",
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len, "pooling": pooling},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "results": results,
    }
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(report, f, indent=2)
    return 0
