"""Anthropic's error shape, for the Messages API's paths (/v1/messages, /v1/messages/count_tokens): the body is
{"type": "error", "error": {"type", "message"}}, the error type named by the status (what Anthropic's clients map to
their exception classes), the status and headers (Retry-After on 429 and 503: our overload contract) those of the
OpenAI-shaped error it renders. Only starlette is imported here: inferd/api/errors.py renders through it, so every
error (the middleware's, the validation handler's, the route's) leaves such a path in one shape."""

from __future__ import annotations

from starlette.responses import JSONResponse

MESSAGES_PATH = "/v1/messages"

# Anthropic's error types by status; Anthropic answers an overload with 529, inferd keeps its 503 (the status its
# clients already retry on) and names it overloaded_error
_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error", 529: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    """Whether a request's path is the Messages API's (its errors are in Anthropic's shape)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)
