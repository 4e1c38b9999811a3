"""How one Batch API input line runs: the API process's own path for a request (validation, tokenization, then the
generation service: admission in the batch tier, a run on a worker, the release), without HTTP; and the Batch API's
start (its store and runner). Every parse of a line runs in a thread (asyncio.to_thread), never on the event
loop."""

from __future__ import annotations

import asyncio
import json
import time

from pydantic import ValidationError

from ..config import BATCH_RETENTION_S, BATCH_STORAGE_PER_TENANT, TIERS
from ..gateway.tenants import ANONYMOUS_TENANT, DEFAULT_TENANT, Tenant
from .batch_runner import BatchRunner, LineOutcome
from .batches import BatchStore
from .embeddings import EmbeddingRequest, embedding_model
from .errors import APIError, invalid, validation_error
from .refusals import worker_error
from .schemas import ChatCompletionRequest, CompletionRequest

BATCH_TIER_RANK = TIERS.index("batch")
# the 429s that say "busy" (the tenant's rate or concurrency limits, its share of the queue): a batch line that gets
# one runs again later; every other 429 (request_too_large: over the tenant's whole quota) can never succeed, and is
# the line's result
BUSY_429_CODES = ("rate_limit_exceeded", "queue_share_exceeded")


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
    runs again later). Its admission is the tenant's (quota, fair share, the queue) in the batch tier."""
    tenant = tenant_by_identity(state, identity)
    try:
        if tenant is None:
            raise APIError(401, "the batch's tenant no longer exists", code="tenant_gone")
        tier_rank = max(tenant.tier_rank, BATCH_TIER_RANK)
        if endpoint == "/v1/embeddings":
            req = await asyncio.to_thread(_parse_body, EmbeddingRequest, body)
            model = embedding_model(state, req.model)
            return LineOutcome(200, await state.generation.embed(model, req, tenant, tier_rank, None))
        schema = ChatCompletionRequest if endpoint == "/v1/chat/completions" else CompletionRequest
        req = await asyncio.to_thread(_parse_body, schema, body)
        if req.stream:
            raise invalid("stream is not allowed in a batch", param="stream")
        prep = await state.require_serving().prepare(req, time.perf_counter(), tenant.allow_grammar, tenant)
        return LineOutcome(200, await state.generation.collect(prep, tenant, tier_rank))
    except Exception as e:  # an APIError as it is; the gateway's refusals (overloaded, ...) and worker failures
        return outcome_of(worker_error(e))


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
                                     interactive_busy=lambda: state.gateway.busy_above(BATCH_TIER_RANK),
                                     max_line_bytes=state.max_body_bytes, retention_s=retention_s,
                                     count=lambda outcome, n: lines.labels(outcome).inc(n),
                                     tenant_exists=lambda identity: tenant_by_identity(state, identity) is not None)
    state.batch_runner.start()
