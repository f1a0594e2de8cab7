"""deploy/prometheus: the configs and rules pass promtool, the rules' unit tests pass and
cover every alert, and every metric the rules read is one pagoda exports."""

from __future__ import annotations

import pytest

from tests.deploy.deploy_utils import (
    COMPOSE_FILE,
    K8S_DIR,
    PROMETHEUS_DIR,
    exported_metric_names,
    load_yaml_docs,
    promql_metric_names,
    promtool,
    recorded_names,
)

RULES = PROMETHEUS_DIR / "rules.yml"
RULES_TEST = PROMETHEUS_DIR / "rules_test.yml"
CONFIGS = ("prometheus.yml", "prometheus-k8s.yml")


def _rules() -> list[dict]:
    return [rule for group in load_yaml_docs(RULES)[0]["groups"] for rule in group["rules"]]


@pytest.mark.parametrize("name", CONFIGS)
def test_config_passes_promtool(name):
    result = promtool("check", "config", PROMETHEUS_DIR / name)
    assert result.returncode == 0, result.stdout + result.stderr
    # promtool also checks the rule files a config names; a warning (e.g. a missing
    # file_sd file) would be a broken path in the shipped config.
    assert "WARNING" not in result.stdout + result.stderr, result.stdout + result.stderr


def test_rules_pass_promtool():
    result = promtool("check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


def test_rules_unit_tests_pass_and_cover_every_alert():
    result = promtool("test", "rules", RULES_TEST)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {t["alertname"] for case in load_yaml_docs(RULES_TEST)[0]["tests"]
              for t in case.get("alert_rule_test", ()) if t["exp_alerts"]}
    alerts = {rule["alert"] for rule in _rules() if "alert" in rule}
    assert alerts == tested, f"alerts without a firing test: {alerts - tested}"
    required = {"PagodaDown", "PagodaTTFTHighP99", "PagodaQueueGrowing", "PagodaKVCacheNearlyFull",
                "PagodaPreemptionRateHigh"}
    assert required <= alerts


def test_rules_read_only_metrics_pagoda_exports():
    known = exported_metric_names() | recorded_names(RULES) | {"up"}
    for rule in _rules():
        names = promql_metric_names(rule["expr"])
        assert names, rule
        assert names <= known, f"{rule.get('record') or rule.get('alert')}: unknown {names - known}"


def test_recording_rules_cover_latency_and_throughput():
    records = {r["record"]: r["expr"] for r in _rules() if "record" in r}
    for q in ("p50", "p99"):
        assert "time_to_first_token_seconds_bucket" in records[f"pagoda:ttft_seconds:{q}_5m"]
        assert "request_time_per_output_token_seconds_bucket" in records[f"pagoda:tpot_seconds:{q}_5m"]
    assert "generation_tokens_total" in records["pagoda:generation_tokens:rate1m"]
    assert "prompt_tokens_total" in records["pagoda:prompt_tokens:rate1m"]


def test_metric_name_reader():
    """The reader the metric checks rely on: it finds every selected name and nothing else."""
    expr = ('histogram_quantile(0.99, sum by (le) (rate(pagoda:a_bucket{m=~"x|y", le!="1"}[5m]))) > 1e3 '
            'and on (instance) up offset 5m unless pagoda:typo_metric / ignoring(engine) b')
    assert promql_metric_names(expr) == {"pagoda:a_bucket", "up", "pagoda:typo_metric", "b"}
    assert not {"pagoda:typo_metric"} <= exported_metric_names()


def test_scrape_targets_are_the_deployed_services():
    """prometheus.yml scrapes the compose service by its name and port; prometheus-k8s.yml
    the headless Service of deploy/k8s by its DNS name."""
    compose = load_yaml_docs(COMPOSE_FILE)[0]
    config = load_yaml_docs(PROMETHEUS_DIR / "prometheus.yml")[0]
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "pagoda")
    host, port = job["static_configs"][0]["targets"][0].split(":")
    assert host in compose["services"] and compose["services"][host]["image"].startswith("pagoda:")
    assert f"{port}:{port}" in compose["services"][host]["ports"]
    assert compose["services"][host]["environment"]["PAGODA_PORT"] == port

    k8s = load_yaml_docs(PROMETHEUS_DIR / "prometheus-k8s.yml")[0]
    dns = k8s["scrape_configs"][0]["dns_sd_configs"][0]
    services = {(d["metadata"]["name"], d["metadata"]["namespace"]): d for d in load_yaml_docs(K8S_DIR / "service.yaml")
                if d["kind"] == "Service"}
    name, namespace = dns["names"][0].split(".")[:2]
    headless = services[(name, namespace)]
    assert headless["spec"]["clusterIP"] == "None"
    assert dns["port"] in [p["port"] for p in headless["spec"]["ports"]]
    # Every pagoda job matches the alerts' job=~"pagoda.*".
    for cfg in (config, k8s):
        assert all(j["job_name"].startswith("pagoda") for j in cfg["scrape_configs"] if j["job_name"] != "prometheus")
