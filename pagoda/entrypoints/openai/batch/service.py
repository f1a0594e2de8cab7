"""OpenAI's Batch API: batches kept on disk and run behind live traffic, one at a time.

A batch is ``<root>/batches/<id>.json`` (OpenAI's batch object plus its tenant), rewritten
(atomically) at each change of status, and two result files that grow a line per finished
request: ``<id>.output.jsonl`` (2xx responses) and ``<id>.errors.jsonl`` (the others). The
result files are the batch's progress: a server that stops in the middle of a batch (a
restart, a crash) finds on its next start the lines that have a result and runs only the
others, so no finished line is computed twice. A torn last line (a crash mid-write) is cut
off and that line runs again.

The life of a batch, as OpenAI's: ``validating`` (its input file read and checked in a
thread) -> ``in_progress`` -> ``finalizing`` (the result files become files of the Files
API: ``output_file_id``, ``error_file_id`` when a line failed) -> ``completed``; or
``failed`` (invalid input: ``errors``), ``cancelling`` -> ``cancelled`` (lines in flight
aborted; what finished is kept and finalized), ``expired`` (not done within its 24 hours:
the lines that never ran go to the error file with code ``batch_expired``).

Behind live traffic: the lines run as background requests (the scheduler admits them after
every live request, preempts them first and lets live prompts take a step's budget before
their prompt chunks), at most ``max_concurrency`` at a time, and a new line starts only
while no live request is waiting for its first token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp

from pagoda.entrypoints.openai.batch.files import BATCH_OUTPUT, FileStore, new_id, write_atomic
from pagoda.entrypoints.openai.batch.lines import InputLine, is_success, read_input, run_line
from pagoda.entrypoints.openai.request_group import ServerState

logger = logging.getLogger(__name__)

COMPLETION_WINDOW_S = 24 * 3600   # "24h", the one window OpenAI offers
_ID = re.compile(r"batch_[0-9a-f]{24}")
_UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
_POLL_S = 0.02
_SAVE_EVERY_S = 1.0   # how often request_counts are written while a batch runs


class BatchService:
    def __init__(self, root: str | os.PathLike[str], files: FileStore, state: ServerState, max_lines: int,
                 max_concurrency: int) -> None:  # fmt: skip
        self.dir = Path(root) / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files = files
        self.state = state
        self.max_lines = max_lines
        self.max_concurrency = max_concurrency
        self.app: ASGIApp | None = None   # set once the app exists (the lines run through it)
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        # The batch being run: its object (the one copy that changes while it runs) and its cancel signal.
        self._active: dict[str, tuple[dict[str, Any], asyncio.Event]] = {}

    # ---- lifetime --------------------------------------------------------------------
    def start(self, app: ASGIApp) -> None:
        """Start the worker on the running loop, resuming every unfinished batch (oldest first)."""
        self.app = app
        if self._worker is not None:
            return
        unfinished = [b for b in self._all() if b["status"] in _UNFINISHED]
        for batch in sorted(unfinished, key=lambda b: (b["created_at"], b["id"])):
            logger.info("batch %s: resuming (%s)", batch["id"], batch["status"])
            self._queue.put_nowait(batch["id"])
        self._worker = asyncio.get_running_loop().create_task(self._work())

    async def stop(self) -> None:
        """Stop the worker; a batch in progress stays in progress on disk and resumes at the next start."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.cancel()
            try:
                await worker
            except asyncio.CancelledError:
                pass

    # ---- the API's operations ----------------------------------------------------------
    def create(self, input_file_id: str, endpoint: str, metadata: dict[str, str] | None, tenant: str | None,
               output_expires_after: int | None = None) -> dict[str, Any]:  # fmt: skip
        """A new batch (validating); the caller has checked the endpoint and the input file."""
        now = int(time.time())
        batch = {
            "id": new_id("batch_"), "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": "24h", "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + COMPLETION_WINDOW_S, "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata, "model": None,
            "usage": None, "tenant": tenant, "output_expires_after": output_expires_after,
        }  # fmt: skip
        self._save(batch)
        self._queue.put_nowait(batch["id"])
        return batch

    def get(self, batch_id: str, tenant: str | None) -> dict[str, Any] | None:
        if not _ID.fullmatch(batch_id):
            return None
        batch = self._active[batch_id][0] if batch_id in self._active else self._load(batch_id)
        return batch if batch is not None and batch["tenant"] == tenant else None

    def list(self, tenant: str | None) -> list[dict[str, Any]]:
        """The tenant's batches, newest first."""
        found = [self._active[b["id"]][0] if b["id"] in self._active else b for b in self._all()
                 if b["tenant"] == tenant]
        return sorted(found, key=lambda b: (b["created_at"], b["id"]), reverse=True)

    def cancel(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Ask a batch to stop; a finished one is returned as it is (the caller says so)."""
        if batch["status"] not in ("validating", "in_progress"):
            return batch
        active = self._active.get(batch["id"])
        if active is not None:
            batch = active[0]
        batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
        self._save(batch)
        if active is not None:
            active[1].set()
        return batch

    # ---- storage -----------------------------------------------------------------------
    def _path(self, batch_id: str, suffix: str) -> Path:
        return self.dir / f"{batch_id}{suffix}"

    def _save(self, batch: dict[str, Any]) -> None:
        write_atomic(self._path(batch["id"], ".json"), json.dumps(batch).encode())

    def _load(self, batch_id: str) -> dict[str, Any] | None:
        try:
            return json.loads(self._path(batch_id, ".json").read_bytes())
        except (FileNotFoundError, ValueError):
            return None

    def _all(self) -> list[dict[str, Any]]:
        return [b for p in self.dir.glob("batch_*.json") if (b := self._load(p.stem)) is not None]

    def _results(self, batch_id: str, kind: str) -> list[dict[str, Any]]:
        """The result lines written so far (``kind``: "output" or "errors"); a torn last line
        (no newline: the server stopped mid-write) is cut off the file."""
        path = self._path(batch_id, f".{kind}.jsonl")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        if end < len(data):
            with open(path, "r+b") as f:
                f.truncate(end)
        return [json.loads(raw) for raw in data[:end].splitlines() if raw.strip()]

    # ---- running -----------------------------------------------------------------------
    async def _work(self) -> None:
        while True:
            batch_id = await self._queue.get()
            try:
                await self._run(batch_id)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("batch %s: failed", batch_id)
                batch = self._load(batch_id)
                if batch is not None and batch["status"] in _UNFINISHED:
                    self._fail(batch, [{"code": "server_error", "message": "The batch failed on the server; "
                                        "see its log.", "param": None, "line": None}])  # fmt: skip

    def _fail(self, batch: dict[str, Any], errors: list[dict[str, Any]]) -> None:
        batch["status"], batch["failed_at"] = "failed", int(time.time())
        batch["errors"] = {"object": "list", "data": errors}
        self._save(batch)

    async def _run(self, batch_id: str) -> None:
        batch = self._load(batch_id)
        if batch is None or batch["status"] not in _UNFINISHED:
            return
        meta = self.files.get(batch["input_file_id"], batch["tenant"])
        if meta is None:
            self._fail(batch, [{"code": "invalid_file", "message": f"The input file {batch['input_file_id']!r} "
                                "no longer exists.", "param": "input_file_id", "line": None}])  # fmt: skip
            return
        data = await asyncio.to_thread(self.files.data_path(meta["id"]).read_bytes)
        lines, errors = await asyncio.to_thread(read_input, data, batch["endpoint"], self.max_lines)
        if errors:
            self._fail(batch, errors)
            return
        batch["request_counts"]["total"] = len(lines)
        batch["model"] = next((ln.body["model"] for ln in lines if isinstance(ln.body.get("model"), str)), None)
        if batch["status"] == "validating":
            batch["status"], batch["in_progress_at"] = "in_progress", int(time.time())
        self._save(batch)
        done = {r["custom_id"]: r for kind in ("output", "errors") for r in self._results(batch_id, kind)}
        todo = [ln for ln in lines if ln.custom_id not in done]
        if done:
            logger.info("batch %s: %d of %d lines done before; running the other %d", batch_id, len(done),
                        len(lines), len(todo))  # fmt: skip
        counts = batch["request_counts"]
        counts["completed"] = sum(1 for r in done.values() if is_success(r))
        counts["failed"] = len(done) - counts["completed"]
        usage = _Usage()
        for result in done.values():
            usage.add(result)
        cancelled = asyncio.Event()
        self._active[batch_id] = (batch, cancelled)
        try:
            if batch["status"] == "in_progress":
                await self._run_lines(batch, todo, usage, cancelled)
            if self.state.draining:
                await asyncio.Future()   # the server is stopping: unfinished, resumed after the restart
            self._finalize(batch, todo, usage)
        finally:
            self._active.pop(batch_id, None)

    async def _run_lines(self, batch: dict[str, Any], todo: list[InputLine], usage: _Usage,
                         cancelled: asyncio.Event) -> None:  # fmt: skip
        batch_id = batch["id"]
        outputs = open(self._path(batch_id, ".output.jsonl"), "ab")
        errors = open(self._path(batch_id, ".errors.jsonl"), "ab")
        in_flight: set[asyncio.Task[None]] = set()
        cancel_wait = asyncio.ensure_future(cancelled.wait())
        last_save = time.monotonic()

        async def one(line: InputLine) -> None:
            nonlocal last_save
            result = await run_line(self.app, line, batch["tenant"])
            if not is_success(result) and (self.state.draining or _stopped_by_shutdown(result)):
                return   # stopped by the server's shutdown: it runs again after the restart
            f = outputs if is_success(result) else errors
            f.write(json.dumps(result).encode() + b"\n")
            f.flush()
            batch["request_counts"]["completed" if is_success(result) else "failed"] += 1
            usage.add(result)
            if time.monotonic() - last_save > _SAVE_EVERY_S:
                last_save = time.monotonic()
                batch["usage"] = usage.total()
                self._save(batch)

        def expired() -> bool:
            return time.time() >= batch["expires_at"]

        try:
            for line in todo:
                # A free seat, no live request waiting for its first token, and the server not stopping.
                while not (cancelled.is_set() or expired()) and (
                        len(in_flight) >= self.max_concurrency or self.state.num_waiting > 0 or self.state.draining):
                    if len(in_flight) >= self.max_concurrency:
                        await asyncio.wait(in_flight | {cancel_wait}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                    else:
                        await asyncio.sleep(_POLL_S)
                    in_flight = {t for t in in_flight if not t.done()}
                if cancelled.is_set() or expired():
                    break
                in_flight.add(asyncio.get_running_loop().create_task(one(line)))
            while in_flight and not (cancelled.is_set() or expired()):
                await asyncio.wait(in_flight | {cancel_wait}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                in_flight = {t for t in in_flight if not t.done()}
        finally:
            # Cancelled, expired, or the server stopping: the lines in flight are aborted.
            cancel_wait.cancel()
            for task in in_flight:
                task.cancel()
            if in_flight:
                await asyncio.wait(in_flight)
            outputs.close()
            errors.close()

    def _finalize(self, batch: dict[str, Any], todo: list[InputLine], usage: _Usage) -> None:
        batch_id = batch["id"]
        now = int(time.time())
        ran = {r["custom_id"] for kind in ("output", "errors") for r in self._results(batch_id, kind)}
        end = "completed"
        if batch["status"] == "cancelling":
            end = "cancelled"
        elif any(ln.custom_id not in ran for ln in todo):
            end = "expired"
            with open(self._path(batch_id, ".errors.jsonl"), "ab") as f:
                for line in todo:
                    if line.custom_id not in ran:
                        f.write(json.dumps(_expired(line)).encode() + b"\n")
                        batch["request_counts"]["failed"] += 1
        batch["status"], batch["finalizing_at"] = "finalizing", now
        batch["usage"] = usage.total()
        self._save(batch)
        tenant, expires = batch["tenant"], batch.get("output_expires_after")
        for kind, key in (("output", "output_file_id"), ("errors", "error_file_id")):
            path = self._path(batch_id, f".{kind}.jsonl")
            if batch[key] is None and path.exists() and (kind == "output" or path.stat().st_size):
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
                batch[key] = self.files.adopt(path, f"{batch_id}_{'output' if kind == 'output' else 'error'}.jsonl",
                                              BATCH_OUTPUT, tenant, expires)["id"]
            path.unlink(missing_ok=True)
        batch["status"], batch[f"{end}_at"] = end, int(time.time())
        self._save(batch)
        logger.info("batch %s: %s (%d completed, %d failed)", batch_id, end, batch["request_counts"]["completed"],
                    batch["request_counts"]["failed"])  # fmt: skip


def _stopped_by_shutdown(result: dict[str, Any]) -> bool:
    body = result["response"]["body"]
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("code") == "server_shutting_down"


def _expired(line: InputLine) -> dict[str, Any]:
    return {"id": new_id("batch_req_"), "custom_id": line.custom_id, "response": None,
            "error": {"code": "batch_expired", "message": "This line was not run within the batch's 24 hours."}}


class _Usage:
    """The batch's token usage, summed over its lines' responses (OpenAI's batch ``usage``)."""

    def __init__(self) -> None:
        self.input = self.cached = self.output = self.reasoning = 0

    def add(self, result: dict[str, Any]) -> None:
        response = result.get("response") or {}
        body = response.get("body")
        usage = body.get("usage") if isinstance(body, dict) else None
        if not isinstance(usage, dict):
            return
        # Chat and completions say prompt/completion tokens; the Responses API input/output.
        self.input += usage.get("prompt_tokens", usage.get("input_tokens")) or 0
        self.output += usage.get("completion_tokens", usage.get("output_tokens")) or 0
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        self.cached += details.get("cached_tokens") or 0
        details = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
        self.reasoning += details.get("reasoning_tokens") or 0

    def total(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input, "input_tokens_details": {"cached_tokens": self.cached},
            "output_tokens": self.output, "output_tokens_details": {"reasoning_tokens": self.reasoning},
            "total_tokens": self.input + self.output,
        }  # fmt: skip


def public(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch object a client sees."""
    return {k: v for k, v in batch.items() if k not in ("tenant", "output_expires_after")}
