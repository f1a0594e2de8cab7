"""deploy/grafana: every PromQL expression of the dashboard parses (promtool, over a rules
file that records each one), reads only metrics pagoda exports, the dashboard shows what
an operator needs, and the provisioning files fit deploy/compose.yaml."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.deploy_utils import (
    COMPOSE_FILE,
    DASHBOARD_FILE,
    GRAFANA_DIR,
    exported_metric_names,
    load_yaml_docs,
    promql_metric_names,
    promtool,
)

# Grafana's variables, replaced by what they stand for before promtool sees an expression.
_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h", "$model_name": ".*",
              "$instance": ".*"}
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_FILE.read_text())


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows hold their panels


def _expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) for every query target, variables substituted."""
    out = []
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in _VARIABLES.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"{panel['title']}: unknown variable in {expr}"
            out.append((panel["title"], expr))
    return out


def _check_parses(exprs: list[str], tmp_path: Path) -> tuple[bool, str]:
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:expr_{i}", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", path)
    return result.returncode == 0, result.stdout + result.stderr


def test_every_expression_parses(tmp_path):
    exprs = [e for _, e in _expressions(_dashboard())]
    assert len(exprs) >= 20
    ok, out = _check_parses(exprs, tmp_path)
    assert ok, out
    assert f"SUCCESS: {len(exprs)} rules found" in out
    # The check does catch a broken expression.
    ok, out = _check_parses([*exprs, "sum(rate(pagoda:prompt_tokens_total[5m])"], tmp_path)
    assert not ok and "parse error" in out


def test_every_metric_is_one_pagoda_exports():
    dashboard = _dashboard()
    known = exported_metric_names() | {"up"}
    for title, expr in _expressions(dashboard):
        names = promql_metric_names(expr)
        assert names and names <= known, f"{title}: {expr} reads {names - known}"
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = _LABEL_VALUES.match(var["query"]["query"].replace("$model_name", ".*"))
        assert m, var
        assert promql_metric_names(m["selector"]) <= known, var


@pytest.mark.parametrize(("view", "metrics"), [
    ("TTFT", {"pagoda:time_to_first_token_seconds_bucket"}),
    ("TPOT", {"pagoda:request_time_per_output_token_seconds_bucket"}),
    ("ITL", {"pagoda:inter_token_latency_seconds_bucket"}),
    ("tokens/s", {"pagoda:prompt_tokens_total", "pagoda:generation_tokens_total"}),
    ("running and waiting", {"pagoda:num_requests_running", "pagoda:num_requests_waiting"}),
    ("KV usage", {"pagoda:kv_cache_usage_perc"}),
    ("prefix-cache hit rate", {"pagoda:prefix_cache_hits_total", "pagoda:prefix_cache_queries_total"}),
    ("preemptions", {"pagoda:num_preemptions_total"}),
    ("batch size", {"pagoda:iteration_batch_size_sum", "pagoda:iteration_batch_size_count"}),
    ("FLOP/s", {"pagoda:estimated_flops_total", "pagoda:engine_step_seconds_total"}),
    ("bytes/s", {"pagoda:estimated_bytes_total", "pagoda:engine_step_seconds_total"}),
])
def test_dashboard_shows(view, metrics):
    """Each view reads its metrics together in one panel (a ratio's halves side by side)."""
    panels = {}
    for title, expr in _expressions(_dashboard()):
        panels.setdefault(title, set()).update(promql_metric_names(expr))
    assert any(metrics <= names for names in panels.values()), f"no panel shows {view}"


def test_percentile_panels_show_p50_and_p99():
    for title in ("Time to first token", "Time per output token", "Inter-token latency"):
        exprs = [e for t, e in _expressions(_dashboard()) if t == title]
        assert any(e.startswith("histogram_quantile(0.5,") for e in exprs), title
        assert any(e.startswith("histogram_quantile(0.99,") for e in exprs), title


def test_panels_have_unique_ids_and_use_the_datasource_variable():
    dashboard = _dashboard()
    panels = list(_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]


def test_provisioning_fits_compose():
    """The datasource points at compose's prometheus service; the dashboard provider reads
    the folder where compose mounts the dashboard; compose mounts the provisioning folder."""
    compose = load_yaml_docs(COMPOSE_FILE)[0]
    services = compose["services"]
    datasource = load_yaml_docs(GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml")[0]["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", datasource["url"]).groups()
    assert host in services and "prometheus" in services[host]["image"]
    assert port == "9090"

    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in services["grafana"]["volumes"] if v.startswith("./"))
    provider = load_yaml_docs(GRAFANA_DIR / "provisioning" / "dashboards" / "pagoda.yml")[0]["providers"][0]
    dashboard_target = mounts["./grafana/pagoda-dashboard.json"]
    assert Path(dashboard_target).parent == Path(provider["options"]["path"])
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    for source in mounts:
        assert (COMPOSE_FILE.parent / source).exists(), source
