"""deploy/k8s: every manifest is valid against the Kubernetes API schemas (kubernetes-validate's
bundled ones, strict: an unknown field fails), and the manifests fit together and fit pagoda
(selectors, ports, probes, PAGODA_* flags, resources sized for the model and KV cache)."""

from __future__ import annotations

import os
import re

import kubernetes_validate
import pytest
import yaml

from tests.deploy.deploy_utils import (
    K8S_DIR,
    PROMETHEUS_DIR,
    env_problems,
    exported_metric_names,
    load_yaml_docs,
    serve_value,
)

# 1.30: the oldest release whose pods run a preStop `sleep` action by default.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
MANIFESTS = sorted(p.name for p in K8S_DIR.glob("*.yaml"))
DEPLOYMENTS = ("deployment.yaml", "deployment-dp.yaml")
_PROCESS_OVERHEAD = 0.5 * 2**30  # API server + engine runtime besides weights and KV (docs/deploy.md)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_is_valid_strictly(name, version):
    docs = load_yaml_docs(K8S_DIR / name)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_rejects_unknown_fields():
    doc = load_yaml_docs(K8S_DIR / "deployment.yaml")[0]
    doc["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def _objects() -> dict[tuple[str, str], dict]:
    out = {}
    for name in MANIFESTS:
        for doc in load_yaml_docs(K8S_DIR / name):
            key = (doc["kind"], doc["metadata"]["name"])
            if doc["kind"] == "Deployment":
                key = (doc["kind"], name)  # both variants are named pagoda
            assert key not in out, key
            out[key] = doc
    return out


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _quantity(value: str) -> float:
    """A Kubernetes quantity (1536Mi, 3Gi, 2, 500m) as a number."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti)?", value)
    assert m, value
    scale = {None: 1, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[m[2]]
    return float(m[1]) * scale


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_deployment_fits_services_and_pdb(name):
    objects = _objects()
    deployment = objects[("Deployment", name)]
    assert deployment["metadata"]["name"] == "pagoda" and deployment["metadata"]["namespace"] == "pagoda"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    container = _container(deployment)
    assert container["image"] == "pagoda:latest"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for service in ("pagoda", "pagoda-pods"):
        spec = objects[("Service", service)]["spec"]
        assert spec["selector"].items() <= labels.items(), service
        assert {p["targetPort"] for p in spec["ports"]} <= ports.keys(), service
    assert objects[("PodDisruptionBudget", "pagoda")]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env_problems(env) == []
    assert env["PAGODA_HOST"] == "0.0.0.0" and int(env["PAGODA_PORT"]) == ports["http"]


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_probes_use_health(name):
    container = _container(_objects()[("Deployment", name)])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get == {"path": "/health", "port": "http"}, probe
    # Loading may take minutes: liveness starts only after the startup probe passed once.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    # The pod's grace period covers the preStop pause plus pagoda's drain.
    spec = _objects()[("Deployment", name)]["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in container["env"]}
    drain = float(env["PAGODA_SHUTDOWN_TIMEOUT"])
    assert spec["terminationGracePeriodSeconds"] > drain + container["lifecycle"]["preStop"]["sleep"]["seconds"]


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_resources_fit_the_memory_plan(name, default_model_path):
    """Memory: weights (the default model's file) + the KV cache budget, per engine replica,
    plus the processes' overhead; CPU: the engine threads. Requests = limits (Guaranteed QoS)."""
    container = _container(_objects()[("Deployment", name)])
    env = {e["name"]: e["value"] for e in container["env"]}
    assert "PAGODA_MODEL" not in env  # sized for the bundled model
    replicas = int(env.get("PAGODA_DATA_PARALLEL_SIZE", "1"))
    kv = serve_value("PAGODA_KV_CACHE_MEMORY", env["PAGODA_KV_CACHE_MEMORY"])
    weights = os.path.getsize(default_model_path)
    resources = container["resources"]
    assert resources["requests"] == resources["limits"]
    memory = _quantity(resources["limits"]["memory"])
    assert memory >= replicas * (weights + kv) + _PROCESS_OVERHEAD
    assert memory <= 2 * (replicas * (weights + kv) + _PROCESS_OVERHEAD)  # not wildly oversized
    threads = int(env.get("PAGODA_NUM_THREADS") or env["PAGODA_THREADS_PER_RANK"]) * replicas
    assert _quantity(resources["limits"]["cpu"]) == threads


def test_data_parallel_variant_runs_several_replicas():
    env = {e["name"]: e["value"] for e in _container(_objects()[("Deployment", "deployment-dp.yaml")])["env"]}
    assert serve_value("PAGODA_DATA_PARALLEL_SIZE", env["PAGODA_DATA_PARALLEL_SIZE"]) >= 2


def test_hpa_scales_the_deployment_on_the_adapter_metric():
    objects = _objects()
    hpa = objects[("HorizontalPodAutoscaler", "pagoda")]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pagoda"}
    (metric,) = hpa["metrics"]
    described = metric["object"]["describedObject"]
    assert (described["kind"], described["name"]) in objects

    adapter = yaml.safe_load(objects[("ConfigMap", "prometheus-adapter-pagoda")]["data"]["config.yaml"])
    (rule,) = adapter["rules"]
    series = rule["seriesQuery"].split("{")[0].strip("'")
    assert series in exported_metric_names()
    # The adapter's name rule turns the series into the HPA's metric name.
    assert re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series) == \
        metric["object"]["metric"]["name"]
    # The labels the adapter maps to objects are the ones prometheus-k8s.yml sets.
    job = load_yaml_docs(PROMETHEUS_DIR / "prometheus-k8s.yml")[0]["scrape_configs"][0]
    set_labels = {r["target_label"]: r["replacement"] for r in job["relabel_configs"]}
    assert set(rule["resources"]["overrides"]) <= set_labels.keys()
    assert set_labels["service"] == described["name"]
    assert set_labels["namespace"] == objects[("Namespace", "pagoda")]["metadata"]["name"]
