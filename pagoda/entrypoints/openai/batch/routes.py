"""The routes of OpenAI's Files API (``/v1/files``) and Batch API (``/v1/batches``).

Files: upload (multipart: ``file``, ``purpose``, optional ``expires_after[anchor]`` /
``expires_after[seconds]``), list (``purpose``, ``limit``, ``order``, ``after``), retrieve,
content, delete. Batches: create, retrieve, list (``limit``, ``after``), cancel. They exist
when `pagoda serve` has ``--file-storage-path``; without it every one of these routes says
how to turn them on.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import UploadFile

from pagoda.entrypoints.openai.batch.files import UPLOAD_PURPOSES, FileStore
from pagoda.entrypoints.openai.batch.files import public as public_file
from pagoda.entrypoints.openai.batch.lines import BATCH_ENDPOINTS
from pagoda.entrypoints.openai.batch.service import BatchService
from pagoda.entrypoints.openai.batch.service import public as public_batch
from pagoda.entrypoints.openai.errors import APIError, bad_request
from pagoda.entrypoints.openai.serving_engine import TENANT_SCOPE_KEY

MAX_METADATA = 16   # OpenAI's metadata: up to 16 pairs, keys of 64 characters, values of 512
# An expiry (files' expires_after, batches' output_expires_after): 1 hour to 30 days, as OpenAI's.
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600


class _Expiry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_EXPIRY_S, le=MAX_EXPIRY_S)


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: _Expiry | None = None


def _owned(store: FileStore | BatchService, ident: str, tenant: str | None, param: str) -> dict[str, Any]:
    """The file or batch ``ident`` of ``tenant`` in ``store``; a 404 where there is none
    (another tenant's object is not found either)."""
    found = store.get(ident, tenant)
    if found is None:
        what = "file" if isinstance(store, FileStore) else "batch"
        raise APIError(404, f"No {what} with id {ident!r} was found.", param=param, code="not_found")
    return found


def _page(items: list[dict[str, Any]], limit: int, after: str | None) -> dict[str, Any]:
    """OpenAI's cursor page: the items after the one whose id is ``after``, at most ``limit``."""
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"No object with id {after!r} to list after.", param="after")
        items = items[ids.index(after) + 1:]
    data = items[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}  # fmt: skip


def _limit(limit: int, most: int) -> int:
    if not 1 <= limit <= most:
        raise bad_request(f"limit must be between 1 and {most}, got {limit}.", param="limit")
    return limit


