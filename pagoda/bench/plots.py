"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed).

Every function takes the JSON structures the benchmarks save, so a plot can be redrawn
from a results file later.
"""

from __future__ import annotations

import os
import re
from typing import Any, Sequence


def _plt():
    try:
        import matplotlib
    except ImportError as e:   # matplotlib is in the dev extra, not a runtime dependency
        raise RuntimeError("plots need matplotlib: pip install matplotlib (or the project's dev extra)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "run"


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return
    ys = [0.0] + [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step([xs[0]] + xs, ys, where="post", label=label)


def _point_name(p: dict[str, Any]) -> str:
    if p.get("request_rate") is not None:
        return f"{p['request_rate']:g} req/s"
    return f"c={p['max_concurrency']}" if p.get("max_concurrency") else "all at once"


def plot_latency_cdfs(report: dict[str, Any], path: str) -> str:
    """TTFT, TPOT, ITL and E2E CDFs, one line per sweep point."""
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"),
              ("e2el_ms", "E2E latency (ms)"))
    for ax, (key, title) in zip(axes.flat, panels):
        for p in report["points"]:
            ok = [r for r in p["requests"] if r["success"]]
            values = [g for r in ok for g in r[key]] if key == "itl_ms" else [r[key] for r in ok]
            _cdf(ax, values, _point_name(p))
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests" if key != "itl_ms" else "fraction of chunk gaps")
        ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['label']}: latency CDFs ({report['workload']['dataset']}, "
                 f"in {report['workload']['input_len']} / out {report['workload']['output_len']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _sweep_x(report: dict[str, Any]) -> tuple[list[float], str]:
    pts = report["points"]
    if any(p.get("request_rate") is not None for p in pts) and len({p.get("request_rate") for p in pts}) > 1:
        return [p["request_rate"] for p in pts], "request rate (req/s)"
    return [p["max_concurrency"] or p["num_prompts"] for p in pts], "max concurrency"


def plot_sweep(reports: Sequence[dict[str, Any]], path: str, title: str | None = None,
               offline: Sequence[dict[str, Any]] = ()) -> str:
    """Output tokens/s, TTFT (p50 and p99) and TPOT p50 against concurrency (or rate),
    one line per report: one engine, or pagoda alone. ``offline``: results with only a
    throughput per concurrency (HF static batches), drawn dashed on the throughput panel."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for rep in reports:
        xs, xlabel = _sweep_x(rep)
        ms = [p["metrics"] for p in rep["points"]]
        axes[0].plot(xs, [m["output_throughput"] for m in ms], "o-", label=rep["label"])
        line = axes[1].plot(xs, [m["ttft_ms"]["median"] / 1000 for m in ms], "o-", label=f"{rep['label']} p50")
        axes[1].plot(xs, [m["ttft_ms"]["p99"] / 1000 for m in ms], "x--", color=line[0].get_color(),
                     label=f"{rep['label']} p99")
        axes[2].plot(xs, [m["tpot_ms"]["median"] for m in ms], "o-", label=rep["label"])
    for rep in offline:
        xs = [p["max_concurrency"] for p in rep["points"]]
        axes[0].plot(xs, [p["metrics"]["output_throughput"] for p in rep["points"]], "s--",
                     label=f"{rep['label']} (offline, static batch = c)")
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ticks = sorted({x for rep in reports for x in _sweep_x(rep)[0]})
    for ax, ylabel in zip(axes, ("output tokens/s", "TTFT (s)", "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        # Ticks at the measured points, written 1, 4, 16, 64 rather than 2^k.
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    fig.suptitle(title or "throughput and latency against load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_serve_report(report: dict[str, Any], out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    name = _slug(report["label"])
    paths = [plot_latency_cdfs(report, os.path.join(out_dir, f"{name}_latency_cdf.png"))]
    if len(report["points"]) > 1:
        paths.append(plot_sweep([report], os.path.join(out_dir, f"{name}_sweep.png"),
                                f"{report['label']}: throughput and latency against load"))
    return paths


def plot_roofline(report: dict[str, Any], path: str) -> str:
    """The roofline: attainable FLOP/s = min(peak, intensity x bandwidth), log-log, with each
    measured step as a point (prefill and decode in different markers)."""
    plt = _plt()
    peak = report["machine"]["peak_flops"]
    bw = report["machine"]["bandwidth_bytes_per_s"]
    steps = report["steps"]
    intensities = [s["intensity"] for s in steps] or [1.0]
    lo = min(min(intensities) / 4, 0.1)
    hi = max(max(intensities) * 4, peak / bw * 8)
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(9, 6))
    ax.plot(xs, [min(peak, x * bw) / 1e9 for x in xs], "k-", lw=2,
            label=f"roof: {peak / 1e9:.0f} GFLOP/s, {bw / 1e9:.1f} GB/s")
    ax.axvline(peak / bw, color="gray", ls=":", lw=1)
    ax.annotate(f"ridge {peak / bw:.1f} FLOP/B", (peak / bw, peak / 1e9 / 30), rotation=90, fontsize=8,
                color="gray", ha="right")
    for kind, marker in (("prefill", "s"), ("decode", "o")):
        sel = [s for s in steps if s["kind"] == kind]
        if not sel:
            continue
        ax.scatter([s["intensity"] for s in sel], [s["achieved_flops"] / 1e9 for s in sel], marker=marker,
                   s=40, label=kind, zorder=3)
        for s in sel:
            ax.annotate(s["name"], (s["intensity"], s["achieved_flops"] / 1e9), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte moved, ideal)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(report.get("title", "roofline"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
