"""The API process's HTTP connection limits that uvicorn does not have: a deadline for a request's head (a new
connection that sends nothing, or a head sent a byte at a time, is closed: slowloris) and a bound on the head's size
(431). uvicorn's own `limit_concurrency` bounds open connections and requests; its keep-alive timeout bounds the
idle time between two requests of a connection."""

from __future__ import annotations

import json

from ..config import MAX_REQUEST_HEADER_BYTES, NEW_CONNECTION_IDLE_TIMEOUT_S

_HEAD_END = b"\r\n\r\n"


def _error_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def protocol_class(head_timeout: float = NEW_CONNECTION_IDLE_TIMEOUT_S,
                   max_head_bytes: int = MAX_REQUEST_HEADER_BYTES):
    """uvicorn's httptools protocol with the head deadline and size bound (uvicorn.Config(http=this class))."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_bytes = 0
            self._head_done = False
            self._head_timer = None
            self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(head_timeout, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self._head_done and not self.transport.is_closing():
                self.transport.close()  # nothing was answered yet: nothing to flush

        def data_received(self, data: bytes) -> None:
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
            self._arm_head_timer()  # the next request of a kept-alive connection gets its own deadline

        def on_response_complete(self) -> None:
            self._head_bytes = 0  # what arrives next is the next request's head
            self._head_done = False
            super().on_response_complete()

        def on_headers_complete(self) -> None:
            self._head_done = True
            self._disarm_head_timer()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm_head_timer()
            super().connection_lost(exc)

    return LimitedHttpToolsProtocol
