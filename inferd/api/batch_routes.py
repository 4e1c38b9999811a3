"""The routes of the Batch API (/v1/files, /v1/batches) and how a batch line runs: the API process's own path for a
request (validation, tokenization, admission in the batch tier, a run on a worker), without HTTP. Every call to the
store and every parse of a line runs in a thread (asyncio.to_thread), never on the event loop."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from fastapi import FastAPI, Request
from typing import Annotated, BinaryIO

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError
from starlette.responses import Response

from ..config import BATCH_RETENTION_S, BATCH_STORAGE_PER_TENANT, MAX_FILE_BYTES, MAX_FILES_PER_TENANT, \
    MAX_IDENTIFIER_CHARS, TIERS
from ..gateway.admission import RateLimited
from ..gateway.tenants import ANONYMOUS_TENANT, DEFAULT_TENANT, Tenant
from .batch_runner import BatchRunner, LineOutcome
from .batches import BATCH_ENDPOINTS, BatchStore, batch_object, file_object, quota_exceeded
from .errors import APIError, invalid, validation_error
from .schemas import ChatCompletionRequest, CompletionRequest
from .serving import complete, worker_error

BATCH_BAND = TIERS.index("batch")
FILE_PURPOSES = ("batch",)  # what may be uploaded (outputs are "batch_output")
MULTIPART_FRAMING_BYTES = 64 << 10  # what an upload's multipart framing may add to its file's bytes
# the 429s that say "busy" (the tenant's rate or concurrency limits, its share of the waiting line): a batch line
# that gets one runs again later; every other 429 (request_too_large: over the tenant's whole quota) can never
# succeed, and is the line's result
BUSY_429_CODES = ("rate_limit_exceeded", "queue_share_exceeded")


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: StrictStr = Field(max_length=64)
    endpoint: StrictStr
    completion_window: StrictStr = "24h"
    metadata: Annotated[dict[StrictStr, Annotated[StrictStr, Field(max_length=512)]], Field(max_length=16)] | None = None


def tenant_by_identity(state, identity: str) -> Tenant | None:
    """The tenant a stored identity names, as the server now knows it: a built-in tenant only while the server has
    it (anonymous: no keys; default: --api-key), a keys-file tenant only while the keys file holds it."""
    if identity == ANONYMOUS_TENANT.identity:
        return ANONYMOUS_TENANT if not state.authenticates else None
    if identity == DEFAULT_TENANT.identity:
        return DEFAULT_TENANT if state.api_key is not None else None
    kind, _, name = identity.partition(":")
    if kind == "key" and state.keys is not None:
        return state.keys.tenants.get(name)
    return None


def outcome_of(error: APIError) -> LineOutcome:
    """An error answer as a line's outcome: retried only when it says "busy"; a 503 is busy for every tenant (the
    service saturated or not ready), a busy 429 for the line's tenant alone."""
    busy = error.status == 503 or (error.status == 429 and error.code in BUSY_429_CODES)
    retry_after = None
    if busy and error.headers and str(error.headers.get("Retry-After", "")).isdigit():
        retry_after = float(error.headers["Retry-After"])
    return LineOutcome(error.status, error.body(), retry=busy, retry_after=retry_after,
                       service_busy=error.status == 503)


def _parse_body(model, body: str):
    """(In a thread.) A line's body (JSON text of at most --max-body-bytes) validated as model's request."""
    try:
        return model.model_validate(json.loads(body))
    except ValidationError as e:
        raise validation_error(e.errors()) from None


