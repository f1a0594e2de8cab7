"""deploy/compose.yaml: valid against the Compose Specification's JSON schema (the copy
check-jsonschema vendors), and consistent with pagoda and the files it mounts."""

from __future__ import annotations

import json
import re
from importlib import resources

import jsonschema
import pytest

from tests.deploy.deploy_utils import (
    COMPOSE_FILE,
    PROMETHEUS_DIR,
    env_problems,
    load_yaml_docs,
)


def _compose() -> dict:
    return load_yaml_docs(COMPOSE_FILE)[0]


def _validator() -> jsonschema.protocols.Validator:
    schema_file = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    assert schema["title"] == "Compose Specification"
    return jsonschema.validators.validator_for(schema)(schema)


def test_compose_file_matches_the_compose_spec():
    validator = _validator()
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(_compose())]
    assert not errors, errors
    # The schema is strict: a misspelt key fails.
    bad = _compose()
    bad["services"]["pagoda"]["helthcheck"] = bad["services"]["pagoda"].pop("healthcheck")
    assert any("helthcheck" in e.message for e in validator.iter_errors(bad))


def _defaults(value: str) -> str:
    """A compose value with ${VAR:-default} interpolated as if VAR were unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def test_pagoda_service():
    pagoda = _compose()["services"]["pagoda"]
    assert pagoda["image"] == "pagoda:latest"
    env = {k: _defaults(str(v)) for k, v in pagoda["environment"].items()}
    assert env_problems(env) == []
    assert env["PAGODA_HOST"] == "0.0.0.0" and env["PAGODA_MODEL"] == ""  # bundled model by default
    port = env["PAGODA_PORT"]
    assert f"{port}:{port}" in pagoda["ports"]
    probe = " ".join(pagoda["healthcheck"]["test"])
    assert f"http://127.0.0.1:{port}/health" in probe
    # Docker's SIGKILL must not cut pagoda's drain (--shutdown-timeout, 30 s by default) short.
    assert int(pagoda["stop_grace_period"].rstrip("s")) > 30


@pytest.mark.parametrize("service", ["prometheus", "grafana"])
def test_monitoring_mounts_exist_and_stay_on_loopback(service):
    spec = _compose()["services"][service]
    for volume in spec["volumes"]:
        source = volume.split(":")[0]
        if source.startswith("./"):
            assert (COMPOSE_FILE.parent / source).exists(), volume
    assert all(str(p).startswith("127.0.0.1:") for p in spec["ports"]), spec["ports"]


def test_prometheus_reads_the_mounted_config():
    spec = _compose()["services"]["prometheus"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in spec["volumes"]}
    target = mounts["./prometheus"]
    assert f"--config.file={target}/prometheus.yml" in spec["command"]
    assert (PROMETHEUS_DIR / "prometheus.yml").is_file()
