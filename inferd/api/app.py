"""The FastAPI app: thin routes (parse, call serving, map errors) and one ASGI middleware in front of them that
stamps the receipt time, checks the API key, bounds the body size and counts requests by status.

This process never runs the model: generation goes through the router to worker processes.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..gateway.router import Router
from ..telemetry.metrics import Metrics
from .errors import INVALID_REQUEST, APIError, install_error_handlers, invalid
from .schemas import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                      DetokenizeRequest, DetokenizeResponse, ErrorResponse, HealthResponse, ModelCard, ModelList,
                      TokenizeRequest, TokenizeResponse)
from .serving import OpenAIServing, Prepared, complete, first_event, not_ready, stream, worker_error

RECEIVED_AT = "inferd.received_at"  # scope key: time.perf_counter() when the request arrived


@dataclass
class ServerState:
    router: Router
    metrics: Metrics
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    serving: OpenAIServing | None = None  # set once the tokenizer is loaded
    started: int = field(default_factory=lambda: int(time.time()))

    def require_serving(self) -> OpenAIServing:
        if self.serving is None:
            raise not_ready("the model is loading", retry_after=5)
        return self.serving

    def not_ready_reason(self) -> str | None:
        if self.serving is None:
            return "the tokenizer is loading"
        if not self.router.ready:
            return self.router.not_ready_reason
        return None


def _errors(*codes: int) -> dict:
    return {code: {"model": ErrorResponse} for code in codes}


# One server-sent event, documented the way FastAPI documents its own event streams (OpenAPI 3.2's `itemSchema`: the
# schema of each event, not of the whole body): `data` is a JSON chunk, an in-band {"error": ...} or "[DONE]".
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                             "retry": {"type": "integer", "minimum": 0}}}


def _generation_responses(model) -> dict:
    return {200: {"model": model, "description": "The response, or with stream=true a text/event-stream of chunks",
                  "content": {"text/event-stream": {"itemSchema": _SSE_EVENT}}},
            **_errors(400, 401, 404, 413, 503)}


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="inferd", version="0.1.0", description="OpenAI-compatible LLM inference",
                  docs_url="/docs", redoc_url=None)
    app.state.inferd = state
    install_error_handlers(app)

    @app.post("/v1/completions", response_model=None, responses=_generation_responses(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        serving = state.require_serving()
        return await _generate(serving, serving.prepare_completion(body, request.scope[RECEIVED_AT]), request)

    @app.post("/v1/chat/completions", response_model=None, responses=_generation_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        serving = state.require_serving()
        return await _generate(serving, serving.prepare_chat(body, request.scope[RECEIVED_AT]), request)

    @app.get("/v1/models", response_model=ModelList, responses=_errors(401))
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_errors(401, 404))
    async def model(model_id: str) -> dict:
        if model_id != state.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist", INVALID_REQUEST, param="model",
                           code="model_not_found")
        return _model_card(state)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_errors(400, 401, 404, 413, 503))
    async def tokenize(body: TokenizeRequest) -> dict:
        serving = state.require_serving()
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise invalid("give either prompt or messages", param="prompt")
        if body.prompt is not None:
            tokens = serving.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            tokens = serving.chat_prompt(body.messages, body.add_generation_prompt is not False)
        hello = state.router.hello
        return {"tokens": tokens, "count": len(tokens), "max_model_len": hello.max_model_len if hello else 0}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_errors(400, 401, 404, 413, 503))
    async def detokenize(body: DetokenizeRequest) -> dict:
        serving = state.require_serving()
        serving.check_model(body.model)
        vocab = serving.tokenizer.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise invalid(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/health", response_model=HealthResponse, response_model_exclude_none=True)
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready", response_model=HealthResponse, response_model_exclude_none=True, responses=_errors(503))
    async def ready() -> dict:
        reason = state.not_ready_reason()
        if reason is not None:
            raise not_ready(reason)
        return {"status": "ready"}

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    _install_openapi(app)
    return Gatekeeper(app, state)


def _model_card(state: ServerState) -> dict:
    hello = state.router.hello
    return {"id": state.model_name, "object": "model", "created": state.started, "owned_by": "inferd",
            "max_model_len": hello.max_model_len if hello else None}


async def _generate(serving: OpenAIServing, prep: Prepared, request: Request) -> Response:
    run = serving.start(prep)
    try:
        run.dispatch()
        if prep.stream:
            events, first = await _until_disconnect(request, first_event(run))
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(stream(run, events, first), media_type="text/event-stream", headers=headers)
        body = await _until_disconnect(request, complete(run))
        await run.aclose()
        return JSONResponse(body)
    except _ClientGone:  # nobody is left to read a response: do not log it as a server error
        await run.aclose()
        return Response(status_code=499)
    except APIError:
        await run.aclose()
        raise
    except Exception as e:  # NoWorkerAvailable, WorkerDead, RequestRejected, ...
        await run.aclose()
        raise worker_error(e) from None


class _ClientGone(Exception):
    pass


async def _until_disconnect(request: Request, coro):
    """Awaits coro unless the client disconnects first: then coro is cancelled (which aborts the request in the
    worker) and _ClientGone is raised."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work.done():
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise _ClientGone()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _install_openapi(app: FastAPI) -> None:
    """FastAPI documents a 422 for every body; inferd answers invalid bodies with 400 (OpenAI's code)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


# ---- the middleware ----------------------------------------------------------------------------------------------
_PUBLIC_PATHS = ("/health", "/ready", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect")
_KNOWN_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", *_PUBLIC_PATHS)


class Gatekeeper:
    """Pure ASGI (no per-request task, streaming untouched): receipt time, API key, body-size limit, counters."""

    def __init__(self, app: FastAPI, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[RECEIVED_AT] = time.perf_counter()
        path = scope["path"]
        route = path if path in _KNOWN_ROUTES else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        status = [0]

        async def send_counted(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            error = self._check_key(scope, path)
            if error is None and scope["method"] in ("POST", "PUT", "PATCH"):
                error, receive = await self._buffer_body(scope, receive)
            if error is not None:
                await error.response()(scope, receive, send_counted)
            else:
                await self.app(scope, receive, send_counted)
        finally:
            self.state.metrics.requests.labels(route, str(status[0] or 499)).inc()

    def _check_key(self, scope, path: str) -> APIError | None:
        key = self.state.api_key
        if key is None or path in _PUBLIC_PATHS:
            return None
        auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return APIError(401, "You didn't provide an API key: send it as 'Authorization: Bearer KEY'",
                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(given.strip().encode(), key.encode()):
            return APIError(401, "Incorrect API key provided", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        return None

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
        return None, _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive)


def _replay(messages: list, receive):
    async def replayed():
        if messages:
            return messages.pop(0)
        return await receive()

    return replayed
