"""The files of OpenAI's Files API (``/v1/files``), kept in one folder the operator chose.

Each file is two entries of ``<root>/files``: ``<id>.json``, its metadata (OpenAI's file
object plus the tenant that owns it), and ``<id>.data``, its bytes. Both are written to a
temporary name and renamed, so a crash never leaves half a file behind a valid id. A
client names a file only by its id, which must look like one this store made
(``file-`` and 24 hex digits): never a path. The name a client gives is metadata only.

Tenants (``--api-keys-file``) see only their own files, as OpenAI's projects do; without
keys every client is the same tenant (None). A file may expire (``expires_after``); an
expired file is gone for every purpose, and its entries are removed when next seen.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

# What a client may upload for (OpenAI's purposes); only "batch" files are read by this server.
UPLOAD_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
BATCH_OUTPUT = "batch_output"   # the purpose of the files a batch writes
_ID = re.compile(r"file-[0-9a-f]{24}")


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary name in the same folder and a rename."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class FileStore:
    def __init__(self, root: str | os.PathLike[str], max_bytes: int) -> None:
        self.dir = Path(root) / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        for stale in self.dir.glob(".*.tmp"):   # left by a crash mid-write
            stale.unlink(missing_ok=True)

    # ---- paths -----------------------------------------------------------------------
    def _meta_path(self, file_id: str) -> Path:
        return self.dir / f"{file_id}.json"

    def data_path(self, file_id: str) -> Path:
        return self.dir / f"{file_id}.data"

    # ---- writing -----------------------------------------------------------------------
    def create(self, data: bytes, filename: str, purpose: str, tenant: str | None,
               expires_after: int | None = None) -> dict[str, Any]:  # fmt: skip
        """Store an uploaded file; ``expires_after``: seconds after creation it goes away."""
        file_id = new_id("file-")
        write_atomic(self.data_path(file_id), data)
        return self._write_meta(file_id, len(data), filename, purpose, tenant, expires_after)

    def adopt(self, path: Path, filename: str, purpose: str, tenant: str | None,
              expires_after: int | None = None) -> dict[str, Any]:  # fmt: skip
        """Move a file this server wrote (a batch's output) into the store."""
        file_id = new_id("file-")
        os.replace(path, self.data_path(file_id))
        return self._write_meta(file_id, self.data_path(file_id).stat().st_size, filename, purpose, tenant,
                                expires_after)  # fmt: skip

    def _write_meta(self, file_id: str, size: int, filename: str, purpose: str, tenant: str | None,
                    expires_after: int | None) -> dict[str, Any]:  # fmt: skip
        created = int(time.time())
        meta = {
            "id": file_id, "object": "file", "bytes": size, "created_at": created, "filename": filename,
            "purpose": purpose, "status": "processed",
            "expires_at": created + expires_after if expires_after is not None else None,
            "status_details": None, "tenant": tenant,
        }  # fmt: skip
        write_atomic(self._meta_path(file_id), json.dumps(meta).encode())
        return meta

    def delete(self, file_id: str, tenant: str | None) -> bool:
        if self.get(file_id, tenant) is None:
            return False
        self._remove(file_id)
        return True

    def _remove(self, file_id: str) -> None:
        # The metadata first: without it the id is unknown, whatever is left of the data.
        self._meta_path(file_id).unlink(missing_ok=True)
        self.data_path(file_id).unlink(missing_ok=True)

    # ---- reading -----------------------------------------------------------------------
    def get(self, file_id: str, tenant: str | None) -> dict[str, Any] | None:
        """The file's metadata (with its ``tenant``), or None: no such file for this tenant."""
        if not _ID.fullmatch(file_id):
            return None
        try:
            meta = json.loads(self._meta_path(file_id).read_bytes())
        except (FileNotFoundError, ValueError):
            return None
        if meta.get("tenant") != tenant:
            return None
        if meta["expires_at"] is not None and meta["expires_at"] <= time.time():
            self._remove(file_id)
            return None
        return meta

    def list(self, tenant: str | None, purpose: str | None = None) -> list[dict[str, Any]]:
        """The tenant's files, newest first (ties by id, so that ``after`` cursors are stable)."""
        found = []
        for path in self.dir.glob("file-*.json"):
            meta = self.get(path.stem, tenant)
            if meta is not None and (purpose is None or meta["purpose"] == purpose):
                found.append(meta)
        found.sort(key=lambda m: (m["created_at"], m["id"]), reverse=True)
        return found

    def sweep(self) -> int:
        """Remove every expired file (whoever owns it); how many went."""
        removed = 0
        now = time.time()
        for path in self.dir.glob("file-*.json"):
            try:
                meta = json.loads(path.read_bytes())
            except (FileNotFoundError, ValueError):
                continue
            if meta.get("expires_at") is not None and meta["expires_at"] <= now:
                self._remove(path.stem)
                removed += 1
        return removed


def public(meta: dict[str, Any]) -> dict[str, Any]:
    """The file object a client sees (without the owner)."""
    return {k: v for k, v in meta.items() if k != "tenant"}
