"""Fixtures: a fake engine behind the real HTTP server, and clients for it.

One server per test module (starting and stopping uvicorn costs ~0.25 s); its engine is
reset before each test. Tests needing other server options start their own with
``running_server``.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.fake_engine import FakeEngine
from tests.e2e.server_utils import DEFAULT_MODEL_NAME, RunningServer, running_server

MODEL = DEFAULT_MODEL_NAME


@pytest.fixture(scope="module")
def _shared_server() -> Iterator[tuple[FakeEngine, RunningServer]]:
    engine = FakeEngine()
    with running_server(engine) as running:
        yield engine, running


@pytest.fixture
def engine(_shared_server: tuple[FakeEngine, RunningServer]) -> FakeEngine:
    engine, _ = _shared_server
    engine.reset()
    return engine


@pytest.fixture
def server(_shared_server: tuple[FakeEngine, RunningServer], engine: FakeEngine) -> RunningServer:
    return _shared_server[1]


@pytest.fixture
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    # No retries: a test that expects 429/503 must see it once, not wait through backoff.
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        yield c
