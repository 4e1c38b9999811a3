"""The API process's HTTP connection limits, on top of uvicorn's httptools protocol. What one client can hold:

- **A request head** must arrive whole within `head_timeout` of the connection's start, and a kept-alive
  connection's next head within the keep-alive time of the previous response's end (and `head_timeout` of its
  first byte). Bytes that start nothing (blank lines between requests) never extend either: uvicorn's own keep-alive
  timer is reset by any byte, which let a trickle hold a connection forever. Heads over `max_head_bytes`: 431.
- **A request body** must keep coming: it has `body_timeout` seconds plus one second per `min_body_rate` bytes
  received so far (a client sending at least that rate never times out; one byte every 2 s does at once). Past
  it: 408 if nothing was answered yet, and the connection is closed.
- **A response sent before its request's body was read** (401, 413, ...) closes the connection, and so does any
  401: reading on would only let a client without a key keep it open. The close lingers (our side's FIN, then what
  still arrives is discarded for up to `HTTP_LINGER_S`): closing a socket with unread bytes sends a reset, which can
  destroy the answer before the client has read it.
- **Idle connections** (no request in progress: before the first head, or between two) are the first to go: past
  `idle_per_address` idle connections from one client address its oldest idle one is closed, and a new connection
  past `limit` open connections closes the oldest idle one of all. Idle connections therefore never make the server
  refuse work.
- **Requests in progress** over `limit` get 503 with Retry-After (OpenAI's error shape), except `/health` and
  `/ready`, which are never behind the cap (a liveness probe must not fail because the server is busy).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict

from ..config import (
    DEFAULT_HTTP_BODY_TIMEOUT_S,
    DEFAULT_HTTP_IDLE_PER_ADDRESS,
    DEFAULT_LIMIT_CONCURRENCY,
    HTTP_KEEP_ALIVE_S,
    HTTP_LINGER_S,
    HTTP_MIN_BODY_RATE,
    HTTP_OVERLOAD_RETRY_AFTER_S,
    MAX_REQUEST_HEADER_BYTES,
    NEW_CONNECTION_IDLE_TIMEOUT_S,
)

log = logging.getLogger("inferd.api")

_HEAD_END = b"\r\n\r\n"
UNCAPPED_PATHS = frozenset({"/health", "/ready"})  # probes: answered whatever the load
CLOSE_AFTER_RESPONSE = "inferd.close_after_response"  # a scope key the application sets: close once answered


def _error_response(status: int, reason: str, message: str, code: str, kind: str = "invalid_request_error",
                    headers: str = "") -> bytes:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n{headers}"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class ConnectionTable:
    """One server's open connections: which are idle (no request in progress), oldest idle first, overall and per
    client address. Lives on the event loop: no locks."""

    def __init__(self, limit: int, idle_per_address: int):
        self.limit = limit
        self.idle_per_address = idle_per_address
        self.open = 0
        self._idle: OrderedDict[object, None] = OrderedDict()  # oldest first
        self._idle_by_address: dict[object, OrderedDict[object, None]] = {}
        self.closed_idle = 0  # idle connections closed to make room (tests and logs)

    def opened(self, conn) -> None:
        self.open += 1
        if self.open > self.limit:
            self._close_oldest(self._idle)
        self.idle(conn)

    def idle(self, conn) -> None:
        self._idle[conn] = None
        by_address = self._idle_by_address.setdefault(conn.address, OrderedDict())
        by_address[conn] = None
        if len(by_address) > self.idle_per_address:
            self._close_oldest(by_address)

    def busy(self, conn) -> None:
        self._forget(conn)

    def closed(self, conn) -> None:
        self.open -= 1
        self._forget(conn)

    def _forget(self, conn) -> None:
        self._idle.pop(conn, None)
        by_address = self._idle_by_address.get(conn.address)
        if by_address is not None:
            by_address.pop(conn, None)
            if not by_address:
                del self._idle_by_address[conn.address]

    def _close_oldest(self, idle: OrderedDict) -> None:
        if idle:
            oldest = next(iter(idle))
            self._forget(oldest)
            self.closed_idle += 1
            oldest.close_idle()


def protocol_class(head_timeout: float = NEW_CONNECTION_IDLE_TIMEOUT_S,
                   max_head_bytes: int = MAX_REQUEST_HEADER_BYTES, *, limit: int = DEFAULT_LIMIT_CONCURRENCY,
                   keep_alive: float = HTTP_KEEP_ALIVE_S, body_timeout: float = DEFAULT_HTTP_BODY_TIMEOUT_S,
                   min_body_rate: float = HTTP_MIN_BODY_RATE, idle_per_address: int = DEFAULT_HTTP_IDLE_PER_ADDRESS):
    """uvicorn's httptools protocol with the limits above (uvicorn.Config(http=this class, limit_concurrency=None):
    the cap is ours, so that probes pass it and idle connections make room)."""
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    table = ConnectionTable(limit, idle_per_address)
    overload = _error_response(503, "Service Unavailable", f"the server has {limit} requests in progress, its "
                               "limit (--limit-concurrency): retry later", "server_overloaded", "server_error",
                               f"retry-after: {HTTP_OVERLOAD_RETRY_AFTER_S}\r\n")

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        connections_table = table

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.address = self.client[0] if self.client else None
            self._head_bytes = 0
            self._head_done = False
            self._head_timer = None
            self._body_timer = None
            self._body_started = 0.0
            self._body_received = 0
            self._lingering = False
            self._running = None  # the request whose application runs (or ran last)
            self._arm_head_timer(head_timeout)
            table.opened(self)

        # ---- the head --------------------------------------------------------------------------------------
        def _arm_head_timer(self, seconds: float) -> None:
            """Arms the deadline, or brings an armed one closer: never later than it was."""
            when = self.loop.time() + seconds
            if self._head_timer is not None:
                if self._head_timer.when() <= when:
                    return
                self._head_timer.cancel()
            self._head_timer = self.loop.call_at(when, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self._head_done and not self.transport.is_closing():
                self.transport.close()  # nothing was answered yet: nothing to flush

        def _unset_keepalive_if_required(self) -> None:
            """uvicorn calls this on every byte received: its keep-alive timer is replaced by the head deadline,
            which bytes do not extend."""

        def close_idle(self) -> None:
            self._disarm_head_timer()
            if not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                return  # the rest of a body nobody will read
            if not self._head_done:
                end = data.find(_HEAD_END)
                self._head_bytes += len(data) if end < 0 else end + len(_HEAD_END)
                if self._head_bytes > max_head_bytes:
                    self._disarm_head_timer()
                    self.transport.write(_error_response(
                        431, "Request Header Fields Too Large",
                        f"the request line and headers are over the {max_head_bytes}-byte limit",
                        "request_header_fields_too_large"))
                    self.transport.close()
                    return
            super().data_received(data)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_done = False
            self._arm_head_timer(head_timeout)  # closer than the keep-alive deadline, never later

        def on_headers_complete(self) -> None:
            self._head_done = True
            self._disarm_head_timer()
            table.busy(self)
            try:
                path = httptools.parse_url(self.url).path.decode("ascii", "replace")
            except httptools.HttpParserInvalidURLError:
                path = ""  # uvicorn answers it 400 below
            if self._body_expected():
                self._body_started = self.loop.time()
                self._body_received = 0
                self._arm_body_timer(self._body_started + body_timeout)
            if path not in UNCAPPED_PATHS and len(self.tasks) >= limit:
                log.warning("%d requests in progress (--limit-concurrency): answered 503", len(self.tasks))
                app, self.app = self.app, _answer(overload)
                try:
                    super().on_headers_complete()
                finally:
                    self.app = app
                return
            super().on_headers_complete()

        # ---- the body --------------------------------------------------------------------------------------
        def _body_expected(self) -> bool:
            for name, value in self.headers:
                if name == b"content-length":
                    return value.strip() not in (b"0", b"")
                if name == b"transfer-encoding":
                    return True
            return False

        def _arm_body_timer(self, when: float) -> None:
            self._body_timer = self.loop.call_at(when, self._body_deadline)

        def _disarm_body_timer(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _body_deadline(self) -> None:
            self._body_timer = None
            if self.pipeline or self.flow.read_paused:
                # the server is not reading (a pipelined request waits for the one before it, or the application
                # has not taken what came): not the client's delay, so its clock starts again
                self._body_started, self._body_received = self.loop.time(), 0
                self._arm_body_timer(self._body_started + body_timeout)
                return
            allowed = self._body_started + body_timeout + self._body_received / min_body_rate
            if self.loop.time() < allowed:  # it kept coming: the deadline moved
                self._arm_body_timer(allowed)
                return
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is not None and not cycle.response_started:
                self.transport.write(_error_response(
                    408, "Request Timeout", f"the request body did not arrive in time (it gets {body_timeout:g} s "
                    f"plus 1 s per {min_body_rate:g} bytes received)", "request_timeout"))
            if cycle is not None:  # the application's sends are dropped from here on, its receive ends
                cycle.disconnected = True
                cycle.message_event.set()
            self._linger_close()

        def on_body(self, body: bytes) -> None:
            self._body_received += len(body)
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._disarm_body_timer()
            super().on_message_complete()

        # ---- between requests ------------------------------------------------------------------------------
        def _start_asgi_task(self, cycle, app) -> None:
            self._running = cycle  # self.cycle is the last request parsed: a pipelined one may follow this one
            super()._start_asgi_task(cycle, app)

        def on_response_complete(self) -> None:
            cycle = self._running
            if cycle is not None and (cycle.more_body or cycle.scope.get(CLOSE_AFTER_RESPONSE)):
                self.server_state.total_requests += 1
                self._linger_close()
                return
            pipelined = bool(self.pipeline)  # uvicorn starts the next one now: the connection stays busy
            super().on_response_complete()
            if self.timeout_keep_alive_task is not None:  # uvicorn's timer: ours below replaces it
                self.timeout_keep_alive_task.cancel()
                self.timeout_keep_alive_task = None
            if not self.transport.is_closing() and not pipelined:
                self._head_done = False
                self._head_bytes = 0  # what arrives next is the next request's head
                self._arm_head_timer(keep_alive)
                table.idle(self)

        def _linger_close(self) -> None:
            self._lingering = True
            self._disarm_body_timer()
            self._disarm_head_timer()
            if self.transport.is_closing():
                return
            if self.transport.can_write_eof():
                self.transport.write_eof()  # the answer, then our FIN
                self.flow.resume_reading()  # and read (to discard) what still comes
                self.loop.call_later(HTTP_LINGER_S, self.transport.close)
            else:
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self._disarm_head_timer()
            self._disarm_body_timer()
            table.closed(self)
            super().connection_lost(exc)

    return LimitedHttpToolsProtocol


def _answer(raw: bytes):
    """An ASGI app that answers with a prepared response (its head and body, as _error_response made them)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = [tuple(part.strip() for part in line.split(b":", 1)) for line in lines[1:]]

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app
