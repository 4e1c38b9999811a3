"""Gateway test helpers: a keys file with tenants, requests with a tenant's key."""

from __future__ import annotations

from pathlib import Path

import httpx

from inferd.gateway.tenants import create_key


def make_keys(path: Path, tenants: dict[str, dict]) -> dict[str, str]:
    """Creates one key per tenant (settings: tier, rpm, tpm, max_concurrency, weight); returns tenant -> key."""
    return {name: create_key(str(path), name, **settings)[0] for name, settings in tenants.items()}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def completion(server, key: str, prompt, max_tokens: int, headers: dict | None = None, timeout: float = 60.0,
               **extra) -> httpx.Response:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, headers={**bearer(key), **(headers or {})},
                      timeout=timeout)