async def execute_line(state, identity: str, endpoint: str, body: str) -> LineOutcome:
    """One batch line as the API would answer it: (status, body); retry=True when the service was busy (the line
    runs again later). Its admission is the tenant's (quota, fair share, the line) in the batch tier."""
    from .app import _cache_salt, _end, _rate_limited

    tenant = tenant_by_identity(state, identity)
    try:
        if tenant is None:
            raise APIError(401, "the batch's tenant no longer exists", code="tenant_gone")
        if endpoint == "/v1/embeddings":
            return await _embed_line(state, tenant, body)
        model = ChatCompletionRequest if endpoint == "/v1/chat/completions" else CompletionRequest
        req = await asyncio.to_thread(_parse_body, model, body)
        if req.stream:
            raise invalid("stream is not allowed in a batch", param="stream")
        serving = state.require_serving()
        prep = await serving.prepare(req, time.perf_counter(), tenant.allow_grammar)
        band = max(tenant.band, BATCH_BAND)
        salt = _cache_salt(tenant)
        ticket = await state.gateway.admit(tenant, band, prep.prompt_tokens, prep.reserved_tokens, None,
                                           prompt=prep.prompts[0], num_seqs=len(prep.params), cache_salt=salt)
        for params in prep.params:
            params.cache_salt = salt
        run = serving.start(prep)
        run.on_tokens = ticket.on_output
        run.rebind = ticket.rebind
        run.on_done = lambda: _end(state, ticket, run)
        try:
            worker = ticket.worker or await ticket.wait()
            run.dispatch(worker, band, ticket.queue_seconds)
            return LineOutcome(200, await complete(run))
        finally:
            run.close()  # synchronous and idempotent: the ticket is released whatever happened
    except APIError as e:
        return outcome_of(e)
    except RateLimited as e:
        return outcome_of(_rate_limited(e))
    except Exception as e:  # the gateway's refusals (overloaded, ...) and worker failures
        return outcome_of(worker_error(e))


async def _embed_line(state, tenant: Tenant, body: str) -> LineOutcome:
    from .app import _cache_salt, embedding_service
    from .embeddings import EmbeddingRequest

    req = await asyncio.to_thread(_parse_body, EmbeddingRequest, body)
    service = embedding_service(state, req.model)
    out = await service.create(req, tenant, max(tenant.band, BATCH_BAND), None, _cache_salt(tenant))
    return LineOutcome(200, out)


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


