"""The FastAPI app: build_app assembles the routers (inferd/api/routes/, one per group of endpoints), the error
handlers, the OpenAPI document and the ASGI middleware (inferd/api/middleware/, one job per piece) over the server's
state.

This process never runs the model: generation goes through the gateway to worker processes.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .dashboard import Dashboard
from .errors import install_error_handlers
from .middleware.auth import Authentication
from .middleware.body import BodyLimit
from .middleware.loopback import LoopbackOnly
from .middleware.request_context import RequestContext
from .middleware.request_counter import RequestCounter
from .routes import (
    admin,
    batches,
    dashboard,
    embeddings,
    files,
    generation,
    health,
    lora,
    messages,
    models,
    responses,
    tokenize,
)
from .state import ServerState

ROUTERS = (files, batches, generation, responses, messages, embeddings, models, lora, tokenize, health, dashboard,
           admin)


def build_app(state: ServerState):
    """The ASGI application of the API process over `state`."""
    app = FastAPI(title="inferd", version="0.1.0", description="OpenAI-compatible LLM inference",
                  docs_url="/docs", redoc_url=None)
    app.state.inferd = state
    install_error_handlers(app)
    for group in ROUTERS:
        app.include_router(group.router)
    if state.dashboard is None:
        state.dashboard = Dashboard(state)
        state.dashboard.sample()  # before any request: the growth of a histogram since then is all of it
    _install_openapi(app)
    # outermost first; the order decides which error a client sees first: a missing key (401) before a foreign Host
    # (403) before a body too large (413) or not Unicode (400)
    inner = BodyLimit(app, state)
    inner = LoopbackOnly(inner, state)
    inner = Authentication(inner, state)
    inner = RequestCounter(inner, state.metrics)
    return RequestContext(inner)


def _install_openapi(app: FastAPI) -> None:
    """FastAPI documents a 422 for every body; inferd answers invalid bodies with 400 (OpenAI's code)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
