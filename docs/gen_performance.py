#!/usr/bin/env python3
"""Write docs/performance.md, pagoda's current figures per machine kind, from docs/results/.

    python docs/gen_performance.py [--results DIR] [--out FILE] [--check]

Run by `make docs` before `mkdocs build`. Standard library only.

Which runs are *current* is chosen below (CPU_MACHINES, SERVED, OFFLINE): the latest run of
each model on each machine kind, as docs/benchmarks.md (the measurement log) names them; the
result files do not record the CPU, so each run's machine kind is written here, from that log.
Every number is read from the run's files (the JSON that `pagoda bench serve` and
benchmarks/compare.py save; for a GPU run, the logs and JSON of benchmarks/cuda_check.py and
any summary.json it wrote), and every figure links to the file it came from. A GPU run is any
folder with a summary.json, or named gpu-* with a check.log: those need no entry here.

--check exits 1 if the page on disk is not what the results give (a stale page).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Machine:
    key: str
    name: str
    detail: str
    log_anchor: str   # the measurement log's section that describes the machine


CPU_MACHINES = [
    Machine("xeon-amx", "Intel Xeon with AMX, 2 vCPUs", "AMX (int8, bf16 tiles), AVX-512 (VNNI, BF16); 24 GB; no GPU",
            "every-integer-block-type-in-the-lanes-2026-12-08-seventeenth-session"),
    Machine("zen4", "AMD EPYC Zen 4, 2 vCPUs", "AVX-512 (VNNI, BF16), no AMX; 24 GB; no GPU",
            "the-cpu-roof-issue-28-both-cores-bf16-on-onednn-openvino-genai-as-a-peer"),
    Machine("zen3", "AMD EPYC Zen 3, 2 vCPUs", "AVX2, no AVX-512; 24 GB; no GPU",
            "real-size-models-issue-20-gguf-weights-kept-in-their-blocks"),
]

# The models, as written by pagoda.bench.gguf_files / hf_quant_files (random weights of the
# real shapes, the bundled tokenizer) or the bundled file.
MODELS = {
    "smollm2": "SmolLM2-135M-Instruct, Q4_1 (the bundled model)",
    "llama1b": "Llama-3.2-1B shape, Q4_K_M (669 MB)",
    "llama8b": "Llama-3.1-8B shape, Q4_K_M (4.47 GB)",
    "qwen3": "Qwen3-1.7B shape, Q4_K_M (930 MB)",
    "qwen3moe": "Qwen3-MoE 1.6B-A0.3B shape, Q4_K_M (1.07 GB)",
    "gptoss": "GPT-OSS-20B shape, MXFP4 experts (12.0 GB)",
    "qwen35": "Qwen3.5-2B layers (hybrid: 18 Gated DeltaNet, 6 attention), Q4_K_M (898 MB)",
    "1b-gptq": "Llama-3.2-1B shape, GPTQ 4-bit HF folder (708 MB)",
    "1b-awq": "Llama-3.2-1B shape, AWQ 4-bit HF folder (707 MB)",
    "1b-fp8": "Llama-3.2-1B shape, FP8 128x128-block HF folder (1175 MB)",
    "1b-q8_0": "Llama-3.2-1B shape, Q8_0 (1119 MB)",
    "1b-q4_0": "Llama-3.2-1B shape, Q4_0 (632 MB)",
    "1b-q5_k_m": "Llama-3.2-1B shape, Q5_K_M (`llama-quantize` from F16, 773 MB)",
    "qwen3moe-q8_0": "Qwen3-MoE 1.6B-A0.3B shape, Q8_0 (1.85 GB)",
    "1b-q3_k_m": "Llama-3.2-1B shape, Q3_K_M (`llama-quantize` from F16, 552 MB)",
    "1b-q2_k": "Llama-3.2-1B shape, Q2_K (`llama-quantize` from F16, 442 MB)",
    "1b-iq4_xs": "Llama-3.2-1B shape, IQ4_XS (`llama-quantize` from F16, 609 MB)",
    "1b-q5_0": "Llama-3.2-1B shape, Q5_0 (`llama-quantize` from F16, 754 MB)",
}

# (machine, model, folder under docs/results, table): served runs, every pagoda mode in the
# folder against llama-server in the same run. Order: the order of the tables' rows.
SERVED = [
    ("xeon-amx", "smollm2", "lanes32/bundled", "main"),
    ("xeon-amx", "llama1b", "auto-by-type/llama1b-q4_k_m-final", "main"),
    ("xeon-amx", "1b-q4_0", "lanes32/q4_0-final", "main"),
    ("xeon-amx", "1b-q8_0", "lanes32/q8_0", "main"),
    ("xeon-amx", "1b-q5_k_m", "lanes32/q5_k_m", "main"),
    ("xeon-amx", "gptoss", "gptoss-stack", "main"),
    ("xeon-amx", "qwen3moe-q8_0", "qwen3moe-q8_0-lanes", "main"),
    ("xeon-amx", "1b-q3_k_m", "lanes-all/q3_k_m", "main"),
    ("xeon-amx", "1b-q2_k", "lanes-all/q2_k", "main"),
    ("xeon-amx", "1b-iq4_xs", "lanes-all/iq4_xs", "main"),
    ("xeon-amx", "1b-q5_0", "lanes-all/q5_0", "main"),
    ("zen4", "smollm2", "defaults-bundled", "main"),
    ("zen4", "llama1b", "defaults-1b-q4_k_m", "main"),
    ("zen4", "smollm2", "cpu-roof-served", "main"),
    ("zen4", "smollm2", "bundled-check-vnni", "main"),
    ("zen4", "llama1b", "real-1b-vnni-2", "main"),
    ("zen4", "qwen3", "qwen3-1.7b", "main"),
    ("zen4", "qwen3moe", "qwen3-moe", "main"),
    ("zen4", "gptoss", "gpt-oss-20b", "main"),
    ("zen4", "qwen35", "hybrid-qwen35-2b", "main"),
    ("zen3", "smollm2", "bundled-seventh", "main"),
    ("zen3", "llama1b", "real-1b-ninth", "main"),
    ("zen3", "llama1b", "real-1b-ninth-int8", "main"),
    ("zen3", "llama8b", "real-8b-row8", "main"),
    ("zen3", "llama8b", "real-8b-c16-eighth-3", "main"),
    ("zen3", "1b-gptq", "hfq-1b-gptq", "hfq"),
    ("zen3", "1b-awq", "hfq-1b-awq", "hfq"),
    ("zen3", "1b-fp8", "hfq-1b-fp8", "hfq"),
    ("zen3", "llama1b", "hfq-1b-q4_k_m", "hfq"),
    ("zen3", "1b-q8_0", "hfq-1b-q8_0", "hfq"),
]

# Offline runs (no server: pagoda's LLM against OpenVINO GenAI on the same token ids).
OFFLINE = [
    ("zen4", "smollm2", "cpu-roof-offline"),
    ("zen4", "llama1b", "cpu-roof-1b"),
]

# Runs made since `--quantization auto` became the default: their "pagoda" row is the default
# (the gguf mode for a GGUF file of 256 MiB or more on the CPU, mostly of Q4_K / Q6_K / MXFP4 since
# 2026-12-07, else exact; on AVX-512 VNNI CPUs also Q4_0 / Q4_1 / Q8_0 / IQ4_NL files since
# the sixteenth session), "pagoda-exact"
# the exact mode. In earlier runs "pagoda" was the exact mode, then the default.
AUTO_DEFAULT_RUNS = {"defaults-1b-q4_k_m", "defaults-bundled", "hybrid-qwen35-2b", "auto-by-type/llama1b-q4_k_m-final",
                     "lanes32/q8_0", "lanes32/q5_k_m", "lanes32/gptoss",
                     "lanes32/q4_0-final", "gptoss-stack", "qwen3moe-q8_0-lanes"}
MODE_NAMES = {
    "pagoda": "exact",
    "pagoda-exact": "exact",
    "pagoda-gguf": "`--quantization gguf`",
    "pagoda-int8": "`--quantization int8`",
    "pagoda-q4": "`--quantization q4`",
    "pagoda-bf16": "`--dtype bfloat16`",
}
PEER = "llama-server"


class ResultsError(Exception):
    pass


def _load(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ResultsError(f"{path}: {e}") from None


def _mode(label: str, folder: str | None = None) -> str:
    base = label.removesuffix("-offline")
    if base == "pagoda" and folder in AUTO_DEFAULT_RUNS:
        return "default (`auto`)"
    name = MODE_NAMES.get(base, f"`{base}`")
    return name


def _fmt(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if value < 3 else f"{value:.1f}"


def _ms(value: float) -> str:
    if value < 1000:
        return f"{value:.0f} ms"
    return f"{value / 1000:.2f} s" if value < 10000 else f"{value / 1000:.1f} s"


def _gib(mb: float | None) -> str:
    return "" if mb is None else f"{mb / 1024:.2f} GiB"


@dataclass
class Engine:
    label: str
    file: str                     # path relative to docs/
    date: str
    tok_s: dict[int, float]       # concurrency -> output tokens/s
    ttft_c1: float | None         # median ms at concurrency 1
    rss_mb: float | None          # at the highest concurrency
    workload: tuple[int, int] | None


def _engines(results: Path, folder: str, kinds: tuple[str, ...]) -> list[Engine]:
    path = results / folder
    if not path.is_dir():
        raise ResultsError(f"{path}: no such results folder (named in docs/gen_performance.py)")
    out = []
    for file in sorted(path.glob("*.json")):
        data = _load(file)
        if not isinstance(data, dict) or data.get("benchmark") not in kinds or not data.get("points"):
            continue
        tok_s, ttft, rss = {}, None, None
        points = sorted(data["points"], key=lambda p: p.get("max_concurrency") or 0)
        for p in points:
            c = p.get("max_concurrency")
            m = p.get("metrics", {})
            if c is None or "output_throughput" not in m or m.get("failed"):
                continue
            tok_s[c] = m["output_throughput"]
            if c == 1 and isinstance(m.get("ttft_ms"), dict):
                ttft = m["ttft_ms"].get("median")
            rss = p.get("server_rss_mb", p.get("peak_rss_mb"))
        w = data.get("workload") or {}
        workload = (w["input_len"], w["output_len"]) if "input_len" in w and "output_len" in w else None
        out.append(Engine(data.get("label") or file.stem, f"results/{folder}/{file.name}",
                          (data.get("date") or "")[:10], tok_s, ttft, rss, workload))
    if not out:
        raise ResultsError(f"{path}: no benchmark JSON of kind {', '.join(kinds)}")
    return out


def _run_link(results: Path, folder: str, engines: list[Engine]) -> str:
    target = f"results/{folder}/compare.md" if (results / folder / "compare.md").exists() else engines[0].file
    dates = sorted({e.date for e in engines if e.date})
    return f"[{folder}]({target})" + (f", {dates[-1]}" if dates else "")


def _cell(engine: Engine, c: int, peer: Engine | None) -> str:
    if c not in engine.tok_s:
        return ""
    text = f"[{_fmt(engine.tok_s[c])}]({engine.file})"
    if peer is not None and engine is not peer and peer.tok_s.get(c):
        text += f" ({engine.tok_s[c] / peer.tok_s[c]:.2f}x)"
    return text


def served_table(results: Path, runs: list[tuple[str, str]]) -> tuple[list[str], list[tuple]]:
    """Markdown rows for served runs [(model, folder)], and the ratios for the summary."""
    loaded = [(model, folder, _engines(results, folder, ("serve",))) for model, folder in runs]
    conc = sorted({c for _, _, engines in loaded for e in engines for c in e.tok_s})
    head = ["model", "engine"] + [f"{c} stream{'s' if c > 1 else ''}, tok/s" for c in conc] + \
           ["TTFT p50, 1 stream", "RSS", "in / out tokens", "run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios = []
    for model, folder, engines in loaded:
        peer = next((e for e in engines if e.label == PEER), None)
        ordered = [e for e in engines if e.label != PEER] + ([peer] if peer else [])
        for i, e in enumerate(ordered):
            name = "llama-server `-t 2`" if e is peer else f"pagoda {_mode(e.label, folder)}"
            workload = f"{e.workload[0]} / {e.workload[1]}" if e.workload else ""
            row = [MODELS[model] if i == 0 else "", name] + [_cell(e, c, peer) for c in conc] + \
                  [_ms(e.ttft_c1) if e.ttft_c1 is not None else "", _gib(e.rss_mb), workload,
                   _run_link(results, folder, engines) if i == 0 else ""]
            lines.append("| " + " | ".join(row) + " |")
            if e is not peer and peer is not None:
                for c in conc:
                    if c in e.tok_s and peer.tok_s.get(c):
                        ratios.append((model, folder, e, c, e.tok_s[c] / peer.tok_s[c]))
    return lines, ratios


def offline_table(results: Path, runs: list[tuple[str, str]]) -> list[str]:
    loaded = [(model, folder, _engines(results, folder, ("pagoda-offline", "openvino-genai-offline")))
              for model, folder in runs]
    conc = sorted({c for _, _, engines in loaded for e in engines for c in e.tok_s})
    head = ["model", "engine"] + [f"{c} prompt{'s' if c > 1 else ''}, tok/s" for c in conc] + \
           ["TTFT p50, 1 prompt", "peak RSS", "run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, folder, engines in loaded:
        peers = [e for e in engines if e.label.startswith("openvino")]
        ours = [e for e in engines if e.label.startswith("pagoda")]
        for i, e in enumerate(ours + peers):
            if e.label.startswith("openvino"):
                name = f"OpenVINO GenAI `{e.label.removeprefix('openvino-')}`"
            else:
                name = f"pagoda {_mode(e.label, folder)}"
            cells = []
            for c in conc:
                if c not in e.tok_s:
                    cells.append("")
                    continue
                text = f"[{_fmt(e.tok_s[c])}]({e.file})"
                best = max((p.tok_s.get(c, 0) for p in peers), default=0)
                if e in ours and best:
                    text += f" ({e.tok_s[c] / best:.2f}x)"
                cells.append(text)
            row = [MODELS[model] if i == 0 else "", name] + cells + \
                  [_ms(e.ttft_c1) if e.ttft_c1 is not None else "", _gib(e.rss_mb),
                   _run_link(results, folder, engines) if i == 0 else ""]
            lines.append("| " + " | ".join(row) + " |")
    return lines


def summary_rows(machine: Machine, ratios: list[tuple]) -> list[str]:
    """Per model: pagoda's fastest mode against llama-server at 1 and 16 streams."""
    rows = []
    for model in dict.fromkeys(r[0] for r in ratios):
        cells = []
        for c in (1, 16):
            best = max((r for r in ratios if r[0] == model and r[3] == c), key=lambda r: r[4], default=None)
            if best is None:
                cells.append("")
                continue
            _, folder, engine, _, ratio = best
            cells.append(f"[{ratio:.2f}x]({engine.file}) ({_mode(engine.label, folder)}, "
                         f"{_fmt(engine.tok_s[c])} tok/s)")
        rows.append(f"| {machine.name} | {MODELS[model]} | " + " | ".join(cells) + " |")
    return rows


