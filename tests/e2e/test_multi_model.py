"""Several models in one server (#47): `pagoda serve --models-dir DIR --models-max 2` lists
every model, loads the one a request names on first use (each in an engine core process of
its own), answers requests to two models alternately, evicts the least recently used idle
one for a third, unloads on Ollama's `keep_alive: 0` (the memory given back) and when a
request's keep_alive runs out."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagoda.entrypoints.openai.multi_model import parse_keep_alive
from pagoda.hub.paths import default_model_path
from tests.e2e.server_utils import serve_process

REPO = Path(__file__).resolve().parents[2]
QUESTION = [{"role": "user", "content": "Name a color."}]


def _tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier += kids
    total = 0
    for p in tree:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _loaded(http: httpx.Client) -> set[str]:
    return {m["name"] for m in http.get("/api/ps").json()["models"]}


@pytest.fixture
def server(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    for name in ("a", "b", "c"):
        (models / f"{name}.gguf").symlink_to(default_model_path())
    args = ["--models-dir", str(models), "--models-max", "2", "--num-kv-blocks", "16", "--max-model-len", "512"]
    with serve_process(args, {**os.environ, "PYTHONPATH": str(REPO)}, timeout=120) as running:
        yield running


def test_two_models_alternate_evict_and_unload(server, capsys):
    from pagoda.entrypoints.cli import main

    proc, base = server
    with httpx.Client(base_url=base, timeout=180) as http, \
            openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=180) as client:
        assert {m.id for m in client.models.list().data} == {"a", "b", "c"}
        assert {m["name"] for m in http.get("/api/tags").json()["models"]} == {"a:latest", "b:latest", "c:latest"}
        assert _loaded(http) == set()   # nothing loaded before a request names it
        replies = {}
        for name in ("a", "b", "a", "b"):
            r = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=6, temperature=0)
            replies.setdefault(name, r.choices[0].message.content)
            assert r.choices[0].message.content == replies[name] and r.model == name
        assert replies["a"] == replies["b"]   # the same weights under two names
        # Streamed through the router as from a one-model server.
        stream = client.chat.completions.create(model="a", messages=QUESTION, max_tokens=6, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == replies["a"]
        client.chat.completions.create(model="b", messages=QUESTION, max_tokens=2)   # b the most recent again
        assert _loaded(http) == {"a:latest", "b:latest"}
        port = base.rsplit(":", 1)[1]
        # `pagoda ps`, the CLI's main in this process (a Python of its own costs a second here)
        capsys.readouterr()
        returncode = main(["ps", "--port", port])
        rows = [line.split() for line in capsys.readouterr().out.splitlines()]
        assert returncode == 0 and rows[0] == ["NAME", "CONTEXT", "UNTIL", "STATUS"]
        assert {r[0] for r in rows[1:]} == {"a:latest", "b:latest"} and all(r[1] == "512" for r in rows[1:])
        # A third model: the least recently used idle one (a) makes room.
        r = http.post("/api/generate", json={"model": "c", "prompt": "hi", "stream": False,
                                             "options": {"num_predict": 3}})
        assert r.status_code == 200 and r.json()["done"] is True
        assert _loaded(http) == {"b:latest", "c:latest"}
        # keep_alive 0 (Ollama's unload call): b goes, and its memory with it.
        before_b = _tree_rss(proc.pid)
        r = http.post("/api/generate", json={"model": "b", "keep_alive": 0})
        assert r.status_code == 200 and r.json()["done_reason"] == "unload"
        assert _loaded(http) == {"c:latest"}
        after = _tree_rss(proc.pid)
        r = http.post("/api/generate", json={"model": "b", "prompt": "hi", "stream": False,
                                             "options": {"num_predict": 2}})
        with_b = _tree_rss(proc.pid)
        assert with_b > after * 1.2, (with_b, after)      # loading b costs memory ...
        http.post("/api/generate", json={"model": "b", "keep_alive": 0})
        deadline = time.monotonic() + 10
        while _tree_rss(proc.pid) > after * 1.1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _tree_rss(proc.pid) <= after * 1.1, (_tree_rss(proc.pid), after, before_b)   # ... given back
        # A request's keep_alive: c goes once its 300 ms run out.
        http.post("/api/chat", json={"model": "c", "messages": QUESTION, "stream": False, "keep_alive": "300ms",
                                     "options": {"num_predict": 2}})
        deadline = time.monotonic() + 10
        while _loaded(http) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _loaded(http) == set()
        # Errors: an unknown model (each API's shape), a bad keep_alive.
        r = http.post("/v1/chat/completions", json={"model": "nope", "messages": QUESTION})
        assert r.status_code == 404 and "a, b, c" in r.json()["error"]["message"]
        r = http.post("/api/chat", json={"model": "nope", "messages": QUESTION})
        assert r.status_code == 404 and "not found" in r.json()["error"]
        r = http.get("/metrics")
        assert r.status_code == 404 and "not served by a server of several models" in r.json()["error"]["message"]
        r = http.post("/api/chat", json={"model": "a", "messages": QUESTION, "keep_alive": "soon"})
        assert r.status_code == 400 and "not a duration" in r.json()["error"]


@pytest.mark.parametrize(("value", "seconds"), [("5m", 300.0), ("1h30m", 5400.0), ("300ms", 0.3), (0, 0.0),
                                                (-1, None), ("-1m", None), ("10", 10.0), (2.5, 2.5)])
def test_keep_alive_values(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5x", True, [], ""])
def test_keep_alive_refuses(value):
    with pytest.raises(ValueError):
        parse_keep_alive(value)


def test_several_models_refuse_what_they_cannot_take(tmp_path, capsys):
    from pagoda.entrypoints.cli import main

    (tmp_path / "a.gguf").symlink_to(default_model_path())
    assert main(["serve", "--models-dir", str(tmp_path), "--served-model-name", "x"]) == 2
    assert "cannot be combined with --served-model-name" in capsys.readouterr().err
    assert main(["serve", "--models-dir", str(tmp_path / "none")]) == 2
    assert "not a folder" in capsys.readouterr().err