def install_batch_routes(app: FastAPI, state) -> None:
    from .app import TENANT, _errors

    files_errors = _errors(400, 401, 404, 411, 413, 429)
    batch_errors = _errors(400, 401, 404, 409, 413, 429)
    run = asyncio.to_thread  # the store's calls: SQLite and the disk, off the event loop

    def store() -> BatchStore:
        if state.batches is None:
            raise APIError(404, "the Batch API is off on this server (start it with --state-dir)",
                           code="batches_disabled")
        return state.batches

    def tenant_of(request: Request) -> str:
        return request.scope[TENANT].identity

    @app.post("/v1/files", response_model=None, responses=files_errors)
    async def upload(request: Request) -> dict:
        s = store()
        length = request.headers.get("content-length")
        if length is None or not length.isdigit():
            raise APIError(411, "an upload needs a Content-Length", code="length_required")
        if int(length) > MAX_FILE_BYTES + MULTIPART_FRAMING_BYTES:
            raise APIError(413, f"the file is over the {MAX_FILE_BYTES}-byte limit (MAX_FILE_BYTES)",
                           code="file_too_large")
        tenant = tenant_of(request)
        files, used = await run(lambda: (s.count_files(tenant), s.storage_used(tenant)))
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
                await run(_copy_upload, upload_file.file, fd)
                return file_object(await run(s.add_file, tenant, purpose, name, Path(tmp)))
            finally:
                Path(tmp).unlink(missing_ok=True)
        finally:
            await form.close()

    @app.get("/v1/files", response_model=None, responses=files_errors)
    async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                         limit: int = 100) -> dict:
        rows, more = await run(store().list_files, tenant_of(request), purpose, after, max(1, min(limit, 10000)))
        return _listing([file_object(r) for r in rows], more)

    @app.get("/v1/files/{file_id}", response_model=None, responses=files_errors)
    async def get_file(request: Request, file_id: str) -> dict:
        return file_object(await run(store().get_file, tenant_of(request), file_id))

    @app.get("/v1/files/{file_id}/content", response_model=None, responses=files_errors)
    async def file_content(request: Request, file_id: str) -> Response:
        s = store()
        await run(s.get_file, tenant_of(request), file_id)
        from starlette.responses import FileResponse

        path = s.path(file_id)
        if not await run(path.is_file):  # its bytes lost from the disk (FileResponse would fail it with a 500)
            raise APIError(404, f"the content of {file_id} is gone from the server's storage",
                           "invalid_request_error", param="file_id", code="file_not_found")
        return FileResponse(path, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}", response_model=None, responses=files_errors)
    async def delete_file(request: Request, file_id: str) -> dict:
        await run(store().delete_file, tenant_of(request), file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches", response_model=None, responses=batch_errors)
    async def create_batch(body: CreateBatchRequest, request: Request) -> dict:
        s = store()
        tenant = tenant_of(request)
        if body.endpoint not in BATCH_ENDPOINTS:
            raise invalid(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {body.endpoint!r}",
                          param="endpoint")
        if body.endpoint == "/v1/embeddings" and not state.embeddings:
            raise invalid("this server serves no embedding model (start it with --embedding-model)",
                          param="endpoint")
        f = await run(s.get_file, tenant, body.input_file_id)
        if f["purpose"] != "batch":
            raise invalid(f"the file {f['id']} has purpose {f['purpose']!r}, not 'batch'", param="input_file_id")
        row = await run(s.create_batch, tenant, body.endpoint, body.input_file_id, body.completion_window,
                        body.metadata)
        state.batch_runner.wake()
        return batch_object(row)

    @app.get("/v1/batches/{batch_id}", response_model=None, responses=batch_errors)
    async def get_batch(request: Request, batch_id: str) -> dict:
        return batch_object(await run(store().get_batch, tenant_of(request), batch_id))

    @app.get("/v1/batches", response_model=None, responses=batch_errors)
    async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> dict:
        rows, more = await run(store().list_batches, tenant_of(request), after, max(1, min(limit, 100)))
        return _listing([batch_object(r) for r in rows], more)

    @app.post("/v1/batches/{batch_id}/cancel", response_model=None, responses=batch_errors)
    async def cancel_batch(request: Request, batch_id: str) -> dict:
        s = store()
        row = await run(s.get_batch, tenant_of(request), batch_id)
        if row["status"] in ("validating", "in_progress"):
            await run(s.set_status, batch_id, "cancelling", ("validating", "in_progress"))
            state.batch_runner.wake()
        elif row["status"] not in ("cancelling", "cancelled"):
            raise APIError(409, f"the batch is {row['status']} and can no longer be cancelled",
                           code="batch_not_cancellable")
        return batch_object(await run(s.get_batch, None, batch_id))


def _listing(data: list[dict], more: bool) -> dict:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


async def start_batches(state, state_dir: str, concurrency: int,
                        storage_quota: int | None = BATCH_STORAGE_PER_TENANT,
                        retention_s: float | None = BATCH_RETENTION_S) -> None:
    """The store (opened in a thread: a database from before may be vacuumed once) and its runner, on the running
    event loop. Batch lines are bounded like HTTP bodies (state.max_body_bytes); lines are counted in
    inferd_batch_lines_total by outcome."""
    state.batches = await asyncio.to_thread(BatchStore, state_dir, storage_quota)

    async def execute(identity: str, endpoint: str, body: str) -> LineOutcome:
        return await execute_line(state, identity, endpoint, body)

    lines = state.metrics.batch_lines
    state.batch_runner = BatchRunner(state.batches, execute, concurrency,
                                     interactive_busy=lambda: state.gateway.busy_above(BATCH_BAND),
                                     max_line_bytes=state.max_body_bytes, retention_s=retention_s,
                                     count=lambda outcome, n: lines.labels(outcome).inc(n),
                                     tenant_exists=lambda identity: tenant_by_identity(state, identity) is not None)
    state.batch_runner.start()
