"""pagoda's CUDA path on a GPU machine, in one run: what a session lent a GPU checks there.

    python benchmarks/cuda_check.py prepare .gpu     # here: wheels the GPU image lacks, the tokenizer
    python benchmarks/cuda_check.py run .gpu         # there (the device tool, carrying .gpu)

`prepare` (on the CPU machine, which reaches PyPI) downloads, for CPython 3.12, the wheels of
pagoda's dependencies that the GPU machine's image does not hold (it reaches no registry),
and writes the bundled model's tokenizer as tokenizer.json (the GGUF itself is too big to
carry). `run` installs those wheels under /tmp/site, then, by --parts:

- roof, backends, latency, e2e8b: the figures of the GPU issue (benchmarks/cuda_figures.py):
  the device's copy bandwidth and bf16 matmul rate, the attention backend and the Triton
  kernels against torch, decode steps at batch 1-128 eager and with CUDA graphs against the
  memory roof, the 8B shape's end-to-end batch and prefill rate;
- families: every family of tests/model/test_families.py, float32 on the GPU, against
  transformers float32 on the CPU: greedy tokens equal (a near-tie excused as there), the
  largest |logprob - transformers'|, every KV block back;
- gguf: the same from GGUF files written from the same tensors;
- preempt: a pool too small for the batch, preemption by recompute and by swap (pinned
  host blocks);
- half: bfloat16 and float16 (reported, not judged: half precision may move a greedy token);
- bench: a Llama-3.2-1B-shaped bfloat16 checkpoint (random weights, the bundled tokenizer):
  `pagoda bench throughput --compare-hf`, `bench latency` at batch 1 and 32;
- steps: the same checkpoint offline through LLM.generate (64 prompts of 128, 128 out), each
  engine step timed: the time inside steps against the whole call (the rest is output
  processing), decode-only steps against steps with prompt tokens;
- serve: the same checkpoint served, a completion, a streamed chat completion, then
  `pagoda bench serve` at concurrency 1 and 16.

Every part adds its figures to OUT/summary.json (--out, default $OUT or the folder), with the
device, the commit and the log of each part's seconds.
Results: docs/benchmarks.md, "On a GPU".
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("roof", "backends", "families", "gguf", "preempt", "half", "latency", "e2e8b", "bench", "steps", "serve")
# The default run (about 5 minutes on an H200), in this order: the roof, the attention backend,
# the 1B decode sweep (eager and graphs), serving, the 8B figures, then every family on the GPU's
# defaults (Triton backend, graphs, overlapped steps) against transformers.
DEFAULT_PARTS = ("roof", "backends", "latency", "serve", "e2e8b", "families")
# pagoda's runtime dependencies (and transformers, for the references) at the versions
# tested here, with what they need that the GPU image (KINDS.md's package list) lacks.
WHEELS = ["gguf", "msgspec", "pyzmq", "fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core",
          "annotated-types", "typing-inspection", "llguidance", "sniffio", "opentelemetry-api", "transformers",
          "huggingface-hub", "kernels", "httpx2", "httpcore2", "truststore", "click", "tomlkit"]



def prepare(folder: str) -> None:
    from importlib.metadata import version

    from pagoda.bench.hf_quant_files import write_tokenizer

    pins = [f"{name}=={version(name)}" for name in WHEELS]
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34)] + [
        "--platform=manylinux2014_x86_64"]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version=3.12", "--implementation=cp", *platforms, "-d", os.path.join(folder, "whl"),
                    *pins], check=True)
    os.makedirs(os.path.join(folder, "tok"), exist_ok=True)
    write_tokenizer(os.path.join(folder, "tok"))
    print(f"{folder}: {len(os.listdir(os.path.join(folder, 'whl')))} wheels and the tokenizer")


def check_family(name: str, source: str, device: str, tmp: str, dtype: str = "auto",
                 preempt: str | None = None, tokens: int = 24) -> str:
    """One family on ``device`` against transformers on the CPU; a line that says PASS or FAIL."""
    import torch
    import transformers

    from pagoda import LLM, SamplingParams
    from tests.model.helpers import compare_greedy, hf_greedy, logprob_gap, top2_gap
    from tests.model.hf_to_gguf import write_gguf
    from tests.model.test_families import _configs, _kv_layout, _prompts

    config, gguf_arch = _configs()[name]
    if source == "gguf" and gguf_arch is None:
        return "skip (no GGUF file of this family)"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for m in hf.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.3)
    path = tempfile.mkdtemp(dir=tmp)
    hf.save_pretrained(os.path.join(path, "hf"), safe_serialization=True)
    model = os.path.join(path, "hf")
    if source == "gguf":
        model = write_gguf(hf, os.path.join(path, "model.gguf"), gguf_arch, model)
    kw = dict(num_kv_blocks=64, block_size=16, max_num_batched_tokens=32)
    if preempt:   # one block more than the longest request needs: preempted, then resumed
        layout = _kv_layout(hf.config)
        chunk = 512 if set(layout.group_windows) == {None} else 32
        kw = dict(num_kv_blocks=layout.blocks_for(70 + tokens, 16, chunk) + 1, block_size=16,
                  max_num_batched_tokens=chunk, preemption_mode=preempt,
                  swap_space=(1 << 26) if preempt == "swap" else 0)
    # (the GPU's defaults: the Triton backend, decode graphs of up to 16 rows, overlapped steps)
    llm = LLM(model, skip_tokenizer_init=True, show_progress=False, device=device, dtype=dtype, max_num_seqs=16,
              **kw)
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=2)
    worst, agree, total, bad = 0.0, 0, 0, []
    for _ in range(2):   # the second pass hits the prefix cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for ids, out in zip(prompts, outputs):
            want, want_logits = hf_greedy(hf, ids, tokens)
            got = out.outputs[0]
            result = compare_greedy(got.token_ids, want,
                                    lambda pos: min(top2_gap(want_logits[pos]), logprob_gap(got, pos)), name)
            same = next((i for i, (a, b) in enumerate(zip(got.token_ids, want)) if a != b), len(want))
            agree, total = agree + same, total + len(want)
            for pos in range(same):
                ref = torch.log_softmax(want_logits[pos].float(), -1)[want[pos]].item()
                worst = max(worst, abs(got.logprobs[pos][want[pos]].logprob - ref))
            bad += [] if result.equal else result.excused
    llm.engine.check_integrity()
    blocks_back = llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks
    preemptions = llm.engine.scheduler.num_preemptions
    ok = not bad and blocks_back and (not preempt or preemptions > 0)
    return (f"{'PASS' if ok else 'FAIL'} tokens equal {agree}/{total}, max |logprob - HF| {worst:.2e}, "
            f"blocks back {blocks_back}, preemptions {preemptions}" + (f" {bad[:2]}" if bad else ""))


def one_b_checkpoint(tmp: str, tokenizer_dir: str) -> str:
    """A Llama-3.2-1B-shaped bfloat16 checkpoint with random weights and the bundled tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = os.path.join(tmp, "llama-1b")
    big = torch.cuda.is_available()   # (on a CPU, a small one: a smoke test of this script)
    config = LlamaConfig(vocab_size=49152, hidden_size=2048 if big else 128, intermediate_size=8192 if big else 256,
                         num_hidden_layers=16 if big else 2, num_attention_heads=32 if big else 4,
                         num_key_value_heads=8 if big else 2, max_position_embeddings=4096,
                         rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         architectures=["LlamaForCausalLM"], initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    for f in os.listdir(tokenizer_dir):   # pagoda.bench.hf_quant_files.write_tokenizer's folder
        shutil.copy(os.path.join(tokenizer_dir, f), path)
    return path


def sh(cmd: list[str], timeout: int) -> None:
    start = time.time()
    print("$", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    print(r.stdout[-2500:], r.stderr[-2500:] if r.returncode else "", f"rc {r.returncode} "
          f"({time.time() - start:.0f} s)", flush=True)


def step_times(before: dict, after: dict) -> None:
    """Where a served step's time goes: inside the engine's step (schedule, model, update)
    or between steps (the engine core's loop, its messages to the API process)."""
    steps = after["totals"]["engine_steps"] - before["totals"]["engine_steps"]
    inside = after["totals"]["engine_step_seconds"] - before["totals"]["engine_step_seconds"]
    recent = [s for s in after["steps"] if s["id"] > max([s["id"] for s in before["steps"]], default=-1)]
    gaps = sorted(b["t"] - (a["t"] + a["dur"]) for a, b in zip(recent, recent[1:]) if b["id"] == a["id"] + 1)
    durs = sorted(s["dur"] for s in recent)
    if steps and durs:
        print(f"steps: {steps}, {1e3 * inside / steps:.1f} ms each inside the engine step (median "
              f"{1e3 * durs[len(durs) // 2]:.1f}); between consecutive steps median "
              f"{1e3 * gaps[len(gaps) // 2] if gaps else float('nan'):.2f} ms, max "
              f"{1e3 * gaps[-1] if gaps else float('nan'):.1f} ms ({len(recent)} steps seen)", flush=True)
        # By kind: decode-only steps against steps with prompt tokens (a whole prompt, a chunk,
        # or decodes and a chunk together).
        for kind, chosen in (("decode-only", [s for s in recent if not any(b[2] for b in s["batch"])]),
                             ("with prompt tokens", [s for s in recent if any(b[2] for b in s["batch"])])):
            if chosen:
                d = sorted(s["dur"] for s in chosen)
                rows = sum(len(s["batch"]) for s in chosen) / len(chosen)
                print(f"  {kind}: {len(chosen)} steps, median {1e3 * d[len(d) // 2]:.1f} ms, max "
                      f"{1e3 * d[-1]:.1f} ms, {rows:.1f} requests a step", flush=True)


def offline_steps(path: str, device: str, num_prompts: int = 64, length: int = 128) -> None:
    """LLM.generate with every engine step timed: where an offline run's time goes."""
    import torch

    from pagoda import LLM, SamplingParams

    llm = LLM(path, device=device, dtype="bfloat16", show_progress=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, llm.engine.vocab_size, (length,), generator=gen).tolist()}
               for _ in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
    records: list[tuple[float, int, int]] = []
    step = llm.engine.step

    def timed():
        start = time.perf_counter()
        out = step()
        st = out.scheduler_stats
        records.append((time.perf_counter() - start, st.step_num_tokens, st.step_batch_size))
        return out

    llm.engine.step = timed
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)   # warm-up
    records.clear()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - start
    inside = sum(r[0] for r in records)
    print(f"offline: {num_prompts} x ({length} in, {length} out) in {total:.2f} s, {len(records)} steps, "
          f"{inside:.2f} s inside them ({total - inside:.2f} s outside: output processing)", flush=True)
    for kind, chosen in (("decode-only", [r for r in records if r[1] == r[2]]),
                         ("with prompt tokens", [r for r in records if r[1] != r[2]])):
        if chosen:
            d = sorted(r[0] for r in chosen)
            print(f"  {kind}: {len(chosen)} steps, median {1e3 * d[len(d) // 2]:.1f} ms, max {1e3 * d[-1]:.1f} ms, "
                  f"{sum(r[2] for r in chosen) / len(chosen):.1f} requests and "
                  f"{sum(r[1] for r in chosen) / len(chosen):.0f} tokens a step", flush=True)


