"""Who is asking: resolves the request's API key to its tenant (scope[TENANT]), checks the admin key on /admin/...
and the metrics key on /metrics and /dashboard/data (which also decides who sees per-tenant figures:
scope[TENANT_DETAIL]). A missing or refused key is a 401, after which the connection is closed: a client without a
key has no reason to keep one (and a place).

A tenant's key comes as `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's); both at
once must name the same key, else 401: which tenant pays must never depend on which header a proxy added. The admin
and metrics keys are Bearer only."""

from __future__ import annotations

import hmac

from ...gateway.tenants import ANONYMOUS_TENANT, DEFAULT_TENANT, AuthError
from ..errors import APIError, response_for
from ..http_limits import CLOSE_AFTER_RESPONSE

TENANT = "inferd.tenant"  # scope key: the Tenant the request's key belongs to
TENANT_DETAIL = "inferd.tenant_detail"  # scope key: this request may see per-tenant metrics
PUBLIC_PATHS = ("/health", "/ready", "/metrics", "/dashboard", "/dashboard/data", "/openapi.json", "/docs",
                "/docs/oauth2-redirect")
METRICS_PATHS = ("/metrics", "/dashboard/data")


class Authentication:
    """state: the ServerState (its keys are read per request: a reloaded keys file takes effect at once)."""

    def __init__(self, app, state):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        error = self._check(scope, path)
        if error is None:
            return await self.app(scope, receive, send)
        if error.status == 401:  # a client without a key has no reason to keep a connection (and a place)
            scope[CLOSE_AFTER_RESPONSE] = True
        await response_for(path, error)(scope, receive, send)

    def _check(self, scope, path: str) -> APIError | None:
        state = self.state
        if path in METRICS_PATHS:
            # aggregates are open unless --metrics-key is set; who the tenants are and what they use is not: it
            # needs the metrics or the admin key (on a server without API keys, loopback clients all see it)
            keyed = any(key is not None and bearer_matches(scope, key) for key in (state.metrics_key,
                                                                                 state.admin_key))
            if state.metrics_key is not None and not keyed:
                return _unauthorized(f"{path} needs the metrics key: 'Authorization: Bearer METRICS_KEY'")
            scope[TENANT_DETAIL] = keyed or not state.authenticates
            return None
        if path.startswith("/admin/") or path in ADMIN_PATHS:
            return self._check_admin_key(scope)
        if not state.authenticates:
            scope[TENANT] = ANONYMOUS_TENANT
            return None
        if path in PUBLIC_PATHS:
            return None
        given, error = _tenant_key(scope)
        if error is not None:
            return error
        if state.api_key is not None and hmac.compare_digest(given.encode(), state.api_key.encode()):
            scope[TENANT] = DEFAULT_TENANT
            return None
        if state.keys is None:
            return _unauthorized("Incorrect API key provided")
        try:
            scope[TENANT] = state.keys.authenticate(given)
        except AuthError as e:
            return _unauthorized(str(e))
        return None

    def _check_admin_key(self, scope) -> APIError | None:
        """The admin API has its own key (--admin-key): a tenant's key never opens it."""
        admin_key = self.state.admin_key
        if admin_key is None:
            return APIError(403, "the admin API is disabled: start the server with --admin-key (or "
                            "$INFERD_ADMIN_KEY)", "permission_error", code="admin_disabled")
        if not bearer_matches(scope, admin_key):
            return _unauthorized("the admin API needs the admin key: 'Authorization: Bearer ADMIN_KEY'")
        return None


# admin operations at vLLM's paths (the official clients and scripts call them there)
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def bearer_matches(scope, key: str) -> bool:
    auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
    scheme, _, given = auth.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def _tenant_key(scope) -> tuple[str, APIError | None]:
    """The tenant key a request gives: (key, None), or ("", the 401) when it gives none or two different ones."""
    auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
    scheme, _, bearer = auth.partition(" ")
    bearer = bearer.strip() if scheme.lower() == "bearer" else ""
    x_api_key = next((v for k, v in scope["headers"] if k == b"x-api-key"), b"").decode("latin-1").strip()
    if bearer and x_api_key and not hmac.compare_digest(bearer.encode(), x_api_key.encode()):
        return "", _unauthorized("The request gives two different API keys ('Authorization: Bearer' and 'x-api-key'): "
                                 "send one")
    if not (bearer or x_api_key):
        return "", _unauthorized("You didn't provide an API key: send it as 'Authorization: Bearer KEY' or "
                                 "'x-api-key: KEY'")
    return bearer or x_api_key, None


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
