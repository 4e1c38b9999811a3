"""/v1/files: a tenant's Batch API input files (uploaded as multipart, bounded by MAX_FILE_BYTES as they are read)
and the batches' output files. Every call to the store runs in a thread, never on the event loop."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import BinaryIO

from fastapi import APIRouter, Request
from starlette.responses import FileResponse, Response

from ...config import MAX_FILE_BYTES, MAX_FILES_PER_TENANT, MAX_IDENTIFIER_CHARS
from ..batches import BatchStore, file_object, quota_exceeded
from ..errors import APIError, invalid
from ..middleware.auth import TENANT
from . import documented_errors

router = APIRouter()
FILE_PURPOSES = ("batch",)  # what may be uploaded (outputs are "batch_output")
MULTIPART_FRAMING_BYTES = 64 << 10  # what an upload's multipart framing may add to its file's bytes
_ERRORS = documented_errors(400, 401, 404, 411, 413, 429)
_run = asyncio.to_thread  # the store's calls: SQLite and the disk, off the event loop


def batch_store(request: Request) -> BatchStore:
    """The server's BatchStore; a 404 when the Batch API is off."""
    store = request.app.state.inferd.batches
    if store is None:
        raise APIError(404, "the Batch API is off on this server (start it with --state-dir)",
                       code="batches_disabled")
    return store


def tenant_identity(request: Request) -> str:
    return request.scope[TENANT].identity


def listing(data: list[dict], more: bool) -> dict:
    """OpenAI's paginated list."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


@router.post("/v1/files", response_model=None, responses=_ERRORS)
async def upload(request: Request) -> dict:
    s = batch_store(request)
    length = request.headers.get("content-length")
    if length is None or not length.isdigit():
        raise APIError(411, "an upload needs a Content-Length", code="length_required")
    if int(length) > MAX_FILE_BYTES + MULTIPART_FRAMING_BYTES:
        raise APIError(413, f"the file is over the {MAX_FILE_BYTES}-byte limit (MAX_FILE_BYTES)",
                       code="file_too_large")
    tenant = tenant_identity(request)
    files, used = await _run(lambda: (s.count_files(tenant), s.storage_used(tenant)))
    if files >= MAX_FILES_PER_TENANT:
        raise APIError(429, f"this tenant has {MAX_FILES_PER_TENANT} files, the limit (MAX_FILES_PER_TENANT): "
                       "delete some first", "rate_limit_exceeded", code="too_many_files")
    least = max(0, int(length) - MULTIPART_FRAMING_BYTES)  # the file's bytes are at least this
    if s.storage_quota is not None and used + least > s.storage_quota:
        raise quota_exceeded(s.storage_quota, used, least)  # refused before its body is read
    try:
        form = await request.form(max_files=1, max_fields=8)
    except Exception as e:
        raise invalid(f"the upload must be multipart/form-data with a file and a purpose: {e}") from None
    try:
        purpose, upload_file = form.get("purpose"), form.get("file")
        if purpose not in FILE_PURPOSES:
            raise invalid(f"purpose must be one of {', '.join(FILE_PURPOSES)}, got {purpose!r}", param="purpose")
        if upload_file is None or isinstance(upload_file, str):
            raise invalid("the upload has no file", param="file")
        name = os.path.basename(upload_file.filename or "upload.jsonl")[:MAX_IDENTIFIER_CHARS]
        fd, tmp = tempfile.mkstemp(dir=s.files_dir, prefix=".upload-")  # 0600
        try:
            await _run(_copy_upload, upload_file.file, fd)
            return file_object(await _run(s.add_file, tenant, purpose, name, Path(tmp)))
        finally:
            Path(tmp).unlink(missing_ok=True)
    finally:
        await form.close()


@router.get("/v1/files", response_model=None, responses=_ERRORS)
async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                     limit: int = 100) -> dict:
    rows, more = await _run(batch_store(request).list_files, tenant_identity(request), purpose, after,
                            max(1, min(limit, 10000)))
    return listing([file_object(r) for r in rows], more)


@router.get("/v1/files/{file_id}", response_model=None, responses=_ERRORS)
async def get_file(request: Request, file_id: str) -> dict:
    return file_object(await _run(batch_store(request).get_file, tenant_identity(request), file_id))


@router.get("/v1/files/{file_id}/content", response_model=None, responses=_ERRORS)
async def file_content(request: Request, file_id: str) -> Response:
    s = batch_store(request)
    await _run(s.get_file, tenant_identity(request), file_id)
    path = s.path(file_id)
    if not await _run(path.is_file):  # its bytes lost from the disk (FileResponse would fail it with a 500)
        raise APIError(404, f"the content of {file_id} is gone from the server's storage",
                       "invalid_request_error", param="file_id", code="file_not_found")
    return FileResponse(path, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", response_model=None, responses=_ERRORS)
async def delete_file(request: Request, file_id: str) -> dict:
    await _run(batch_store(request).delete_file, tenant_identity(request), file_id)
    return {"id": file_id, "object": "file", "deleted": True}


def _copy_upload(source: BinaryIO, fd: int) -> None:
    """(In a thread.) The uploaded file into fd, up to MAX_FILE_BYTES (413 past it), flushed to the disk."""
    size = 0
    with os.fdopen(fd, "wb") as out:
        while chunk := source.read(1 << 20):
            size += len(chunk)
            if size > MAX_FILE_BYTES:
                raise APIError(413, f"the file is over the {MAX_FILE_BYTES}-byte limit (MAX_FILE_BYTES)",
                               code="file_too_large")
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
