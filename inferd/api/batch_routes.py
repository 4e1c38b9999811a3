"""The routes of the Batch API (/v1/files, /v1/batches) and how a batch line runs: the API process's own path for a
request (validation, tokenization, admission in the batch tier, a run on a worker), without HTTP."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from fastapi import FastAPI, Request
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError
from starlette.responses import Response

from ..config import MAX_FILE_BYTES, MAX_FILES_PER_TENANT, MAX_IDENTIFIER_CHARS, TIERS
from ..gateway.admission import RateLimited
from ..gateway.tenants import ANONYMOUS, Tenant
from .batches import BATCH_ENDPOINTS, BatchRunner, BatchStore, LineOutcome, batch_object, file_object
from .errors import APIError, invalid, validation_error
from .schemas import ChatCompletionRequest, CompletionRequest
from .serving import complete, worker_error

BATCH_BAND = TIERS.index("batch")
FILE_PURPOSES = ("batch",)  # what may be uploaded (outputs are "batch_output")


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: StrictStr = Field(max_length=64)
    endpoint: StrictStr
    completion_window: StrictStr = "24h"
    metadata: Annotated[dict[StrictStr, Annotated[StrictStr, Field(max_length=512)]], Field(max_length=16)] | None = None


def _tenant_named(state, name: str) -> Tenant | None:
    from .app import _ANONYMOUS, DEFAULT_TENANT

    if name == ANONYMOUS:
        return _ANONYMOUS
    if name == DEFAULT_TENANT.name and state.api_key is not None:
        return DEFAULT_TENANT
    if state.keys is not None:
        return state.keys.tenants.get(name)
    return None


async def execute_line(state, tenant_name: str, endpoint: str, body: dict) -> LineOutcome:
    """One batch line as the API would answer it: (status, body); retry=True when the service was busy (the line
    runs again later). Its admission is the tenant's (quota, fair share, the line) in the batch tier."""
    from .app import _cache_salt, _end

    tenant = _tenant_named(state, tenant_name)
    try:
        if tenant is None:
            raise APIError(401, f"the batch's tenant {tenant_name!r} no longer exists", code="tenant_gone")
        if endpoint == "/v1/embeddings":
            return await _embed_line(state, tenant, body)
        model = ChatCompletionRequest if endpoint == "/v1/chat/completions" else CompletionRequest
        try:
            req = model.model_validate(body)
        except ValidationError as e:
            raise validation_error(e.errors()) from None
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
        return LineOutcome(e.status, e.body(), retry=e.status in (429, 503))
    except RateLimited as e:
        return LineOutcome(429, {"error": {"message": e.message, "type": "rate_limit_exceeded", "param": None,
                                           "code": "rate_limit_exceeded"}}, retry=True)
    except Exception as e:  # the gateway's refusals (overloaded, ...) and worker failures
        error = worker_error(e)
        return LineOutcome(error.status, error.body(), retry=error.status in (429, 503))


async def _embed_line(state, tenant: Tenant, body: dict) -> LineOutcome:
    from .app import _cache_salt, embedding_service
    from .embeddings import EmbeddingRequest

    try:
        req = EmbeddingRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    service = embedding_service(state, req.model)
    out = await service.create(req, tenant, max(tenant.band, BATCH_BAND), None, _cache_salt(tenant))
    return LineOutcome(200, out)


