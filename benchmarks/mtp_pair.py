"""MTP speculative decoding's acceptance and speed-up on a constructed pair (issue #49).

Random weights accept nothing, and no trained MTP head fits this machine, so the pair is
built to know each other: a GLM-4.5-layout target whose layers add nothing to the stream
(their output projections zero: each token's logits are its own embedding's, a bigram model
whose weights are still all read every step) and an MTP head that reads the embedding of the
token it is given through the same norm, so it predicts the target's token after next
exactly. Every draft is accepted: what is measured is what speculation saves when drafts
are right, at a size where a step's cost is the target's weights (memory-bound), not Python.

    python benchmarks/mtp_pair.py [--hidden 1024 --layers 24] [--quantization int8] [--out DIR]

Greedy, one stream, 256 tokens after a 16-token prompt, best of 3, in the same run: plain
decoding, then k = 1, 2, 4 drafts.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch


def build(path: str, hidden: int, layers: int) -> str:
    import transformers
    from safetensors.torch import load_file, save_file

    config = transformers.Glm4MoeConfig(
        vocab_size=49152, hidden_size=hidden, intermediate_size=4 * hidden, head_dim=128,
        num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512), num_hidden_layers=layers,
        first_k_dense_replace=layers, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
        max_position_embeddings=4096, use_qk_norm=True, attention_bias=True, tie_word_embeddings=False,
        architectures=["Glm4MoeForCausalLM"], num_nextn_predict_layers=1)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path, safe_serialization=True)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    head = {}
    for f in files:
        state = load_file(os.path.join(path, f))
        for k in state:
            if "o_proj" in k or "down_proj" in k:   # the layers add nothing
                state[k] = torch.zeros_like(state[k])
            if k.startswith(f"model.layers.{layers - 1}."):
                head[k.replace(f"model.layers.{layers - 1}.", f"model.layers.{layers}.")] = state[k].clone()
            if k == "model.norm.weight":
                head[f"model.layers.{layers}.shared_head.norm.weight"] = state[k].clone()
        save_file(state, os.path.join(path, f), metadata={"format": "pt"})
    head.update({f"model.layers.{layers}.enorm.weight": torch.ones(hidden),
                 f"model.layers.{layers}.hnorm.weight": torch.ones(hidden),
                 f"model.layers.{layers}.eh_proj.weight": torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), 1)})
    save_file(head, os.path.join(path, "mtp.safetensors"), metadata={"format": "pt"})
    from pagoda.bench.hf_quant_files import write_tokenizer

    write_tokenizer(path)   # the bundled model's (the int8 mode calibrates on text)
    return path


def main() -> None:
    from pagoda.config import EngineConfig
    from pagoda.engine.engine_core import EngineCore
    from pagoda.engine.messages import EngineCoreRequest
    from pagoda.model.loader import load_model
    from pagoda.sampling_params import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--quantization", default="none", help="the target's mode (the head stays float32)")
    ap.add_argument("--out", default="docs/results/mtp-pair")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(build(tmp, args.hidden, args.layers), torch.float32, torch.device("cpu"),
                            quantization=args.quantization)
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        rows = []
        for k in (0, 1, 2, 4):
            spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
            best, stats = float("inf"), None
            for _ in range(3):
                core = EngineCore(EngineConfig(model=loaded.path, show_progress=False, speculative_config=spec,
                                               num_kv_blocks=64, quantization=args.quantization),
                                  loaded=loaded, collect_stats=True)
                core.add_request(EngineCoreRequest("r", list(range(100, 116)), params))
                core.step()   # the prompt
                t = time.perf_counter()
                while core.has_unfinished_requests():
                    core.step()
                best = min(best, time.perf_counter() - t)
                stats = core.scheduler.make_stats()
            rows.append({"k": k, "tok_s": (args.tokens - 1) / best, "draft_tokens": stats.spec_num_draft_tokens,
                         "accepted": stats.spec_num_accepted_tokens, "verifications": stats.spec_num_drafts})
            print(rows[-1], flush=True)
    base = rows[0]["tok_s"]
    lines = [f"MTP on a constructed pair: GLM-4.5 layout, hidden {args.hidden}, {args.layers} dense layers "
             f"(~{(12 * args.hidden ** 2 * args.layers + 2 * 49152 * args.hidden) / 1e9:.2f}B parameters), target in the "
             f"{args.quantization} mode, greedy, "
             f"one stream, {args.tokens} tokens.", "",
             "| drafts k | tok/s | speed-up | drafts accepted | tokens per verification |", "|---|---|---|---|---|"]
    for r in rows:
        per = 1 + r["accepted"] / r["verifications"] if r["verifications"] else 1.0
        acc = f"{r['accepted']} / {r['draft_tokens']}" if r["k"] else "-"
        lines.append(f"| {r['k'] or 'none'} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | {acc} | {per:.2f} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
