"""The arithmetic of `pagoda bench serve`: per-request timelines in, summary metrics out.

Pure Python on purpose (no numpy, no torch), so it is cheap to import and easy to test
on synthetic timelines.

Definitions (the ones the field uses, e.g. vLLM's serving benchmark):
- TTFT: request sent -> first chunk carrying generated text.
- ITL: gaps between consecutive text-carrying chunks of one stream. A server that packs
  several tokens into one chunk shows fewer, longer gaps; TPOT does not have that bias.
- TPOT: (E2E - TTFT) / (output_tokens - 1), the mean time per token after the first.
  Undefined for one-token outputs (those requests are left out of TPOT, not counted as 0).
- E2E: request sent -> stream closed.
- Goodput: completed requests per second that met every given SLO.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

DEFAULT_PERCENTILES: tuple[float, ...] = (90.0, 99.0)   # the median is always reported

# `--goodput` keys -> the per-request value (in seconds) each bounds.
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds on the client's perf_counter clock."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0               # the server's usage.prompt_tokens, else the client's count
    output_tokens: int = 0            # the server's usage.completion_tokens, else the client's count
    output_tokens_source: str = ""    # "usage" | "tokenizer" | "chunks"
    start_time: float = 0.0           # when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # arrival of each text-carrying chunk
    end_time: float = 0.0             # when the stream closed
    generated_text: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start_time if self.chunk_times else None

    @property
    def e2el(self) -> float:
        return self.end_time - self.start_time

    @property
    def itl(self) -> list[float]:
        return itl_from_chunk_times(self.chunk_times)

    @property
    def tpot(self) -> float | None:
        return tpot(self.e2el, self.ttft, self.output_tokens)

    def to_json(self, keep_text: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not keep_text:
            d.pop("generated_text")
        d.update(ttft=self.ttft, e2el=self.e2el, tpot=self.tpot)
        return d


def itl_from_chunk_times(chunk_times: Sequence[float]) -> list[float]:
    """Gaps between consecutive chunk arrivals: [t1 - t0, t2 - t1, ...]."""
    return [b - a for a, b in zip(chunk_times, chunk_times[1:])]


def tpot(e2el: float, ttft: float | None, output_tokens: int) -> float | None:
    """Mean time per output token after the first; None when it is undefined."""
    if ttft is None or output_tokens < 2:
        return None
    return (e2el - ttft) / (output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks,
    the same as numpy.percentile's default; NaN for no values."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES,
              scale: float = 1000.0) -> dict[str, float]:
    """mean, median, std and the given percentiles, multiplied by ``scale`` (s -> ms by default)."""
    if not values:
        out = {"mean": math.nan, "median": math.nan, "std": math.nan}
        out.update({f"p{_pname(q)}": math.nan for q in percentiles if q != 50.0})
        return out
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    out = {"mean": mean * scale, "median": percentile(values, 50.0) * scale, "std": math.sqrt(var) * scale}
    for q in percentiles:
        if q == 50.0:
            continue   # that is the median
        out[f"p{_pname(q)}"] = percentile(values, q) * scale
    return out


def _pname(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q)


def parse_goodput(specs: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (milliseconds in, seconds out)."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        key, sep, value = spec.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad --goodput entry {spec!r}: expected KEY:MS with KEY in {', '.join(SLO_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad --goodput entry {spec!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"bad --goodput entry {spec!r}: the SLO must be positive")
        slos[key] = ms / 1000.0
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """A request is good when it succeeded and every SLO it is measured against holds.
    A request with no TPOT (one output token) passes a TPOT SLO: it had no second token to be late."""
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
    for key, bound in slos.items():
        v = values[key]
        if key == "ttft" and v is None:
            return False
        if v is not None and v > bound:
            return False
    return True


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    slos: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The summary of one benchmark run of ``duration_s`` seconds (first send to last close)."""
    if duration_s <= 0:
        raise ValueError("duration must be positive")
    ok = [r for r in results if r.success]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            key = (r.error or "unknown error").splitlines()[0][:200]
            errors[key] = errors.get(key, 0) + 1
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    itls = [gap for r in ok for gap in r.itl]
    e2els = [r.e2el for r in ok]
    metrics: dict[str, Any] = {
        "duration_s": duration_s,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration_s,
        "input_throughput": n_in / duration_s,
        "output_throughput": n_out / duration_s,
        "total_token_throughput": (n_in + n_out) / duration_s,
        "ttft_ms": summarize(ttfts, percentiles),
        "tpot_ms": summarize(tpots, percentiles),
        "itl_ms": summarize(itls, percentiles),
        "e2el_ms": summarize(e2els, percentiles),
        "output_tokens_source": sorted({r.output_tokens_source for r in ok}),
    }
    if slos:
        good = sum(1 for r in results if meets_slos(r, slos))
        metrics["goodput"] = {
            "slos_ms": {k: v * 1000.0 for k, v in slos.items()},
            "good_requests": good,
            "request_goodput": good / duration_s,
        }
    return metrics