def install_batch_routes(app: FastAPI, state) -> None:
    from .app import TENANT, _errors

    files_errors = _errors(400, 401, 404, 411, 413, 429)
    batch_errors = _errors(400, 401, 404, 409, 413, 429)

    def store() -> BatchStore:
        if state.batches is None:
            raise APIError(404, "the Batch API is off on this server (start it with --state-dir)",
                           code="batches_disabled")
        return state.batches

    def tenant_of(request: Request) -> str:
        return request.scope[TENANT].name

    @app.post("/v1/files", response_model=None, responses=files_errors)
    async def upload(request: Request) -> dict:
        s = store()
        length = request.headers.get("content-length")
        if length is None or not length.isdigit():
            raise APIError(411, "an upload needs a Content-Length", code="length_required")
        if int(length) > MAX_FILE_BYTES + (64 << 10):  # the multipart framing around the file
            raise APIError(413, f"the file is over the {MAX_FILE_BYTES}-byte limit (MAX_FILE_BYTES)",
                           code="file_too_large")
        tenant = tenant_of(request)
        if s.count_files(tenant) >= MAX_FILES_PER_TENANT:
            raise APIError(429, f"this tenant has {MAX_FILES_PER_TENANT} files, the limit (MAX_FILES_PER_TENANT): "
                           "delete some first", "rate_limit_exceeded", code="too_many_files")
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
            fd, tmp = tempfile.mkstemp(dir=s.files_dir, prefix=".upload-")
            size = 0
            try:
                with os.fdopen(fd, "wb") as out:
                    while chunk := await upload_file.read(1 << 20):
                        size += len(chunk)
                        if size > MAX_FILE_BYTES:
                            raise APIError(413, f"the file is over the {MAX_FILE_BYTES}-byte limit (MAX_FILE_BYTES)",
                                           code="file_too_large")
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                return file_object(s.add_file(tenant, purpose, name, Path(tmp)))
            finally:
                Path(tmp).unlink(missing_ok=True)
        finally:
            await form.close()

    @app.get("/v1/files", response_model=None, responses=files_errors)
    async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                         limit: int = 100) -> dict:
        rows, more = store().list_files(tenant_of(request), purpose, after, max(1, min(limit, 10000)))
        return _listing([file_object(r) for r in rows], more)

    @app.get("/v1/files/{file_id}", response_model=None, responses=files_errors)
    async def get_file(request: Request, file_id: str) -> dict:
        return file_object(store().get_file(tenant_of(request), file_id))

    @app.get("/v1/files/{file_id}/content", response_model=None, responses=files_errors)
    async def file_content(request: Request, file_id: str) -> Response:
        s = store()
        s.get_file(tenant_of(request), file_id)
        from starlette.responses import FileResponse

        return FileResponse(s.path(file_id), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}", response_model=None, responses=files_errors)
    async def delete_file(request: Request, file_id: str) -> dict:
        store().delete_file(tenant_of(request), file_id)
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
        f = s.get_file(tenant, body.input_file_id)
        if f["purpose"] != "batch":
            raise invalid(f"the file {f['id']} has purpose {f['purpose']!r}, not 'batch'", param="input_file_id")
        row = s.create_batch(tenant, body.endpoint, body.input_file_id, body.completion_window, body.metadata)
        state.batch_runner.wake()
        return batch_object(row)

    @app.get("/v1/batches/{batch_id}", response_model=None, responses=batch_errors)
    async def get_batch(request: Request, batch_id: str) -> dict:
        return batch_object(store().get_batch(tenant_of(request), batch_id))

    @app.get("/v1/batches", response_model=None, responses=batch_errors)
    async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> dict:
        rows, more = store().list_batches(tenant_of(request), after, max(1, min(limit, 100)))
        return _listing([batch_object(r) for r in rows], more)

    @app.post("/v1/batches/{batch_id}/cancel", response_model=None, responses=batch_errors)
    async def cancel_batch(request: Request, batch_id: str) -> dict:
        s = store()
        row = s.get_batch(tenant_of(request), batch_id)
        if row["status"] in ("validating", "in_progress"):
            s.set_status(batch_id, "cancelling", ("validating", "in_progress"))
            state.batch_runner.wake()
        elif row["status"] not in ("cancelling", "cancelled"):
            raise APIError(409, f"the batch is {row['status']} and can no longer be cancelled",
                           code="batch_not_cancellable")
        return batch_object(s.get_batch(None, batch_id))


def _listing(data: list[dict], more: bool) -> dict:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def start_batches(state, state_dir: str, concurrency: int) -> None:
    """The store and its runner (on the running event loop)."""
    state.batches = BatchStore(state_dir)

    async def execute(tenant_name: str, endpoint: str, body: dict) -> LineOutcome:
        return await execute_line(state, tenant_name, endpoint, body)

    state.batch_runner = BatchRunner(state.batches, execute, concurrency,
                                     interactive_busy=lambda: state.gateway.busy_above(BATCH_BAND))
    state.batch_runner.start()
