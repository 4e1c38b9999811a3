"""OpenAI-shaped errors: every error response is {"error": {"message", "type", "param", "code"}} with the status
OpenAI would use. Exception handlers map FastAPI's and Starlette's own errors (validation, unknown route, wrong
method, bad JSON) to that shape, so that no error leaves in another form and nothing becomes a 500 by accident."""

from __future__ import annotations

import logging
import uuid
from contextvars import ContextVar
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from . import anthropic_errors

log = logging.getLogger("inferd.api")

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVICE_UNAVAILABLE = "service_unavailable_error"
SERVER_ERROR = "server_error"

_TYPE_BY_STATUS = {400: INVALID_REQUEST, 401: INVALID_REQUEST, 404: NOT_FOUND, 405: INVALID_REQUEST,
                   413: INVALID_REQUEST, 415: INVALID_REQUEST, 422: INVALID_REQUEST, 503: SERVICE_UNAVAILABLE}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, SERVER_ERROR if status >= 500 else INVALID_REQUEST)
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# the id of the request being served (the x-request-id response header): set by the middleware for each request and
# inherited by the tasks it starts, so that an error message can name it and the log can be searched for it
REQUEST_ID: ContextVar[str] = ContextVar("inferd_request_id", default="-")


def response_for(path: str, error: APIError) -> JSONResponse:
    """The error response of a request to path: Anthropic's shape on the Messages API's paths (its clients read
    that), OpenAI's everywhere else; the same status and headers. The exception handlers below and the middleware
    (401, 403, 413, ...) answer through it."""
    if anthropic_errors.is_messages_path(path):
        return anthropic_errors.error_response(error.status, error.message, error.headers)
    return error.response()


def new_request_id() -> str:
    return "req-" + uuid.uuid4().hex[:20]


def internal_error(what: str, exc: BaseException | None = None, code: str | None = None) -> APIError:
    """A failure the client cannot fix and should not see the inside of: a generic message naming the request id;
    the details go to the log under that id."""
    request_id = REQUEST_ID.get()
    if exc is not None:
        log.error("%s (request %s): %r", what, request_id, exc, exc_info=exc)
    return APIError(500, f"{what} (request id {request_id}; the details are in the server's log)", SERVER_ERROR,
                    code=code)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}


def _loc(loc: tuple) -> str:
    """pydantic's error location as a param path: "messages.0.role". Union members and validators appear in it as
    tags ("str", "list[constrained-str]", "function-after[...]"): they are not parameters and are left out."""
    parts = [str(p) for p in loc[1 if loc and loc[0] == "body" else 0:]
             if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or "-" in p))]
    return ".".join(parts)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """pydantic errors -> one 400 naming the first offending field (and how many more there are)."""
    if not errors:
        return invalid("invalid request")
    # a union (e.g. `stop`: a string or a list) reports one error per member: the deepest is the informative one
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    param = _loc(tuple(first.get("loc", ()))) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return invalid(f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}",
                       code="invalid_json")
    if kind == "missing" and param is None:
        return invalid("the request needs a JSON body")
    if kind == "extra_forbidden":
        message = f"unrecognized request argument supplied: {param}"
    else:
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    more = len(errors) - 1
    if more:
        message += f" (and {more} more error{'s' if more > 1 else ''})"
    return invalid(message, param, code="unknown_parameter" if kind == "extra_forbidden" else "invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return response_for(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return response_for(request.url.path, validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 400:  # FastAPI: a body it could not parse (e.g. invalid UTF-8)
            message = f"the body could not be parsed: {exc.detail}"
        else:
            message = str(exc.detail)
        error = APIError(exc.status_code, message, headers=getattr(exc, "headers", None))
        return response_for(request.url.path, error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s (request %s)", request.method, request.url.path, REQUEST_ID.get())
        return response_for(request.url.path, internal_error("internal error"))
