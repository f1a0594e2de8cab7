"""Fuzz the HTTP layer with schemathesis, from the app's own /openapi.json.

The real server (uvicorn on 127.0.0.1, a free port) over the fake engine, so the
examples are fast; each operation gets PAGODA_FUZZ_EXAMPLES (default 25) generated
cases, both schema-valid and schema-violating. Checks: never a 5xx, the status code
is one the schema declares, and the body of a documented response matches its schema.
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from tests.e2e.fake_engine import FakeEngine
from tests.e2e.server_utils import running_server

MAX_EXAMPLES = int(os.environ.get("PAGODA_FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def fuzz_server():
    with running_server(FakeEngine(max_model_len=512), served_model_name="pagoda-test") as running:
        yield running


def _load_schema() -> schemathesis.BaseSchema:
    # The same document the server serves at /openapi.json (loaded at collection time;
    # schemathesis.pytest.from_fixture does not work with pytest 9).
    from pagoda.entrypoints.openai.api_server import ServerConfig, build_app

    config = schemathesis.Config()
    config.projects.default.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    return schemathesis.openapi.from_dict(build_app(FakeEngine(), ServerConfig("pagoda-test")).openapi(), config=config)


schema = _load_schema()


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_api_fuzz(case, fuzz_server):
    case.call_and_validate(
        base_url=fuzz_server.base_url, timeout=30,
        checks=[not_a_server_error, status_code_conformance, response_schema_conformance],
    )


def test_served_schema_is_the_fuzzed_one(fuzz_server):
    import httpx

    served = httpx.get(f"{fuzz_server.base_url}/openapi.json", timeout=10).json()
    assert set(served["paths"]) == set(schema.raw_schema["paths"])
    assert "/debug/check_integrity" not in served["paths"]  # internal, never in the public schema
