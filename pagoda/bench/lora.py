"""`pagoda bench lora`: throughput of one batch spread over several LoRA adapters
against the same batch all on the base model, through LLM.generate.

N random prompts of ``input_len`` tokens, ``output_len`` tokens each (greedy,
ignore_eos). Request i uses adapter i % num_adapters. Both runs use the same
LoRA-enabled engine (``max_loras = num_adapters``, so every adapter stays
resident), so the ratio is the cost of the adapters' extra GEMMs in a mixed
batch. ``--compare-no-lora`` adds the base batch on an engine without LoRA
(the cost of the wrapped layers when no adapter is used).

Without ``--lora-paths`` the adapters are random PEFT-format adapters written
to a temporary folder (A, B ~ N(0, 1) / sqrt(in), B scaled down; all seven
projections), so nothing needs to be downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

from pagoda.config import EngineConfig

_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_lora_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--lora-rank", type=int, default=16, help="rank of the random adapters")
    p.add_argument("--lora-paths", nargs="+", default=None, help="PEFT adapter folders instead of random ones")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--compare-no-lora", action="store_true", help="also run the base batch without --enable-lora")
    p.add_argument("--save-result", default=None, help="write the results as JSON here")


def write_random_adapter(path: str, arch, rank: int, seed: int, alpha: float | None = None) -> str:
    """A PEFT-format adapter (adapter_config.json + adapter_model.safetensors) with random weights."""
    from safetensors.torch import save_file

    from pagoda.lora.adapter import projection_shapes

    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(arch)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for proj in _TARGETS:
            in_f, out_f = shapes[proj]
            block = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / in_f ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.01
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank, "target_modules": list(_TARGETS),
              "bias": "none", "use_rslora": False, "lora_dropout": 0.0}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def _timed(llm, prompts, params, loras) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_lora_bench(args: argparse.Namespace, config: EngineConfig) -> int:
    from pagoda import LLM, LoRARequest, SamplingParams
    from pagoda.bench.throughput import _result, random_prompts

    if args.num_adapters < 1 or args.num_prompts < 1:
        raise ValueError("--num-adapters and --num-prompts must be >= 1")
    base_config = {**vars(config), "show_progress": False}
    with tempfile.TemporaryDirectory(prefix="pagoda-bench-lora-") as tmp:
        llm = LLM(**{**base_config, "enable_lora": True, "max_loras": args.num_adapters,
                     "max_lora_rank": max(args.lora_rank, config.max_lora_rank)})
        arch = llm.engine.loaded.arch
        if args.lora_paths:
            if len(args.lora_paths) != args.num_adapters:
                raise ValueError(f"--lora-paths gives {len(args.lora_paths)} adapters, --num-adapters {args.num_adapters}")
            paths = args.lora_paths
        else:
            paths = [write_random_adapter(os.path.join(tmp, f"lora{i}"), arch, args.lora_rank, seed=i)
                     for i in range(args.num_adapters)]
        loras = [LoRARequest(f"lora{i}", i + 1, p) for i, p in enumerate(paths)]
        special = set(llm.tokenizer.all_special_ids) if llm.tokenizer is not None else set()
        prompts = random_prompts(args.num_prompts, args.input_len, arch.vocab_size, special, seed=config.seed)
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        n_in = sum(map(len, prompts))
        # Warm-up: one short request per adapter (loads them into their slots) and one on the base.
        warm = [{"prompt_token_ids": prompts[0][:16]}] * (len(loras) + 1)
        llm.generate(warm, SamplingParams(max_tokens=2), use_tqdm=False, lora_request=[None, *loras])

        results = []
        elapsed, n_out = _timed(llm, prompts, params, None)
        results.append(_result("base model (LoRA engine)", elapsed, len(prompts), n_in, n_out))
        print(json.dumps(results[-1]))
        mixed = [loras[i % len(loras)] for i in range(len(prompts))]
        elapsed, n_out = _timed(llm, prompts, params, mixed)
        results.append(_result(f"{len(loras)} adapters mixed", elapsed, len(prompts), n_in, n_out))
        print(json.dumps(results[-1]))
        del llm
        if args.compare_no_lora:
            plain = LLM(**base_config)
            plain.generate(warm[:1], SamplingParams(max_tokens=2), use_tqdm=False)
            elapsed, n_out = _timed(plain, prompts, params, None)
            results.append(_result("base model (LoRA off)", elapsed, len(prompts), n_in, n_out))
            print(json.dumps(results[-1]))
    ratio = results[1]["output_tokens_per_s"] / results[0]["output_tokens_per_s"]
    print(f"mixed adapters / base output tokens/s: {ratio:.3f}")
    report = {
        "benchmark": "lora",
        "workload": {"num_prompts": args.num_prompts, "num_adapters": args.num_adapters, "lora_rank": args.lora_rank,
                     "input_len": args.input_len, "output_len": args.output_len,
                     "lora_paths": args.lora_paths},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "results": results,
        "mixed_over_base": round(ratio, 4),
    }
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(report, f, indent=2)
    return 0
