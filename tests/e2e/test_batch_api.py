"""OpenAI's Files and Batch APIs over the real HTTP server (the fake engine behind it), with
the official ``openai`` client's ``files`` and ``batches`` resources: uploads, a batch run to
the end (results, errors, usage), validation failures, cancelling, tenants, limits, and a
server stopped in the middle of a batch whose successor finishes it without recomputing
the finished lines."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.fake_engine import FakeEngine
from tests.e2e.server_utils import DEFAULT_MODEL_NAME, RunningServer, running_server


def chat_line(custom_id: str, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": f"hi {custom_id}"}],
                     "max_tokens": max_tokens, **body}}  # fmt: skip


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def client_for(server: RunningServer, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=30,
                         default_headers=headers or None)  # fmt: skip


def wait_for(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.05)


def results(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def served(storage: Path) -> Iterator[tuple[FakeEngine, RunningServer]]:
    engine = FakeEngine()
    with running_server(engine, file_storage_path=str(storage)) as server:
        yield engine, server


@pytest.fixture
def client(served: tuple[FakeEngine, RunningServer]) -> Iterator[openai.OpenAI]:
    with client_for(served[1]) as c:
        yield c


# ---------------------------------------------------------------------------- files
def test_files_upload_list_retrieve_content_delete(client: openai.OpenAI, storage: Path) -> None:
    data = jsonl([chat_line("a"), chat_line("b")])
    up = client.files.create(file=("requests.jsonl", data), purpose="batch")
    assert up.id.startswith("file-") and up.bytes == len(data) and up.filename == "requests.jsonl"
    assert up.purpose == "batch" and up.status == "processed" and up.expires_at is None
    other = client.files.create(file=("notes.txt", b"hello"), purpose="user_data",
                                expires_after={"anchor": "created_at", "seconds": 7200})
    assert other.expires_at == other.created_at + 7200
    assert client.files.retrieve(up.id).bytes == len(data)
    assert client.files.content(up.id).content == data
    assert {f.id for f in client.files.list()} == {up.id, other.id}
    assert [f.id for f in client.files.list(purpose="batch")] == [up.id]
    page = client.files.list(limit=1)
    assert len(page.data) == 1 and page.has_more
    assert client.files.delete(up.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(up.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(up.id)
    # Only ids this store made name files: never a path.
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("..%2F..%2Fetc%2Fpasswd")
    assert sorted(p.name for p in (storage / "files").iterdir()) == sorted([f"{other.id}.json", f"{other.id}.data"])


def test_file_errors(client: openai.OpenAI, served: tuple[FakeEngine, RunningServer]) -> None:
    with pytest.raises(openai.BadRequestError, match="purpose must be one of"):
        client.files.create(file=("x.jsonl", b"{}"), purpose="nonsense")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="expires_after"):
        client.files.create(file=("x.jsonl", b"{}"), purpose="batch", expires_after={"anchor": "created_at",
                                                                                       "seconds": 5})
    with httpx.Client(base_url=served[1].base_url) as http:
        r = http.post("/v1/files", data={"purpose": "batch"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "file"
        r = http.post("/v1/files", data={"purpose": "batch", "colour": "red"}, files={"file": ("a", b"x")})
        assert r.status_code == 400 and "colour" in r.json()["error"]["message"]


def test_upload_limit(storage: Path) -> None:
    with running_server(FakeEngine(), file_storage_path=str(storage), file_max_bytes=1000) as server:
        with client_for(server) as client:
            client.files.create(file=("ok.jsonl", b"x" * 1000), purpose="batch")
            with pytest.raises(openai.APIStatusError) as e:
                client.files.create(file=("big.jsonl", b"x" * 1001), purpose="batch")
            assert e.value.status_code == 413 and "1000 bytes" in e.value.message


def test_files_api_off_says_how_to_turn_it_on(client: openai.OpenAI) -> None:
    with running_server(FakeEngine()) as server, client_for(server) as off:
        for call in (lambda: off.files.list(), lambda: off.batches.list(),
                     lambda: off.files.create(file=("a.jsonl", b"{}"), purpose="batch")):
            with pytest.raises(openai.NotFoundError, match="--file-storage-path"):
                call()


def test_tenants_see_only_their_own_files_and_batches(served: tuple[FakeEngine, RunningServer]) -> None:
    engine, server = served
    with client_for(server, **{"X-Tenant": "alice"}) as alice, client_for(server, **{"X-Tenant": "bob"}) as bob:
        f = alice.files.create(file=("a.jsonl", jsonl([chat_line("a")])), purpose="batch")
        assert [x.id for x in bob.files.list()] == []
        with pytest.raises(openai.NotFoundError):
            bob.files.retrieve(f.id)
        with pytest.raises(openai.NotFoundError):
            bob.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        batch = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        with pytest.raises(openai.NotFoundError):
            bob.batches.retrieve(batch.id)
        assert wait_for(alice, batch.id, ("completed",)).request_counts.completed == 1
        assert [c.tenant for c in engine.calls] == ["alice"]


# ---------------------------------------------------------------------------- batches
def test_batch_runs_to_the_end(client: openai.OpenAI, served: tuple[FakeEngine, RunningServer]) -> None:
    engine = served[0]
    lines = [chat_line(f"ok-{i}", max_tokens=3 + i) for i in range(4)]
    lines.append(chat_line("bad", max_tokens=-1))          # a 400 from the route
    lines.append(chat_line("streamed", stream=True))       # refused in a batch
    lines.append(chat_line("other-model") | {"body": {**chat_line("x")["body"], "model": "nope"}})   # 404
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    assert batch.expires_at == batch.created_at + 24 * 3600
    done = wait_for(client, batch.id, ("completed", "failed"))
    assert done.status == "completed", done.errors
    assert done.request_counts.total == 7 and done.request_counts.completed == 4 and done.request_counts.failed == 3
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.model == DEFAULT_MODEL_NAME
    out = {r["custom_id"]: r for r in results(client, done.output_file_id)}
    assert sorted(out) == [f"ok-{i}" for i in range(4)]
    for i in range(4):
        r = out[f"ok-{i}"]
        assert r["id"].startswith("batch_req_") and r["error"] is None
        assert r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert body["object"] == "chat.completion" and r["response"]["request_id"] == body["id"]
        assert body["usage"]["completion_tokens"] == 3 + i
    errors = {r["custom_id"]: r["response"] for r in results(client, done.error_file_id)}
    assert {k: v["status_code"] for k, v in errors.items()} == {"bad": 400, "streamed": 400, "other-model": 404}
    assert errors["bad"]["body"]["error"]["param"] == "max_tokens"
    assert "Streaming is not supported" in errors["streamed"]["body"]["error"]["message"]
    usage = done.usage
    assert usage.output_tokens == sum(3 + i for i in range(4))
    assert usage.input_tokens == sum(out[f"ok-{i}"]["response"]["body"]["usage"]["prompt_tokens"] for i in range(4))
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # The lines ran as background requests; the output files are files of the Files API.
    assert len(engine.calls) == 4 and all(c.background for c in engine.calls)
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert [b.id for b in client.batches.list()] == [batch.id]


def test_completions_and_embeddings_endpoints_are_checked(client: openai.OpenAI) -> None:
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
            "body": {"model": DEFAULT_MODEL_NAME, "prompt": "Once", "max_tokens": 2}}
    f = client.files.create(file=("in.jsonl", jsonl([line])), purpose="batch")
    done = wait_for(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                  completion_window="24h").id, ("completed", "failed"))
    body = results(client, done.output_file_id)[0]["response"]["body"]
    assert done.status == "completed" and body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 2
    with pytest.raises(openai.BadRequestError, match="not supported in a batch"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/moderations", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h")  # type: ignore
    notes = client.files.create(file=("n.txt", b"{}"), purpose="user_data")
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        client.batches.create(input_file_id=notes.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-" + "0" * 24, endpoint="/v1/completions", completion_window="24h")


def test_invalid_input_fails_the_batch_with_line_errors(client: openai.OpenAI,
                                                        served: tuple[FakeEngine, RunningServer]) -> None:  # fmt: skip
    lines = (jsonl([chat_line("a")]) + b"{not json\n" + jsonl([chat_line("a"), {**chat_line("c"), "url": "/v1/completions"},
             {"custom_id": "d", "method": "GET", "url": "/v1/chat/completions", "body": {}}, {"method": "POST"}]))
    f = client.files.create(file=("in.jsonl", lines), purpose="batch")
    done = wait_for(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h").id, ("completed", "failed"))
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    assert [(e.line, e.code) for e in done.errors.data] == [
        (2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "mismatched_url"), (5, "invalid_method"),
        (6, "missing_required_parameter")]
    assert served[0].calls == []   # nothing ran
    empty = client.files.create(file=("e.jsonl", b"\n"), purpose="batch")
    done = wait_for(client, client.batches.create(input_file_id=empty.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h").id, ("completed", "failed"))
    assert done.status == "failed" and done.errors.data[0].code == "empty_file"


def test_too_many_lines(storage: Path) -> None:
    with running_server(FakeEngine(), file_storage_path=str(storage), batch_max_lines=2) as server:
        with client_for(server) as client:
            f = client.files.create(file=("in.jsonl", jsonl([chat_line(str(i)) for i in range(3)])), purpose="batch")
            done = wait_for(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                          completion_window="24h").id, ("failed",))
            assert done.errors.data[0].code == "too_many_lines" and "at most 2" in done.errors.data[0].message


def test_cancel_aborts_the_lines_in_flight(storage: Path) -> None:
    engine = FakeEngine(step_delay=0.02)
    with running_server(engine, file_storage_path=str(storage), batch_max_concurrency=2) as server, \
            client_for(server) as client:  # fmt: skip
        f = client.files.create(file=("in.jsonl", jsonl([chat_line(str(i), max_tokens=20) for i in range(20)])),
                                purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 20
        # Two lines done and one in flight (a line takes 20 steps of 0.02 s): cancelled between
        # lines, under load, there would be nothing in flight to abort.
        while len(engine.finished) < 2 or len(engine.calls) <= len(engine.finished):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
        done = wait_for(client, batch.id, ("cancelled",))
        assert done.cancelled_at and 2 <= done.request_counts.completed < 20 and done.request_counts.failed == 0
        assert len(results(client, done.output_file_id)) == done.request_counts.completed
        assert engine.aborted, "the lines in flight were aborted"
        assert len(engine.calls) < 20 and len(engine.calls) == done.request_counts.completed + len(engine.aborted)
        with pytest.raises(openai.ConflictError, match="cannot be cancelled"):
            client.batches.cancel(batch.id)


def test_a_restarted_server_finishes_the_batch_without_redoing_lines(storage: Path) -> None:
    first = FakeEngine(step_delay=0.01)
    lines = [chat_line(f"line-{i}", max_tokens=10) for i in range(16)]
    with running_server(first, file_storage_path=str(storage), batch_max_concurrency=2) as server, \
            client_for(server) as client:  # fmt: skip
        f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 20
        while client.batches.retrieve(batch.id).request_counts.completed < 4 and len(first.finished) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    # Stopped mid-batch: the lines with a result are on disk; the ones in flight were aborted.
    done_before = {json.loads(line)["custom_id"]
                   for line in (storage / "batches" / f"{batch.id}.output.jsonl").read_text().splitlines()}
    assert 4 <= len(done_before) < 16 and len(first.aborted) >= 1
    # A torn last line (a crash mid-write) is cut off and its line runs again.
    with open(storage / "batches" / f"{batch.id}.output.jsonl", "ab") as out:
        out.write(b'{"id": "batch_req_torn", "custom_id": "line-15", "resp')
    second = FakeEngine()
    with running_server(second, file_storage_path=str(storage)) as server, client_for(server) as client:
        done = wait_for(client, batch.id, ("completed",))
        out = results(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(line["custom_id"] for line in lines)
    assert done.request_counts.completed == 16 and done.request_counts.failed == 0
    # The second server ran exactly the lines without a result.
    rerun = [re.search(r"hi (line-\d+)", c.prompt).group(1) for c in second.calls]
    assert sorted(rerun) == sorted({line["custom_id"] for line in lines} - done_before)
