"""Bounds a request's body: reads it whole up to --max-body-bytes (413 past it, before the route parses anything)
and refuses one whose JSON strings hold a lone UTF-16 surrogate (400), then replays it to the route. An upload
(/v1/files) is bounded by its own limit (MAX_FILE_BYTES) where it is read, never buffered here."""

from __future__ import annotations

import asyncio
import json
import re

from ..errors import APIError, response_for

UNBUFFERED_PATHS = ("/v1/files",)

# a JSON escape of a high surrogate not followed by a low one, a low one not after a high one, or a surrogate in
# UTF-8 form (which json.loads lets through): a quick screen of the raw body, confirmed by _has_lone_surrogate (an
# escaped backslash before "ud800" matches here, and is not one)
_MAYBE_LONE_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")


class BodyLimit:
    """state: the ServerState (its max_body_bytes)."""

    def __init__(self, app, state):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH")
                or scope["path"] in UNBUFFERED_PATHS):
            return await self.app(scope, receive, send)
        error, receive = await self._buffer_body(scope, receive)
        if error is not None:
            return await response_for(scope["path"], error)(scope, receive, send)
        await self.app(scope, receive, send)

    async def _buffer_body(self, scope, receive):
        """Reads the whole body up to the limit; (413 error, None) past it, else (None, a receive that replays
        the body and then passes through, for the disconnect)."""
        limit = self.state.max_body_bytes
        too_large = APIError(413, f"the request body is over the {limit}-byte limit", code="request_too_large")
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > limit:
            return too_large, receive
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, _replay([message], receive)
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                return too_large, receive
            chunks.append(body)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if _MAYBE_LONE_SURROGATE.search(body) and await asyncio.to_thread(_has_lone_surrogate, body):
            return APIError(400, "the request body holds a lone UTF-16 surrogate (e.g. \\ud800 without its pair): "
                            "that is not Unicode text", code="invalid_unicode"), receive
        return None, _replay([{"type": "http.request", "body": body, "more_body": False}], receive)


def _has_lone_surrogate(body: bytes) -> bool:
    """Whether the JSON body's strings (keys included) hold a lone surrogate, which tokenizers, the stores and every
    encoder downstream refuse. A body that does not parse is left to the route (its own 400)."""
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    except (ValueError, RecursionError):
        return False
    return False


def _replay(messages: list, receive):
    async def replayed():
        if messages:
            return messages.pop(0)
        return await receive()

    return replayed