# ---- GPU runs ------------------------------------------------------------------------------

_TABLE_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\S+)\s*\|\s*(\d+)\s*\|\s*(\d+)/(\d+)\s*\|\s*([\d.]+)\s*\|\s*[\d.]+\s*\|"
                        r"\s*([\d.]+)\s*/\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|")
_LATENCY = re.compile(r"decode step\s+median ([\d.]+) ms.*\(([\d.]+) tok/s\)")
_BATCH = re.compile(r"bench latency .*--batch-size (\d+)")
_DEVICE = re.compile(r"cuda True (.+)$")
_DATE = re.compile(r"^(\d{4}-\d{2}-\d{2}) \d{2}:\d{2}")


def _gpu_date(folder: Path) -> str | None:
    """The first log timestamp of the run (the engine's log lines), if any."""
    for log in sorted(folder.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            m = _DATE.match(line)
            if m:
                return m.group(1)
    return None


def _gpu_device(folder: Path) -> str | None:
    summary = folder / "summary.json"
    if summary.exists():
        device = _load(summary).get("device")
        if device:
            return str(device)
    for log in sorted(folder.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines()[:5]:
            m = _DEVICE.search(line)
            if m:
                return m.group(1).strip()
    return None


def gpu_section(results: Path, folder: Path) -> list[str]:
    rel = f"results/{folder.name}"
    device = _gpu_device(folder) or folder.name
    date = _gpu_date(folder)
    commit = _load(folder / "summary.json").get("commit") if (folder / "summary.json").exists() else None
    when = "".join(f", {x}" for x in (date, f"commit {str(commit)[:10]}" if commit else None) if x)
    lines = [f"### {device} (`{folder.name}`{when})", ""]
    rows = []
    # Offline throughput (pagoda bench throughput --save-result): pagoda's own row only.
    for file in sorted(folder.glob("throughput*.json")):
        data = _load(file)
        for r in data.get("results", []):
            if r.get("engine") == "pagoda":
                w = data.get("workload", {})
                rows.append(("offline `bench throughput`", f"{w.get('num_prompts')} prompts of "
                             f"{w.get('input_len')} / {w.get('output_len')} tokens",
                             f"[{_fmt(r['output_tokens_per_s'])}]({rel}/{file.name}) tok/s"))
    # bench latency in check.log: the decode step per batch.
    check = folder / "check.log"
    if check.exists():
        batch = None
        for line in check.read_text(errors="replace").splitlines():
            m = _BATCH.search(line)
            if m:
                batch = int(m.group(1))
            m = _LATENCY.search(line)
            if m and batch is not None:
                rows.append(("offline `bench latency`", f"batch {batch}",
                             f"[{m.group(1)} ms]({rel}/check.log) a decode step ({_fmt(float(m.group(2)))} tok/s)"))
                batch = None
    # bench serve tables in the serve logs.
    for log in sorted(folder.glob("serve*.log")):
        note = " (`OMP_NUM_THREADS=1`)" if "omp1" in log.name else ""
        for line in log.read_text(errors="replace").splitlines():
            m = _TABLE_ROW.match(line)
            if m:
                c, ok, total = m.group(1), m.group(4), m.group(5)
                rows.append((f"served{note}", f"{c} stream{'s' if c != '1' else ''} ({ok}/{total} ok)",
                             f"[{m.group(6)}]({rel}/{log.name}) tok/s, TTFT p50 {m.group(7)} ms, "
                             f"TPOT p50 {m.group(9)} ms"))
    # cuda_check's summary.json: served medians and decode steps.
    summary = folder / "summary.json"
    if summary.exists():
        data = _load(summary)
        for key, points in data.items():
            if key.startswith("serve") and isinstance(points, dict):
                extra = key.removeprefix("serve").strip()
                for point, figures in points.items():
                    if isinstance(figures, dict) and figures:
                        text = ", ".join(f"{k.removesuffix('_ms').upper()} p50 {v:.1f} ms" for k, v in figures.items())
                        n = point.removeprefix("c")
                        rows.append((f"served{f' (`{extra}`)' if extra else ''}",
                                     f"{n} stream{'' if n == '1' else 's'}", f"[{text}]({rel}/summary.json)"))
        for key, ms in (data.get("decode_step_ms") or {}).items():
            rows.append(("offline decode step", f"`{key}`", f"[{ms:.2f} ms]({rel}/summary.json)"))
    if not rows:
        return []
    lines += ["| how | what | figure |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return lines + [""]


def gpu_folders(results: Path) -> list[Path]:
    found = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        if (folder / "summary.json").exists() or (folder.name.startswith("gpu-") and (folder / "check.log").exists()):
            found.append(folder)
    return found


# ---- the page ------------------------------------------------------------------------------

def render(results: Path) -> str:
    out = [
        "# Performance",
        "",
        "<!-- Generated by docs/gen_performance.py from docs/results/ (make docs); do not edit by hand. -->",
        "",
        "pagoda's current figures, per machine kind: the latest run of each model in the",
        "[measurement log](benchmarks.md), read from its result files. Each figure links to the",
        "file it came from; each run to its folder's table. The log has every run, the commands,",
        "and what bounds each figure.",
        "",
        "How to read them:",
        "",
        "- **Served**: `pagoda serve` and llama.cpp's `llama-server` (`-t 2 -np C -cb`, its best",
        "  setting on these machines) in the same run, each restarted per point, driven by",
        "  `pagoda bench serve` (`benchmarks/compare.py`): random prompts, `ignore_eos`, greedy,",
        "  streamed `/v1/completions`. *N streams, tok/s* is the output tokens per second of N",
        "  concurrent requests (one stream: requests one after another, each one's TTFT included);",
        "  *(1.26x)* is pagoda against llama-server at the same point of the same run. RSS is the",
        "  server's at the highest concurrency.",
        "- **Shared machines**: the same engine moves by 10 % or more between runs minutes apart;",
        "  compare within one run (one *run* cell), not across rows of different runs.",
        "- The models are random weights of the real shapes with the bundled tokenizer (speed",
        "  does not depend on the values), except the bundled model itself.",
        "",
    ]
    by_machine = {m.key: m for m in CPU_MACHINES}
    summary: list[str] = []
    sections: list[str] = []
    for machine in CPU_MACHINES:
        sections += [f"## {machine.name}", "",
                     f"{machine.detail}. The machine: [measurement log](benchmarks.md#{machine.log_anchor}).", ""]
        main = [(model, folder) for m, model, folder, table in SERVED if m == machine.key and table == "main"]
        hfq = [(model, folder) for m, model, folder, table in SERVED if m == machine.key and table == "hfq"]
        ratios: list[tuple] = []
        if main:
            lines, ratios = served_table(results, main)
            sections += ["### Served, against llama.cpp", ""] + lines + [""]
        offline = [(model, folder) for m, model, folder in OFFLINE if m == machine.key]
        if offline:
            sections += ["### Offline, against OpenVINO GenAI", "",
                         "pagoda's `LLM` in a fresh process and OpenVINO GenAI at its defaults on the same",
                         "token ids; *(1.27x)* is against OpenVINO's best variant at that point.", ""]
            sections += offline_table(results, offline) + [""]
        if hfq:
            lines, _ = served_table(results, hfq)
            sections += ["### Pre-quantized checkpoints (one run)", "",
                         "GPTQ, AWQ and FP8 HF folders and llama.cpp's Q4_K_M and Q8_0 of the same shape,",
                         "each against llama-server where it reads the file.", ""] + lines + [""]
        summary += summary_rows(by_machine[machine.key], ratios)
    gpus = gpu_folders(results)
    if gpus:
        sections += ["## GPUs", "",
                     "The CUDA path's checks (`benchmarks/cuda_check.py`): a Llama-3.2-1B-shaped bfloat16",
                     "checkpoint, offline and served, with the code of the run's date. There is no peer",
                     "engine in these runs. What was checked, what is known slow, and what changed on the",
                     "GPU path since: [measurement log](benchmarks.md#on-a-gpu-h200-2026-12-04-the-cuda-path-checked).", ""]
        for folder in gpus:
            sections += gpu_section(results, folder)
    out += ["## At a glance", "",
            "pagoda's fastest mode against llama-server `-t 2`, served, in the same run:", "",
            "| machine | model | 1 stream | 16 streams |", "|---|---|---|---|"] + summary + [""]
    if gpus:
        out += ["GPU figures (no peer measured yet): [GPUs](#gpus).", ""]
    out += sections
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=DOCS / "results")
    p.add_argument("--out", type=Path, default=DOCS / "performance.md")
    p.add_argument("--check", action="store_true", help="exit 1 if --out is not up to date")
    args = p.parse_args()
    try:
        text = render(args.results)
    except ResultsError as e:
        print(f"gen_performance: {e}", file=sys.stderr)
        return 1
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"gen_performance: {args.out} is stale; run python docs/gen_performance.py", file=sys.stderr)
            return 1
        return 0
    if args.out.exists() and args.out.read_text() == text:
        print(f"{args.out}: up to date", file=sys.stderr)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
