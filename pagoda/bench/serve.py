"""`pagoda bench serve`: load-test any OpenAI-compatible server, streamed, one point or a sweep.

    pagoda bench serve --base-url http://127.0.0.1:8000 --dataset random \
        --input-len 128 --output-len 128 --ignore-eos \
        --max-concurrency 1,4,16,64 --num-prompts 8,16,32,64 \
        --save-result out/pagoda.json --plot-dir out/

Each sweep point gets fresh prompts (a later point must not hit the prefix cache that an
earlier one filled) and its own warm-up requests from the same workload, which are
discarded.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
import json
import math
import os
import platform
import sys
from typing import Any, Callable

import httpx
from tqdm import tqdm

from pagoda.bench import datasets as ds
from pagoda.bench.client import RequestSpec, make_client, run_load
from pagoda.bench.metrics import RequestResult, compute_metrics, parse_goodput


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]   # float("inf") works
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    g.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    g.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key (or OPENAI_API_KEY)")
    g.add_argument("--tokenizer", default=None,
                   help="HF folder or .gguf whose tokenizer builds prompts and counts tokens "
                        "(default: --model where it names a local folder or file, as vLLM's "
                        "benchmark takes it; else the bundled SmolLM2)")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default="random", choices=ds.DATASETS)
    g.add_argument("--dataset-path", default=None, help="the JSONL file for --dataset jsonl")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (prefix: the unique suffix's)")
    g.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [len*(1-r), len*(1+r)]")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared prefix tokens (prefix dataset)")
    g.add_argument("--num-turns", type=int, default=3, help="user turns per conversation (multiturn)")
    g.add_argument("--image-size", type=_image_size, default=(384, 384), metavar="WxH",
                   help="random-mm: each image's width x height in pixels")
    g.add_argument("--images-per-request", type=int, default=1, help="random-mm: images before each prompt's text")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so every reply is output-len long")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=_int_list, default=[64],
                   help="requests per point (conversations for multiturn); a list pairs with the sweep")
    g.add_argument("--max-concurrency", type=_int_list, default=None,
                   help="requests in flight at most; a comma list (1,4,16,64) sweeps")
    g.add_argument("--request-rate", type=_float_list, default=[math.inf],
                   help="arrivals per second (inf: all at once); a comma list sweeps")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times: 1 = Poisson, <1 burstier")
    g.add_argument("--num-warmups", type=int, default=1, help="discarded requests before each point")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    g = p.add_argument_group("results")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:1000 tpot:100 (keys: ttft, tpot, e2el)")
    g.add_argument("--percentiles", type=_float_list, default=[90.0, 99.0],
                   help="percentiles to report besides mean and median")
    g.add_argument("--label", default=None, help="name of this run in results and plots (default: the model)")
    g.add_argument("--save-result", default=None, help="write the results as JSON here")
    g.add_argument("--plot-dir", default=None, help="write PNG plots here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _points(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The sweep: one point per concurrency or per request rate (not both)."""
    conc: list[int | None] = list(args.max_concurrency) if args.max_concurrency else [None]
    rates = list(args.request_rate)
    if len(conc) > 1 and len(rates) > 1:
        raise ValueError("sweep either --max-concurrency or --request-rate, not both")
    n = max(len(conc), len(rates))
    if len(args.num_prompts) not in (1, n):
        raise ValueError(f"--num-prompts has {len(args.num_prompts)} values for {n} sweep points")
    pick = lambda xs, i: xs[i] if len(xs) > 1 else xs[0]   # noqa: E731
    return [{"max_concurrency": pick(conc, i), "request_rate": pick(rates, i),
             "num_prompts": pick(args.num_prompts, i)} for i in range(n)]


def _image_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 384x384, got {text!r}") from None
    if w < 1 or h < 1:
        raise argparse.ArgumentTypeError(f"an image of {w}x{h} pixels has none")
    return w, h


def _make_dataset(args: argparse.Namespace, sampler: ds.TextSampler | None, tokenizer: Any,
                  num: int) -> list[ds.Conversation]:
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path")
        return ds.jsonl_dataset(args.dataset_path, num, args.output_len, tokenizer)
    assert sampler is not None
    if args.dataset == "random":
        return ds.random_dataset(sampler, num, args.input_len, args.output_len, args.range_ratio)
    if args.dataset == "random-mm":
        if args.endpoint != "/v1/chat/completions":
            raise ValueError("--dataset random-mm needs --endpoint /v1/chat/completions (images go in messages)")
        return ds.random_mm_dataset(sampler, num, args.input_len, args.output_len, args.image_size,
                                    args.images_per_request, args.range_ratio)
    if args.dataset == "prefix":
        return ds.prefix_dataset(sampler, num, args.prefix_len, args.input_len, args.output_len, args.range_ratio)
    return ds.multiturn_dataset(sampler, num, args.num_turns, args.input_len, args.output_len, args.range_ratio)


