"""Stamps each HTTP request with what the layers below it read: its receipt time, its request id (the REQUEST_ID
context variable, which error messages name, and the x-request-id response header) and a way to drop its
connection at once."""

from __future__ import annotations

import time

from ..errors import REQUEST_ID, new_request_id

RECEIVED_AT = "inferd.received_at"  # scope key: time.perf_counter() when the request arrived
ABORT_CONNECTION = "inferd.abort_connection"  # scope key: () -> None, drops the client's connection at once


class RequestContext:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[RECEIVED_AT] = time.perf_counter()
        scope[ABORT_CONNECTION] = _connection_aborter(send)
        request_id = new_request_id()
        REQUEST_ID.set(request_id)  # this request's task (and those it starts) see it: error messages name it
        id_header = (b"x-request-id", request_id.encode())

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), id_header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _connection_aborter(send):
    """() -> None that drops the client's TCP connection without flushing (a client that reads nothing would keep a
    closed-but-unflushed socket forever), where the server's send exposes its transport (uvicorn's does); else
    None."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    abort = getattr(transport, "abort", None)
    return abort if callable(abort) else None
