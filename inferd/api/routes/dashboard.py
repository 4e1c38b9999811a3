"""/dashboard (the page: inferd/api/dashboard.py) and /dashboard/data (the JSON it polls); neither is in the OpenAPI
document."""

from __future__ import annotations

import functools
import json
import math

from fastapi import APIRouter, Request
from starlette.responses import Response

from ...config import DASHBOARD_WINDOWS_S, DEFAULT_DASHBOARD_WINDOW_S
from ..dashboard import page_html, page_policy
from ..errors import invalid
from ..middleware.auth import TENANT_DETAIL

router = APIRouter()


@functools.cache
def _page() -> tuple[str, str]:
    """The page and its Content-Security-Policy (the hashes of its inline script and style), made once."""
    page = page_html()
    return page, page_policy(page)


@router.get("/dashboard", include_in_schema=False)
async def dashboard() -> Response:
    page, policy = _page()
    return Response(page, media_type="text/html; charset=utf-8", headers={
        "Cache-Control": "no-store", "Content-Security-Policy": policy, "X-Frame-Options": "DENY",
        "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})


@router.get("/dashboard/data", include_in_schema=False)
async def dashboard_data(request: Request, window: float = DEFAULT_DASHBOARD_WINDOW_S) -> Response:
    if not 0 < window <= max(DASHBOARD_WINDOWS_S):
        raise invalid(f"window must be in (0, {max(DASHBOARD_WINDOWS_S):g}] seconds, got {window:g}",
                      param="window")
    view = request.app.state.inferd.dashboard.view(window, tenants=request.scope[TENANT_DETAIL])
    return Response(json.dumps(_finite(view), separators=(",", ":")),
                    media_type="application/json", headers={"Cache-Control": "no-store"})


def _finite(value):
    """JSON has no NaN or infinity: such a number becomes null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
