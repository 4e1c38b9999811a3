"""The HTTP routes, one APIRouter per group of endpoints, each thin: parse (FastAPI and the schemas), call the
service that does the work, map its errors. inferd/api/app.py's build_app includes them all."""

from __future__ import annotations

from ..schemas import ErrorResponse


def documented_errors(*codes: int) -> dict:
    """The OpenAPI `responses` of these error statuses (OpenAI's error shape)."""
    return {code: {"model": ErrorResponse} for code in codes}
