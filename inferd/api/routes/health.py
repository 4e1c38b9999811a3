"""/health (the process answers), /ready (a request would be served now, else 503 with why) and /metrics
(Prometheus; per-tenant series only for those who may see them: inferd/api/middleware/auth.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from ..middleware.auth import TENANT_DETAIL
from ..refusals import not_ready
from ..schemas import HealthResponse
from . import documented_errors

router = APIRouter()


@router.get("/health", response_model=HealthResponse, response_model_exclude_none=True)
async def health() -> dict:
    return {"status": "ok"}


@router.get("/ready", response_model=HealthResponse, response_model_exclude_none=True,
            responses=documented_errors(503))
async def ready(request: Request) -> dict:
    reason = request.app.state.inferd.not_ready_reason()
    if reason is not None:
        raise not_ready(reason)
    return {"status": "ready"}


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    rendered = request.app.state.inferd.metrics.render(tenants=request.scope[TENANT_DETAIL])
    return Response(rendered, media_type=CONTENT_TYPE_LATEST)
