"""A server without API keys serves loopback clients only, so a browser page whose name resolves to 127.0.0.1 (DNS
rebinding) must not reach it: its requests carry that name as Host, which is refused here with a 403. The admin API
has its own key and is not concerned."""

from __future__ import annotations

import ipaddress

from ..errors import APIError, response_for


class LoopbackOnly:
    """state: the ServerState (whether it authenticates is read per request)."""

    def __init__(self, app, state):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.state.authenticates or scope["path"].startswith("/admin/"):
            return await self.app(scope, receive, send)
        host = _host_name(scope)
        if host is not None and not _loopback_name(host):
            error = APIError(403, f"this server has no API keys and serves loopback clients only; the Host "
                             f"{host!r} is not a loopback name", "permission_error", code="host_not_allowed")
            return await response_for(scope["path"], error)(scope, receive, send)
        await self.app(scope, receive, send)


def _host_name(scope) -> str | None:
    """The Host header's name, without the port and the IPv6 brackets (None: no Host header, HTTP/1.0)."""
    raw = next((v for k, v in scope["headers"] if k == b"host"), None)
    if raw is None:
        return None
    host = raw.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _loopback_name(host: str) -> bool:
    if host in ("localhost", "localhost.") or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # [::ffff:127.0.0.1]: Python 3.11 does not call it loopback
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)