def add_batch_routes(app: FastAPI, files: FileStore | None, batches: BatchService | None) -> None:
    """The Files and Batch routes over ``files`` and ``batches``; None: the routes answer that
    the APIs are off."""

    def stores(raw: Request) -> tuple[FileStore, BatchService, str | None]:
        if files is None or batches is None:
            raise APIError(404, "The Files and Batch APIs are off on this server: start `pagoda serve` with "
                                "--file-storage-path DIR to keep files (and run batches) there.",
                           code="files_api_disabled")  # fmt: skip
        return files, batches, raw.scope.get(TENANT_SCOPE_KEY)

    # ---- files ---------------------------------------------------------------------------
    @app.post("/v1/files")
    async def upload_file(raw: Request) -> dict[str, Any]:
        store, _, tenant = stores(raw)
        form = await raw.form(max_files=1, max_fields=8)
        try:
            unknown = sorted(set(form) - {"file", "purpose", "expires_after[anchor]", "expires_after[seconds]"})
            if unknown:
                raise bad_request(f"Unknown field(s): {', '.join(unknown)}.", param=unknown[0],
                                  code="unknown_parameter")  # fmt: skip
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise bad_request("A file is required (the multipart field 'file').", param="file")
            if purpose not in UPLOAD_PURPOSES:
                raise bad_request(f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}; got {purpose!r}.",
                                  param="purpose")  # fmt: skip
            expires_after = _upload_expiry(form.get("expires_after[anchor]"), form.get("expires_after[seconds]"))
            data = await upload.read(store.max_bytes + 1)
            if len(data) > store.max_bytes:
                raise APIError(413, f"The file is larger than this server's limit of {store.max_bytes} bytes "
                                    "(--file-max-bytes).", param="file", code="file_too_large")  # fmt: skip
            return public_file(store.create(data, upload.filename or "upload", purpose, tenant, expires_after))
        finally:
            await form.close()

    @app.get("/v1/files")
    async def list_files(raw: Request, purpose: str | None = None, limit: int = 10000, order: str = "desc",
                         after: str | None = None) -> dict[str, Any]:  # fmt: skip
        store, _, tenant = stores(raw)
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be asc or desc, got {order!r}.", param="order")
        found = [public_file(m) for m in store.list(tenant, purpose)]
        if order == "asc":
            found.reverse()
        return _page(found, _limit(limit, 10000), after)

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(raw: Request, file_id: str) -> dict[str, Any]:
        store, _, tenant = stores(raw)
        return public_file(_owned(store, file_id, tenant, "file_id"))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(raw: Request, file_id: str) -> FileResponse:
        store, _, tenant = stores(raw)
        _owned(store, file_id, tenant, "file_id")
        return FileResponse(store.data_path(file_id), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(raw: Request, file_id: str) -> dict[str, Any]:
        store, service, tenant = stores(raw)
        _owned(store, file_id, tenant, "file_id")
        if any(b["input_file_id"] == file_id and b["status"] in ("validating", "in_progress")
               for b in service.list(tenant)):  # fmt: skip
            raise bad_request(f"The file {file_id!r} is the input of a batch in progress; cancel the batch first.",
                              param="file_id")  # fmt: skip
        store.delete(file_id, tenant)
        return {"id": file_id, "object": "file", "deleted": True}

    # ---- batches -------------------------------------------------------------------------
    @app.post("/v1/batches")
    async def create_batch(body: BatchCreateRequest, raw: Request) -> dict[str, Any]:
        store, service, tenant = stores(raw)
        if body.endpoint not in BATCH_ENDPOINTS:
            raise bad_request(f"endpoint {body.endpoint!r} is not supported in a batch here; choose from "
                              f"{', '.join(BATCH_ENDPOINTS)}.", param="endpoint")  # fmt: skip
        if body.completion_window != "24h":
            raise bad_request(f"completion_window must be '24h', got {body.completion_window!r}.",
                              param="completion_window")  # fmt: skip
        _check_metadata(body.metadata)
        meta = _owned(store, body.input_file_id, tenant, "input_file_id")
        if meta["purpose"] != "batch":
            raise bad_request(f"The file {body.input_file_id!r} has purpose {meta['purpose']!r}; a batch reads "
                              "files uploaded with purpose 'batch'.", param="input_file_id")  # fmt: skip
        expiry = body.output_expires_after.seconds if body.output_expires_after is not None else None
        return public_batch(service.create(body.input_file_id, body.endpoint, body.metadata, tenant, expiry))

    @app.get("/v1/batches")
    async def list_batches(raw: Request, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        _, service, tenant = stores(raw)
        return _page([public_batch(b) for b in service.list(tenant)], _limit(limit, 100), after)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(raw: Request, batch_id: str) -> dict[str, Any]:
        _, service, tenant = stores(raw)
        batch = _owned(service, batch_id, tenant, "batch_id")
        return public_batch(batch)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(raw: Request, batch_id: str) -> dict[str, Any]:
        _, service, tenant = stores(raw)
        batch = _owned(service, batch_id, tenant, "batch_id")
        if batch["status"] not in ("validating", "in_progress", "cancelling"):
            raise APIError(409, f"The batch {batch_id!r} is {batch['status']}: it cannot be cancelled.",
                           param="batch_id", code="batch_not_cancellable")  # fmt: skip
        return public_batch(service.cancel(batch))


def _upload_expiry(anchor: Any, seconds: Any) -> int | None:
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise bad_request("expires_after[anchor] must be 'created_at'.", param="expires_after")
    try:
        value = int(seconds)
    except (TypeError, ValueError):
        raise bad_request("expires_after[seconds] must be an integer.", param="expires_after") from None
    if not MIN_EXPIRY_S <= value <= MAX_EXPIRY_S:
        raise bad_request(f"expires_after[seconds] must be between {MIN_EXPIRY_S} and {MAX_EXPIRY_S}.",
                          param="expires_after")  # fmt: skip
    return value


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA:
        raise bad_request(f"metadata may have at most {MAX_METADATA} pairs.", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise bad_request("metadata keys may have at most 64 characters and values 512.", param="metadata")
