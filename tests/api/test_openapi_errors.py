"""The OpenAPI document declares the error statuses a route can answer: a client generated from it (or schemathesis'
status_code_conformance) must not meet an undeclared 429. Built in-process from the app's own routers."""

from __future__ import annotations

from fastapi import FastAPI

from inferd.api.app import ROUTERS


def _openapi() -> dict:
    app = FastAPI()
    for group in ROUTERS:
        app.include_router(group.router)
    return app.openapi()


def test_routes_that_charge_the_tenants_limits_document_429():
    paths = _openapi()["paths"]
    # /tokenize counts against the tenant's request rate; generations against its rate, tokens and queue share
    for path in ("/tokenize", "/v1/completions", "/v1/chat/completions"):
        assert "429" in paths[path]["post"]["responses"], path