async def _get_json(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> Any:
    try:
        resp = await client.get(url, headers=headers, timeout=10)
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _stats_delta(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """pagoda's /v1/engine/stats over one point: prefix-cache hits and preemptions."""
    if not before or not after:
        return None
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("prefix_cache_queries", "prefix_cache_hits",
                                                          "num_preemptions", "num_steps")}
    queries = d["prefix_cache_queries"]
    d["prefix_cache_hit_rate"] = d["prefix_cache_hits"] / queries if queries else 0.0
    return d


async def run_points(args: argparse.Namespace, tokenizer: Any,
                     log: Callable[[str], None] = print) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    slos = parse_goodput(args.goodput)
    points = _points(args)
    sampler = ds.TextSampler(tokenizer, args.seed) if args.dataset != "jsonl" else None
    count_tokens = (lambda text: len(tokenizer.encode(text, add_special_tokens=False))) if tokenizer else None
    biggest = max((p["max_concurrency"] or p["num_prompts"]) for p in points)
    base = args.base_url.rstrip("/")
    async with make_client(max(biggest, 1) + 4, args.request_timeout) as client:
        model = args.model
        if model is None:
            listed = await _get_json(client, f"{base}/v1/models", headers)
            if not listed or not listed.get("data"):
                raise ValueError(f"could not list models at {base}/v1/models; pass --model")
            model = listed["data"][0]["id"]
        spec = RequestSpec(api_url=base + args.endpoint, model=model, chat=args.endpoint.endswith("chat/completions"),
                           temperature=args.temperature, ignore_eos=args.ignore_eos,
                           extra_body=args.extra_body, headers=headers)
        out_points = []
        for i, point in enumerate(points):
            conc, rate, num = point["max_concurrency"], point["request_rate"], point["num_prompts"]
            # Warm-ups come from the same draw as the point: with the prefix dataset they
            # share its prefix, so the point measures a warm prefix cache.
            convs = _make_dataset(args, sampler, tokenizer, num + args.num_warmups)
            if len(convs) < num + args.num_warmups:   # a short JSONL file: warm up on its first lines
                warm, convs = copy.deepcopy(convs[:args.num_warmups]), convs[:num]
            else:
                warm, convs = convs[:args.num_warmups], convs[args.num_warmups:]
            if warm:
                for conv in warm:   # the warm-up pays first-call costs; its length barely matters
                    for t in conv.turns:
                        t.output_len = min(t.output_len, 16)
                wres, _ = await run_load(client, spec, warm, conc, count_tokens=count_tokens)
                failed = [r.error for r in wres if not r.success]
                if failed:
                    raise RuntimeError(f"warm-up request failed: {failed[0]}")
            total = sum(len(c.turns) for c in convs)
            before = await _get_json(client, f"{base}/v1/engine/stats", headers)
            load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
            bar = tqdm(total=total, desc=f"c={conc or 'inf'} rate={rate:g}", unit="req",
                       disable=args.no_progress, leave=False, file=sys.stderr)
            try:
                results, duration = await run_load(
                    client, spec, convs, conc, rate, args.burstiness, args.seed + i,
                    count_tokens=count_tokens, on_done=lambda r: bar.update(1))
            finally:
                bar.close()
            after = await _get_json(client, f"{base}/v1/engine/stats", headers)
            metrics = compute_metrics(results, duration, slos, args.percentiles)
            rec = {**point, "request_rate": None if math.isinf(rate) else rate, "metrics": metrics,
                   "server_stats": _stats_delta(before, after),
                   # On a shared machine, the load around a point says how far to trust it.
                   "client_loadavg": {"before": load_before,
                                      "after": os.getloadavg() if hasattr(os, "getloadavg") else None},
                   "requests": [_request_record(r) for r in results]}
            out_points.append(rec)
            log(format_point(rec, args.label or model))
    return {
        "benchmark": "serve",
        "label": args.label or model,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": [os.path.basename(sys.argv[0])] + sys.argv[1:] if sys.argv else [],
        "base_url": base, "endpoint": args.endpoint, "model": model,
        "workload": {"dataset": args.dataset, "input_len": args.input_len, "output_len": args.output_len,
                     "range_ratio": args.range_ratio,
                     "prefix_len": args.prefix_len if args.dataset == "prefix" else None,
                     "num_turns": args.num_turns if args.dataset == "multiturn" else None,
                     "image_size": list(args.image_size) if args.dataset == "random-mm" else None,
                     "images_per_request": args.images_per_request if args.dataset == "random-mm" else None,
                     "dataset_path": args.dataset_path, "ignore_eos": args.ignore_eos,
                     "temperature": args.temperature, "burstiness": args.burstiness,
                     "num_warmups": args.num_warmups, "seed": args.seed},
        "client": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "points": out_points,
    }


def _request_record(r: RequestResult) -> dict[str, Any]:
    """Per request, enough to redraw every plot: milliseconds, rounded."""
    ms = lambda v: None if v is None else round(v * 1000.0, 3)   # noqa: E731
    return {"success": r.success, "error": r.error or None, "prompt_len": r.prompt_len,
            "output_tokens": r.output_tokens, "ttft_ms": ms(r.ttft), "tpot_ms": ms(r.tpot),
            "e2el_ms": ms(r.e2el), "itl_ms": [round(g * 1000.0, 3) for g in r.itl]}


def format_point(rec: dict[str, Any], label: str) -> str:
    m = rec["metrics"]
    rate = "inf" if rec["request_rate"] is None else f"{rec['request_rate']:g}/s"
    lines = [f"==== {label}: max_concurrency={rec['max_concurrency']} request_rate={rate} "
             f"prompts={rec['num_prompts']} ====",
             f"  completed {m['completed']}/{m['num_requests']} in {m['duration_s']:.2f} s"
             + (f"; errors: {m['errors']}" if m["errors"] else ""),
             f"  tokens in/out           {m['total_input_tokens']} / {m['total_output_tokens']}",
             f"  request throughput      {m['request_throughput']:.3f} req/s",
             f"  output throughput       {m['output_throughput']:.2f} tok/s",
             f"  total token throughput  {m['total_token_throughput']:.2f} tok/s"]
    if "goodput" in m:
        g = m["goodput"]
        lines.append(f"  goodput                 {g['request_goodput']:.3f} req/s "
                     f"({g['good_requests']} good; SLOs ms {g['slos_ms']})")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E")):
        s = m[key]
        rest = "  ".join(f"{k} {v:9.1f}" for k, v in s.items() if k != "std")
        lines.append(f"  {name:<5} ms  {rest}")
    st = rec.get("server_stats")
    if st:
        lines.append(f"  server: prefix-cache hit rate {st['prefix_cache_hit_rate']:.1%}, "
                     f"preemptions {st['num_preemptions']}, steps {st['num_steps']}")
    return "\n".join(lines)


def format_sweep(report: dict[str, Any]) -> str:
    rows = ["| concurrency | rate | prompts | ok | out tok/s | req/s | TTFT p50 / p99 ms | TPOT p50 ms | ITL p50 ms |",
            "|---|---|---|---|---|---|---|---|---|"]
    for p in report["points"]:
        m = p["metrics"]
        rows.append(f"| {p['max_concurrency'] or '-'} | {p['request_rate'] or 'inf'} | {p['num_prompts']} | "
                    f"{m['completed']}/{m['num_requests']} | {m['output_throughput']:.1f} | "
                    f"{m['request_throughput']:.3f} | {m['ttft_ms']['median']:.0f} / {m['ttft_ms']['p99']:.0f} | "
                    f"{m['tpot_ms']['median']:.1f} | {m['itl_ms']['median']:.1f} |")
    return "\n".join(rows)


def load_client_tokenizer(path: str | None) -> Any:
    from pagoda.config import EngineConfig
    from pagoda.tokenizer import load_tokenizer

    return load_tokenizer(EngineConfig(model=path))


def tokenizer_source(args: argparse.Namespace) -> str | None:
    """--tokenizer, else --model where it is a local path (the served model's own files),
    else None: the bundled model's."""
    if args.tokenizer is not None:
        return args.tokenizer
    if args.model is not None and os.path.exists(args.model):
        return args.model
    return None


def run_serve(args: argparse.Namespace) -> int:
    tokenizer = load_client_tokenizer(tokenizer_source(args))
    report = asyncio.run(run_points(args, tokenizer))
    print(format_sweep(report))
    if args.save_result:
        os.makedirs(os.path.dirname(os.path.abspath(args.save_result)), exist_ok=True)
        with open(args.save_result, "w") as f:
            json.dump(report, f, indent=1)
        print(f"results: {args.save_result}")
    if args.plot_dir:
        from pagoda.bench.plots import plot_serve_report

        for path in plot_serve_report(report, args.plot_dir):
            print(f"plot: {path}")
    failed = sum(p["metrics"]["failed"] for p in report["points"])
    return 1 if failed else 0
