"""/v1/batches: create, look up, list and cancel a tenant's batches (their lines run in inferd/api/batch_runner.py,
each through inferd/api/batch_lines.py). Every call to the store runs in a thread, never on the event loop."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from ..batches import BATCH_ENDPOINTS, batch_object
from ..errors import APIError, invalid
from . import documented_errors
from .files import batch_store, listing, tenant_identity

router = APIRouter()
_ERRORS = documented_errors(400, 401, 404, 409, 413, 429)
_run = asyncio.to_thread  # the store's calls: SQLite and the disk, off the event loop


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: StrictStr = Field(max_length=64)
    endpoint: StrictStr
    completion_window: StrictStr = "24h"
    metadata: (Annotated[dict[StrictStr, Annotated[StrictStr, Field(max_length=512)]], Field(max_length=16)]
               | None) = None


@router.post("/v1/batches", response_model=None, responses=_ERRORS)
async def create_batch(body: CreateBatchRequest, request: Request) -> dict:
    state = request.app.state.inferd
    s = batch_store(request)
    tenant = tenant_identity(request)
    if body.endpoint not in BATCH_ENDPOINTS:
        raise invalid(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {body.endpoint!r}",
                      param="endpoint")
    if body.endpoint == "/v1/embeddings" and not state.embeddings:
        raise invalid("this server serves no embedding model (start it with --embedding-model)",
                      param="endpoint")
    f = await _run(s.get_file, tenant, body.input_file_id)
    if f["purpose"] != "batch":
        raise invalid(f"the file {f['id']} has purpose {f['purpose']!r}, not 'batch'", param="input_file_id")
    row = await _run(s.create_batch, tenant, body.endpoint, body.input_file_id, body.completion_window,
                     body.metadata)
    state.batch_runner.wake()
    return batch_object(row)


@router.get("/v1/batches/{batch_id}", response_model=None, responses=_ERRORS)
async def get_batch(request: Request, batch_id: str) -> dict:
    return batch_object(await _run(batch_store(request).get_batch, tenant_identity(request), batch_id))


@router.get("/v1/batches", response_model=None, responses=_ERRORS)
async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> dict:
    rows, more = await _run(batch_store(request).list_batches, tenant_identity(request), after,
                            max(1, min(limit, 100)))
    return listing([batch_object(r) for r in rows], more)


@router.post("/v1/batches/{batch_id}/cancel", response_model=None, responses=_ERRORS)
async def cancel_batch(request: Request, batch_id: str) -> dict:
    s = batch_store(request)
    row = await _run(s.get_batch, tenant_identity(request), batch_id)
    if row["status"] in ("validating", "in_progress"):
        await _run(s.set_status, batch_id, "cancelling", ("validating", "in_progress"))
        request.app.state.inferd.batch_runner.wake()
    elif row["status"] not in ("cancelling", "cancelled"):
        raise APIError(409, f"the batch is {row['status']} and can no longer be cancelled",
                       code="batch_not_cancellable")
    return batch_object(await _run(s.get_batch, None, batch_id))