def serve(cli: list[str], path: str, device: str, summary: dict, extra: list[str] | None = None) -> None:
    """pagoda serve on ``device``: /v1/models, a completion, a streamed chat completion, bench serve."""
    import httpx

    base = "http://127.0.0.1:8123"
    # The server's log to a file (a pipe nobody reads while it serves fills and stalls it).
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(cli + ["serve", path, "--device", device, "--dtype", "bfloat16", "--host", "127.0.0.1",
                                   "--port", "8123", *(extra or [])], stdout=log, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    try:
        start = time.time()
        while True:
            try:
                name = httpx.get(f"{base}/v1/models", timeout=2).json()["data"][0]["id"]
                break
            except (httpx.HTTPError, KeyError, ValueError):
                if time.time() - start > 120 or proc.poll() is not None:
                    raise RuntimeError("the server did not answer in 120 s") from None
                time.sleep(1)
        print(f"serve: ready after {time.time() - start:.1f} s", flush=True)
        r = httpx.post(f"{base}/v1/completions", timeout=60,
                       json={"model": name, "prompt": "Hello, my name is", "max_tokens": 16, "temperature": 0})
        print("serve: completion", r.status_code, r.json().get("usage"), flush=True)
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=60, json={
                "model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16,
                "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        print("serve: streamed", r.status_code, len(events), "events, the last", events[-1:], flush=True)
        for c in (1, 16, 64):
            before = httpx.get(f"{base}/dashboard/data", timeout=10).json()
            saved = os.path.join(tempfile.mkdtemp(), "serve.json")
            sh(cli + ["bench", "serve", "--tokenizer", path, "--base-url", base, "--num-prompts", str(max(8, 2 * c)),
                      "--max-concurrency", str(c), "--input-len", "128", "--output-len", "64", "--ignore-eos",
                      "--save-result", saved], 120)
            step_times(before, httpx.get(f"{base}/dashboard/data", params={"since": -1}, timeout=10).json())
            summary.setdefault("serve" if not extra else "serve " + " ".join(extra), {})[f"c{c}"] = \
                _served_figures(saved)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        with open(log.name) as f:
            out = f.read()
        print("serve log, the start:", out[:2500], "\nthe end:", out[-1500:], flush=True)


def _served_figures(saved: str) -> dict:
    """Median TTFT and ITL (ms) of a `bench serve --save-result` file."""
    import json

    try:
        with open(saved) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    point = data["points"][0] if isinstance(data, dict) and "points" in data else data
    metrics = point.get("metrics", point) if isinstance(point, dict) else {}
    return {key: metrics[key]["median"] for key in ("ttft_ms", "itl_ms", "tpot_ms")
            if isinstance(metrics.get(key), dict) and "median" in metrics[key]}


def run(folder: str, device: str, parts: list[str], out: str) -> None:
    import json

    import torch

    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cuda_figures

    tmp = tempfile.mkdtemp()
    print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-", flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    summary: dict = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else device,
                     "torch": torch.__version__, "commit": commit or None, "parts": {}}
    os.makedirs(out, exist_ok=True)

    def save() -> None:
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)

    def report(label, fn, *args, **kwargs):
        start = time.time()
        try:
            print(f"[{label}] {fn(*args, **kwargs)} ({time.time() - start:.1f} s)", flush=True)
            summary["parts"][label] = round(time.time() - start, 1)
        except Exception:
            print(f"[{label}] ERROR ({time.time() - start:.1f} s)\n{traceback.format_exc()[-3000:]}", flush=True)
            summary["parts"][label] = "error"
        save()

    if "roof" in parts:
        report("roof", cuda_figures.roof, device, summary)
    if "backends" in parts:
        report("backends", cuda_figures.backends, device, summary)

    if {"bench", "steps", "serve", "latency"} & set(parts):
        path = one_b_checkpoint(tmp, os.path.join(folder, "tok"))
        cli = [sys.executable, "-m", "pagoda.entrypoints.cli"]
        if "latency" in parts:
            gpu = device.startswith("cuda")   # (on a CPU, a smoke test of small shapes)
            report("latency 1b", cuda_figures.decode_sweep, path, device, "1b", summary,
                   batches=(1, 8, 16, 32, 64, 128) if gpu else (1, 2), context=512 if gpu else 32)
        if "bench" in parts:
            sh(cli + ["bench", "throughput", "--model", path, "--device", device, "--dtype", "bfloat16",
                      "--num-prompts", "64", "--input-len", "128", "--output-len", "128", "--compare-hf"], 300)
            for batch in ("1", "32"):
                sh(cli + ["bench", "latency", "--model", path, "--device", device, "--dtype", "bfloat16",
                          "--input-len", "128", "--output-len", "128", "--num-iters", "3", "--batch-size", batch], 180)
        if "steps" in parts:
            offline_steps(path, device)
        if "serve" in parts:
            try:
                serve(cli, path, device, summary)
            except Exception:   # the GPU's defaults failed: served figures without graphs and overlap
                print(f"serve ERROR\n{traceback.format_exc()[-3000:]}\nserve again, eagerly, steps in turn", flush=True)
                serve(cli, path, device, summary, ["--enforce-eager", "--no-async-scheduling"])
            save()
    if "e2e8b" in parts:
        def eight_b() -> str:
            path8 = cuda_figures.write_8b_checkpoint(tmp, os.path.join(folder, "tok"), device)
            gpu = device.startswith("cuda")
            sweep = cuda_figures.decode_sweep(path8, device, "8b", summary, batches=(1, 8, 64) if gpu else (1, 2),
                                              context=512 if gpu else 32, modes=("graphs",) if gpu else ("eager",))
            return sweep + "\n" + cuda_figures.e2e_8b(path8, device, summary)

        report("e2e8b", eight_b)
    # Correctness last: the figures above are what only a GPU gives (the families also pass
    # through the Triton kernels in the interpreter, in CI).
    if "families" in parts:
        from tests.model.test_families import _configs

        for name in _configs():   # every family test_families.py checks on the CPU
            report(f"{name} hf float32", check_family, name, "hf", device, tmp)
    if "gguf" in parts:
        for name in ("llama31", "qwen3", "gemma3", "mixtral"):
            report(f"{name} gguf float32", check_family, name, "gguf", device, tmp)
    if "preempt" in parts:
        for name, mode in (("llama31", "recompute"), ("llama31", "swap"), ("gemma3", "swap")):
            report(f"{name} preemption by {mode}", check_family, name, "hf", device, tmp, preempt=mode)
    if "half" in parts:
        for name in ("llama31", "qwen3", "gemma3", "qwen3moe"):
            for dtype in ("bfloat16", "float16"):
                report(f"{name} {dtype} (reported)", check_family, name, "hf", device, tmp, dtype=dtype)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["prepare", "run"])
    p.add_argument("folder", help="where prepare writes the wheels and tokenizer, and run reads them")
    p.add_argument("--device", default="cuda")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                   help=f"a comma-separated choice of {', '.join(PARTS)} (default {','.join(DEFAULT_PARTS)})")
    p.add_argument("--out", default=os.environ.get("OUT"), help="where summary.json goes (default $OUT, else FOLDER)")
    args = p.parse_args()
    if args.action == "prepare":
        prepare(args.folder)
        return 0
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    wheels = glob.glob(os.path.join(args.folder, "whl", "*.whl"))
    if wheels and args.device.startswith("cuda"):   # the GPU machine: its image lacks these
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", "/tmp/site", *wheels], check=True)
        sys.path.insert(0, "/tmp/site")
        os.environ["PYTHONPATH"] = os.pathsep.join(["/tmp/site", ROOT, os.environ.get("PYTHONPATH", "")])
    run(args.folder, args.device, parts, args.out or args.folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
