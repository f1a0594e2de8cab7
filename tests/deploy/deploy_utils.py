"""Helpers of the deploy/ tests: the files' paths, promtool, the metric names pagoda
really exports, the metric names a PromQL expression reads, and `pagoda serve`'s flags
as PAGODA_<FLAG> environment variables."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
GRAFANA_DIR = DEPLOY / "grafana"
K8S_DIR = DEPLOY / "k8s"
COMPOSE_FILE = DEPLOY / "compose.yaml"
DASHBOARD_FILE = GRAFANA_DIR / "pagoda-dashboard.json"

MISSING_PROMETHEUS = "Debian's prometheus package is not installed (`make prometheus` installs it as root)"


def binary(name: str) -> str:
    """The path of prometheus / promtool, or skip the test saying why."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"no {name}: {MISSING_PROMETHEUS}")
    return path


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary("promtool"), *map(str, args)], check=False, capture_output=True, text=True,
                          timeout=60)


def load_yaml_docs(path: Path) -> list[Any]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


# ---------------------------------------------------------------- exported metric names
def exported_metric_names() -> set[str]:
    """Every sample name pagoda's /metrics can carry, read from a real registry
    (pagoda/metrics/prometheus.py over a real EngineMetrics) and its families' types:
    a counter family X has samples X_total, a histogram X_bucket / X_sum / X_count.
    Families with no series yet (per-tenant, per-priority) count too: their types are
    exported from the start."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagoda.config import EngineConfig
    from pagoda.core.outputs import SchedulerStats
    from pagoda.metrics.prometheus import make_registry, render
    from pagoda.metrics.stats import EngineMetrics

    class Source:  # a MetricsSource with a recorder, one engine
        def __init__(self) -> None:
            self.config = EngineConfig()
            self.metrics = EngineMetrics(max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=2048)
            self.replicas = ()
            self.lora_token_counts: dict[str, list[int]] = {}

        def latest_stats(self) -> SchedulerStats:
            return SchedulerStats()

    text = render(make_registry(Source(), "m")).decode()
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ("",))
        names.update(family.name + s for s in suffixes)
        names.update(s.name for s in family.samples)
    return names


def recorded_names(rules_file: Path) -> set[str]:
    return {rule["record"] for group in load_yaml_docs(rules_file)[0]["groups"] for rule in group["rules"]
            if "record" in rule}


# ---------------------------------------------------------------- PromQL metric names
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPINGS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w.:])[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan", "Inf", "NaN"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (promtool checks the syntax; this only reads
    names): drop strings, label matchers, ranges and grouping clauses; an identifier left
    that is not a keyword and not called like a function is a metric.
    E.g. 'sum by (le) (rate(a_bucket{x="y"}[5m])) / b' -> {'a_bucket', 'b'}."""
    text = _STRINGS.sub('""', expr)
    for pattern in (_MATCHERS, _RANGES, _GROUPINGS):
        text = pattern.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        rest = text[m.end():].lstrip()
        if m.group() not in _KEYWORDS and not rest.startswith("("):
            names.add(m.group())
    return names


# ---------------------------------------------------------------- PAGODA_* variables
def serve_flags() -> dict[str, argparse.Action]:
    """`pagoda serve`'s options by environment variable name (PAGODA_ + dest, upper case)."""
    from pagoda.entrypoints.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    return {f"PAGODA_{a.dest.upper()}": a for a in serve._actions
            if a.dest and a.dest != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)}


_OTHER_PAGODA_VARIABLES = ("PAGODA_LOG_LEVEL",)  # read by the engine processes, not flags


def env_problems(env: dict[str, str]) -> list[str]:
    """What is wrong with a deployment's PAGODA_* variables: a name that is no `pagoda serve`
    flag, or a value the flag's own type or choices refuse (empty means unset)."""
    flags = serve_flags()
    problems = []
    for name, value in env.items():
        if not name.startswith("PAGODA_") or name in _OTHER_PAGODA_VARIABLES:
            continue
        action = flags.get(name)
        if action is None:
            problems.append(f"{name} names no `pagoda serve` flag")
            continue
        if value == "" or action.nargs == 0:
            continue
        try:
            parsed = action.type(value) if callable(action.type) else value
        except (argparse.ArgumentTypeError, ValueError) as e:
            problems.append(f"{name}={value!r}: {e}")
            continue
        if action.choices is not None and parsed not in action.choices:
            problems.append(f"{name}={value!r} is not one of {list(action.choices)}")
    return problems


def serve_value(name: str, value: str) -> Any:
    """A PAGODA_<FLAG> value as the flag parses it (e.g. '512MiB' -> bytes)."""
    action = serve_flags()[name]
    return action.type(value) if callable(action.type) else value
