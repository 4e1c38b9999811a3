"""The FastAPI app: thin routes (parse, call serving, map errors) and one ASGI middleware in front of them that
stamps the receipt time, checks the API key, bounds the body size and counts requests by status.

This process never runs the model: generation goes through the router to worker processes.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import math
import re
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..config import (DASHBOARD_WINDOWS_S, DEFAULT_DASHBOARD_WINDOW_S, DEFAULT_SSE_KEEPALIVE_S,
                      DEFAULT_SSE_WRITE_TIMEOUT_S, MAX_QUEUE_TIMEOUT_BY_TIER_S, MAX_QUEUE_TIMEOUT_S, TIERS)
from ..gateway.admission import Gateway, RateLimited
from ..gateway.limits import LimiterUnavailable
from ..gateway.router import Router
from ..gateway.tenants import ANONYMOUS_TENANT, DEFAULT_TENANT, AuthError, KeyStore, Tenant
from ..telemetry.metrics import Metrics
from .embeddings import EmbeddingRequest
from .errors import REQUEST_ID, INVALID_REQUEST, APIError, install_error_handlers, invalid, new_request_id
from .http_limits import CLOSE_AFTER_RESPONSE
from .schemas import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                      DetokenizeRequest, DetokenizeResponse, ErrorResponse, HealthResponse, ModelCard, ModelList,
                      TokenizeRequest, TokenizeResponse)
from .serving import (SSE_DONE, OpenAIServing, Prepared, Run, complete, first_event, is_server_error, not_ready, sse,
                      stream, worker_error)

log = logging.getLogger("inferd.api")

RECEIVED_AT = "inferd.received_at"  # scope key: time.perf_counter() when the request arrived
TENANT = "inferd.tenant"  # scope key: the Tenant the request's key belongs to
ABORT_CONNECTION = "inferd.abort_connection"  # scope key: () -> None, drops the client's connection at once
TIER_HEADER = "x-inferd-tier"  # a request may ask for a lower tier than its tenant's, never a higher one
QUEUE_TIMEOUT_HEADER = "x-inferd-queue-timeout"  # seconds the request may wait for a worker (default: its tier's)


@dataclass
class ServerState:
    router: Router
    metrics: Metrics
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    serving: OpenAIServing | None = None  # set once the tokenizer is loaded
    started: int = field(default_factory=lambda: int(time.time()))
    gateway: Gateway | None = None  # default: in-process limits and line over `router`
    keys: KeyStore | None = None  # None: no keys file (then --api-key, or no authentication on loopback)
    sse_keepalive_s: float = DEFAULT_SSE_KEEPALIVE_S
    sse_write_timeout: float = DEFAULT_SSE_WRITE_TIMEOUT_S
    admin_key: str | None = None  # the admin API (/admin/...) is off without one
    metrics_key: str | None = None  # /metrics needs it (Bearer) when set
    draining: bool = False  # shutting down: /ready says so, new requests get 503
    rollout: object | None = None  # the RolloutController (local workers only)
    autoscaler: object | None = None  # the Autoscaler, where one runs
    dashboard: object | None = None  # the /dashboard's history of samples (api/dashboard.py); build_app makes it
    # the EmbeddingService of each --embedding-model (api/embeddings.py), by served name, in the order given
    embeddings: dict = field(default_factory=dict)
    batches: object | None = None  # the Batch API's BatchStore (api/batches.py); None: /v1/files and /v1/batches 404
    batch_runner: object | None = None  # its BatchRunner

    def __post_init__(self) -> None:
        if self.gateway is None:
            self.gateway = Gateway(self.router, metrics=self.metrics)

    @property
    def authenticates(self) -> bool:
        return self.keys is not None or self.api_key is not None

    def require_serving(self) -> OpenAIServing:
        if self.serving is None:
            raise not_ready("the model is loading", retry_after=5)
        return self.serving

    def not_ready_reason(self) -> str | None:
        if self.draining:
            return "the server is shutting down"
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
    from .batch_routes import install_batch_routes

    install_batch_routes(app, state)

    @app.post("/v1/completions", response_model=None, responses=_generation_responses(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        serving = state.require_serving()
        prep = await serving.prepare(body, request.scope[RECEIVED_AT], request.scope[TENANT].allow_grammar)
        return await _generate(serving, prep, request)

    @app.post("/v1/chat/completions", response_model=None, responses=_generation_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        serving = state.require_serving()
        prep = await serving.prepare(body, request.scope[RECEIVED_AT], request.scope[TENANT].allow_grammar)
        return await _generate(serving, prep, request)

    @app.post("/v1/embeddings", response_model=None, responses=_errors(400, 401, 404, 413, 429, 503))
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        service = embedding_service(state, body.model)
        tenant: Tenant = request.scope[TENANT]
        band = _requested_band(request, tenant)
        try:
            # a client that disconnects cancels the request: its inputs are aborted in the worker, its slot freed
            out = await _until_disconnect(request.receive, service.create(
                body, tenant, band, _requested_timeout(request, band), _cache_salt(tenant)))
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it
        except APIError:
            raise
        except RateLimited as e:
            raise _rate_limited(e) from None
        except Exception as e:
            raise worker_error(e) from None
        state.metrics.embedding_requests.inc()
        state.metrics.embedding_inputs.inc(len(out["data"]))
        return JSONResponse(out)  # straight to JSON: FastAPI's encoder walks every float of every vector

    @app.get("/v1/models", response_model=ModelList, responses=_errors(401))
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(state)] + _embedding_cards(state)}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_errors(401, 404))
    async def model(model_id: str) -> dict:
        card = next((c for c in _embedding_cards(state) if c["id"] == model_id), None)
        if card is not None:
            return card
        if model_id != state.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist", INVALID_REQUEST, param="model",
                           code="model_not_found")
        return _model_card(state)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_errors(400, 401, 404, 413, 503))
    async def tokenize(body: TokenizeRequest, request: Request) -> dict:
        serving = state.require_serving()
        serving.check_model(body.model)
        try:  # it costs the server work: it counts against the tenant's request rate
            await state.gateway.charge_request(request.scope[TENANT])
        except RateLimited as e:
            raise _rate_limited(e) from None
        except LimiterUnavailable as e:
            raise worker_error(e) from None
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
    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(tenants=request.scope[TENANT_DETAIL]), media_type=CONTENT_TYPE_LATEST)

    from .dashboard import Dashboard, page_html, page_policy

    page = page_html()
    policy = page_policy(page)
    if state.dashboard is None:
        state.dashboard = Dashboard(state)
        state.dashboard.sample()  # before any request: the growth of a histogram since then is all of it

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers={
            "Cache-Control": "no-store", "Content-Security-Policy": policy, "X-Frame-Options": "DENY",
            "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})

    @app.get("/dashboard/data", include_in_schema=False)
    async def dashboard_data(request: Request, window: float = DEFAULT_DASHBOARD_WINDOW_S) -> Response:
        if not 0 < window <= max(DASHBOARD_WINDOWS_S):
            raise invalid(f"window must be in (0, {max(DASHBOARD_WINDOWS_S):g}] seconds, got {window:g}",
                          param="window")
        view = state.dashboard.view(window, tenants=request.scope[TENANT_DETAIL])
        return Response(json.dumps(_finite(view), separators=(",", ":")),
                        media_type="application/json", headers={"Cache-Control": "no-store"})

    @app.get("/admin/workers", include_in_schema=False)
    async def admin_workers() -> dict:
        return {"workers": [_worker_card(w) for w in state.router.workers],
                "affinity": {"hits": state.router.affinity_hits, "queries": state.router.affinity_queries},
                "embedding_workers": {name: [_worker_card(w) for w in service.router.workers]
                                      for name, service in state.embeddings.items()}}

    @app.get("/admin/rollout", include_in_schema=False)
    async def rollout_status() -> dict:
        return _rollout(state).describe()

    @app.post("/admin/rollout/start", include_in_schema=False)
    async def rollout_start(body: RolloutStartRequest) -> dict:
        return await _rollout_call(_rollout(state).start(body.model, body.version, body.path, body.canary))

    @app.post("/admin/rollout/promote", include_in_schema=False)
    async def rollout_promote() -> dict:
        return await _rollout_call(_rollout(state).promote())

    @app.post("/admin/rollout/abort", include_in_schema=False)
    async def rollout_abort() -> dict:
        return await _rollout_call(_rollout(state).abort())

    _install_openapi(app)
    return Gatekeeper(app, state)


class RolloutStartRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    version: str
    path: str
    canary: float | None = None  # percent of new requests


def _rollout(state: ServerState):
    if state.rollout is None:
        raise APIError(409, "rollouts need local workers (inferd serve); this server has none", code="no_rollouts")
    return state.rollout


async def _rollout_call(coro) -> dict:
    from ..cluster.rollout import RolloutError

    try:
        return await coro
    except RolloutError as e:
        raise APIError(e.status, str(e), INVALID_REQUEST, code="rollout_conflict" if e.status == 409 else None) \
            from None


def _finite(value):
    """JSON has no NaN or infinity: such a number becomes null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _worker_card(w) -> dict:
    hello, stats = w.hello, w.latest_stats
    return {"worker_id": hello.worker_id if hello else None, "version": hello.version if hello else None,
            "pid": hello.pid if hello else None, "address": f"{w.address[0]}:{w.address[1]}" if w.address else None,
            "usable": w.usable, "draining": w.draining, "unresponsive": w.unresponsive,
            "dead": str(w.dead) if w.dead else None, "streams": w.num_streams,
            "running": stats.running if stats else None,
            "prefix_cache_hits": stats.prefix_cache_hits if stats else None,
            "prefix_cache_queries": stats.prefix_cache_queries if stats else None,
            "stale_outputs": w.num_stale_outputs, "given_up": w.num_given_up}


def embedding_service(state: ServerState, model: str | None):
    """The EmbeddingService `model` names (None: the first one served); else the 4xx that says why not."""
    services = state.embeddings
    if model is None and services:
        return next(iter(services.values()))
    if model in services:
        return services[model]
    names = ", ".join(f"`{name}`" for name in services)
    if model == state.model_name:
        raise invalid(f"`{model}` is a generation model; /v1/embeddings needs an embedding model"
                      + (f" ({names})" if names else ""), param="model", code="wrong_model_kind")
    raise APIError(404, f"The model `{model}` does not exist (embedding models here: {names})" if services else
                   "this server serves no embedding model (start it with --embedding-model)",
                   INVALID_REQUEST, param="model", code="model_not_found")


def _embedding_cards(state: ServerState) -> list[dict]:
    cards = []
    for service in state.embeddings.values():
        hello = service.router.hello
        cards.append({"id": service.model_name, "object": "model", "created": state.started, "owned_by": "inferd",
                      "max_model_len": hello.max_model_len if hello else None, "versions": service.router.versions()})
    return cards


def _model_card(state: ServerState) -> dict:
    hello = state.router.hello
    return {"id": state.model_name, "object": "model", "created": state.started, "owned_by": "inferd",
            "max_model_len": hello.max_model_len if hello else None, "versions": state.router.versions()}


async def _generate(serving: OpenAIServing, prep: Prepared, request: Request) -> Response:
    """Admission (quota, line, overload), then the run: a JSON body, or an SSE stream. Refusals before the
    response starts are HTTP errors; after it, SSE error events.

    Who releases what: the run's driver releases the ticket (room, quota, in-flight count) when the worker's last
    output arrives (Run.on_done); every other exit (refused, timed out in the line, client gone) goes through
    run.close(), which is synchronous and releases it too. No cleanup here awaits."""
    state: ServerState = request.app.state.inferd
    tenant: Tenant = request.scope[TENANT]
    band = _requested_band(request, tenant)
    queue_timeout = _requested_timeout(request, band)
    try:
        ticket = await state.gateway.admit(tenant, band, prep.prompt_tokens, prep.reserved_tokens, queue_timeout,
                                           prompt=prep.prompts[0], num_seqs=len(prep.params),
                                           cache_salt=_cache_salt(tenant))
    except RateLimited as e:
        raise _rate_limited(e) from None
    except Exception as e:  # Overloaded, QueueShareExceeded, NoWorkerAvailable, the limiter unavailable
        raise worker_error(e) from None
    salt = _cache_salt(tenant)
    for params in prep.params:  # the worker's prefix cache shares blocks only under the same salt
        params.cache_salt = salt
    run = serving.start(prep)
    run.on_tokens = ticket.on_output
    run.rebind = ticket.rebind
    run.on_done = lambda: _end(state, ticket, run)
    headers = ticket.decision.headers()
    if prep.stream:
        return await _start_stream(state, run, ticket, band, request, headers)

    async def respond() -> Response:
        worker = ticket.worker or await ticket.wait()  # bound at admission unless it had to wait in the line
        run.dispatch(worker, band, ticket.queue_seconds)
        body = await complete(run)
        response = JSONResponse(body, headers={**headers, **_dispatch_headers(ticket)})
        _observe_overhead(state, prep, run, ticket)
        return response

    return _RunResponse(respond, run)


class _RunResponse(Response):
    """A non-streaming generation, run when the response is sent rather than in the route: by then the route's
    frame, and FastAPI's that parsed the body, are gone, so a request waiting in the line holds its token ids but
    not its request body. Errors before the response starts are still HTTP errors; a client that disconnects
    aborts the run."""

    def __init__(self, respond, run: Run):
        super().__init__(status_code=200)
        self.respond = respond
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            response = await _until_disconnect(receive, self.respond())
        except _ClientGone:  # nobody is left to read a response: do not log it as a server error
            response = Response(status_code=499)
        except APIError as e:
            response = e.response()
        except Exception as e:  # QueueTimeout, Overloaded (shed), NoWorkerAvailable, WorkerDead, RequestRejected..
            self.run.error = e
            response = worker_error(e).response()
        finally:
            self.run.close()
        await response(scope, receive, send)


def _end(state: ServerState, ticket, run: Run) -> None:
    """Releases the ticket (synchronous: see _generate); a request that reached a worker counts for its version
    (rollout figures)."""
    if ticket.finished:
        return
    ticket.finish(_used_tokens(run))
    rollout = state.rollout
    if rollout is not None and run.dispatched_at is not None:
        ttft = tpot = None
        c = run.choices[0]
        if c.first_token_at is not None:
            ttft = c.first_token_at - run.prep.received_at
            if c.num_output_tokens > 1 and run.last_output_at is not None:
                tpot = (run.last_output_at - c.first_token_at) / (c.num_output_tokens - 1)
        rollout.observe(ticket.version, ttft, tpot, is_server_error(run.error))


def _cache_salt(tenant: Tenant) -> str:
    """The tenant's prefix-cache salt: tenants share cached prefixes only within a cache group."""
    return tenant.cache_salt


def _used_tokens(run: Run) -> int:
    return run.usage()["total_tokens"] if run.dispatched_at is not None else 0


def _observe_overhead(state: ServerState, prep: Prepared, run: Run, ticket) -> None:
    """The gateway's own time: receipt to response, less the line and the worker (dispatch to last output)."""
    now = time.perf_counter()
    worker_s = (run.last_output_at or now) - (run.dispatched_at or now)
    state.metrics.gateway_overhead.observe(max(0.0, now - prep.received_at - ticket.queue_seconds - worker_s))


def _dispatch_headers(ticket) -> dict[str, str]:
    headers = {"x-inferd-queue-seconds": f"{ticket.queue_seconds:.4f}", "x-inferd-dispatch-seq": str(ticket.dispatch_seq),
               "x-inferd-dispatched-ahead": str(ticket.dispatched_ahead), "x-inferd-tier": TIERS[ticket.band]}
    worker = ticket.first_worker
    if worker is not None and worker.hello is not None:  # where it ran (first dispatch): routing is observable
        headers["x-inferd-worker"] = worker.hello.worker_id
        headers["x-inferd-model-version"] = worker.hello.version
    return headers


async def _start_stream(state: ServerState, run: Run, ticket, band: int, request: Request,
                        headers: dict[str, str]) -> Response:
    """Waits (up to the keep-alive interval) for a worker and the first event, so that a refusal is still an HTTP
    error; a stream still waiting after that starts with keep-alive comments and ends in band if it fails. From
    here the response body owns the run (its cleanup closes it)."""

    async def start():
        worker = ticket.worker or await ticket.wait()
        run.dispatch(worker, band, ticket.queue_seconds)
        return await first_event(run)

    starting = asyncio.ensure_future(start())
    try:
        await _until_disconnect(request.receive, asyncio.wait({starting}, timeout=state.sse_keepalive_s))
        sse_headers = {**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        if starting.done():
            events, first = starting.result()  # raises a refusal as an HTTP error
            sse_headers.update(_dispatch_headers(ticket))
    except BaseException as e:
        starting.cancel()
        if isinstance(e, Exception) and not isinstance(e, (_ClientGone, APIError)):
            run.error = e
        run.close()
        if isinstance(e, _ClientGone):
            return Response(status_code=499)
        if isinstance(e, Exception) and not isinstance(e, APIError):
            raise worker_error(e) from None
        raise
    abort_connection = request.scope.get(ABORT_CONNECTION)

    def on_write_timeout() -> None:
        log.warning("closing the stream of %s: its client read nothing for %g s (--sse-write-timeout)", run.prep.id,
                    state.sse_write_timeout)
        state.metrics.sse_write_timeouts.inc()
        run.close()
        if abort_connection is not None:
            abort_connection()

    return _SSEResponse(_stream_body(state, run, starting), state.sse_write_timeout, on_write_timeout,
                        media_type="text/event-stream", headers=sse_headers)


async def _stream_body(state: ServerState, run: Run, starting: asyncio.Future):
    try:
        while not starting.done():
            await asyncio.wait({starting}, timeout=state.sse_keepalive_s)
            if not starting.done():
                yield b": keep-alive\n\n"
        try:
            events, first = starting.result()
        except Exception as e:  # queue timeout, shed, worker lost, ...: the headers are gone, the error goes in band
            run.error = e
            yield sse(worker_error(e).body())
            yield SSE_DONE
            return
        async for chunk in stream(run, events, first):
            yield chunk
    finally:  # synchronous only: on a disconnect this runs in a cancelled scope, where every await raises again
        starting.cancel()
        run.close()


class _SSEResponse(StreamingResponse):
    """A stream whose writes must complete within write_timeout: a client that stops reading (without
    disconnecting) has its connection closed. The request itself was released when its worker's last output
    arrived; this bounds what the server keeps for such a client."""

    def __init__(self, content, write_timeout: float, on_write_timeout, **kwargs):
        super().__init__(content, **kwargs)
        self.write_timeout = write_timeout
        self.on_write_timeout = on_write_timeout

    async def stream_response(self, send) -> None:
        timeout = self.write_timeout

        async def timed_send(message) -> None:
            async with asyncio.timeout(timeout):
                await send(message)

        try:
            await super().stream_response(timed_send)
        except TimeoutError:  # returning (not raising) ends the response without an "exception in ASGI app"
            self.on_write_timeout()


def _rate_limited(e: RateLimited) -> APIError:
    d = e.decision
    headers = d.headers()
    if d.reason == "too_large":
        return APIError(429, e.message, "rate_limit_exceeded", code="request_too_large", headers=headers)
    headers["Retry-After"] = d.retry_after_header
    return APIError(429, e.message, "rate_limit_exceeded", code="rate_limit_exceeded", headers=headers)


def _requested_band(request: Request, tenant: Tenant) -> int:
    asked = request.headers.get(TIER_HEADER)
    if asked is None:
        return tenant.band
    asked = asked.strip().lower()
    if asked not in TIERS:
        raise invalid(f"{TIER_HEADER} must be one of {', '.join(TIERS)}, got {asked!r}", param=TIER_HEADER)
    if TIERS.index(asked) < tenant.band:
        raise APIError(403, f"tenant {tenant.name} is in tier {tenant.tier} and may not ask for tier {asked} "
                       "(a request may ask for a lower tier, never a higher one)", "permission_error",
                       param=TIER_HEADER, code="tier_not_allowed")
    return TIERS.index(asked)


def _requested_timeout(request: Request, band: int) -> float | None:
    """The queue deadline the request asks for, capped by its tier's maximum."""
    raw = request.headers.get(QUEUE_TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_QUEUE_TIMEOUT_S:  # NaN fails too
        raise invalid(f"{QUEUE_TIMEOUT_HEADER} must be a number of seconds in (0, {MAX_QUEUE_TIMEOUT_S:g}], got "
                      f"{raw!r}", param=QUEUE_TIMEOUT_HEADER)
    return min(value, MAX_QUEUE_TIMEOUT_BY_TIER_S[TIERS[band]])


class _ClientGone(Exception):
    pass


async def _until_disconnect(receive, coro):
    """Awaits coro unless the client disconnects first (receive: the ASGI receive): then coro is cancelled (which
    aborts the request in the worker) and _ClientGone is raised."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work.done():
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise _ClientGone()


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
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
_PUBLIC_PATHS = ("/health", "/ready", "/metrics", "/dashboard", "/dashboard/data", "/openapi.json", "/docs", "/docs/oauth2-redirect")
_KNOWN_ROUTES = ("/admin/workers", "/admin/rollout", "/admin/rollout/start", "/admin/rollout/promote",
                 "/admin/rollout/abort", "/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
                 "/v1/embeddings",
                 "/v1/files", "/v1/batches", *_PUBLIC_PATHS)


class Gatekeeper:
    """Pure ASGI (no per-request task, streaming untouched): receipt time, API key, body-size limit, counters."""

    def __init__(self, app: FastAPI, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[RECEIVED_AT] = time.perf_counter()
        scope[ABORT_CONNECTION] = _connection_aborter(send)
        request_id = new_request_id()
        REQUEST_ID.set(request_id)  # this request's task (and those it starts) see it: error messages name it
        path = scope["path"]
        route = path if path in _KNOWN_ROUTES else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        status = [0]
        id_header = (b"x-request-id", request_id.encode())

        async def send_counted(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), id_header]}
            await send(message)

        try:
            error = self._check_key(scope, path)
            # an upload is bounded by its own limit (MAX_FILE_BYTES) where it is read, never buffered here
            if error is None and scope["method"] in ("POST", "PUT", "PATCH") and path != "/v1/files":
                error, receive = await self._buffer_body(scope, receive)
            if error is not None:
                if error.status == 401:  # a client without a key has no reason to keep a connection (and a place)
                    scope[CLOSE_AFTER_RESPONSE] = True
                await error.response()(scope, receive, send_counted)
            else:
                await self.app(scope, receive, send_counted)
        finally:
            self.state.metrics.requests.labels(route, str(status[0] or 499)).inc()

    def _check_key(self, scope, path: str) -> APIError | None:
        """Resolves the request's key to its tenant (scope[TENANT]); a 401 when the key is missing or refused."""
        state = self.state
        if path in ("/metrics", "/dashboard/data"):
            # aggregates are open unless --metrics-key is set; who the tenants are and what they use is not: it
            # needs the metrics or the admin key (on a server without API keys, loopback clients all see it)
            keyed = any(key is not None and _bearer_matches(scope, key) for key in (state.metrics_key,
                                                                                  state.admin_key))
            if state.metrics_key is not None and not keyed:
                return _unauthorized(f"{path} needs the metrics key: 'Authorization: Bearer METRICS_KEY'")
            scope[TENANT_DETAIL] = keyed or not state.authenticates
            if not state.authenticates:
                return self._check_loopback_host(scope)
            return None
        if path.startswith("/admin/"):
            return self._check_admin_key(scope)
        if not state.authenticates:
            scope[TENANT] = ANONYMOUS_TENANT
            return self._check_loopback_host(scope)
        if path in _PUBLIC_PATHS:
            return None
        auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
        scheme, _, given = auth.partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            return _unauthorized("You didn't provide an API key: send it as 'Authorization: Bearer KEY'")
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

    @staticmethod
    def _check_loopback_host(scope) -> APIError | None:
        """No keys: loopback clients only, so a browser page whose name resolves to 127.0.0.1 (DNS rebinding) must
        not reach it: its requests carry that name as Host."""
        host = _host_name(scope)
        if host is not None and not _loopback_name(host):
            return APIError(403, f"this server has no API keys and serves loopback clients only; the Host "
                            f"{host!r} is not a loopback name", "permission_error", code="host_not_allowed")
        return None

    def _check_admin_key(self, scope) -> APIError | None:
        """The admin API has its own key (--admin-key): a tenant's key never opens it."""
        admin_key = self.state.admin_key
        if admin_key is None:
            return APIError(403, "the admin API is disabled: start the server with --admin-key (or "
                            "$INFERD_ADMIN_KEY)", "permission_error", code="admin_disabled")
        if not _bearer_matches(scope, admin_key):
            return _unauthorized("the admin API needs the admin key: 'Authorization: Bearer ADMIN_KEY'")
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
        body = b"".join(chunks)
        if _MAYBE_LONE_SURROGATE.search(body) and await asyncio.to_thread(_has_lone_surrogate, body):
            return APIError(400, "the request body holds a lone UTF-16 surrogate (e.g. \\ud800 without its pair): "
                            "that is not Unicode text", code="invalid_unicode"), receive
        return None, _replay([{"type": "http.request", "body": body, "more_body": False}], receive)


TENANT_DETAIL = "inferd.tenant_detail"  # a scope key: this request may see per-tenant metrics


# a JSON escape of a high surrogate not followed by a low one, a low one not after a high one, or a surrogate in
# UTF-8 form (which json.loads lets through): a quick screen of the raw body, confirmed by _has_lone_surrogate (an
# escaped backslash before "ud800" matches here, and is not one)
_MAYBE_LONE_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")


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


def _bearer_matches(scope, key: str) -> bool:
    auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
    scheme, _, given = auth.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


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


def _connection_aborter(send):
    """() -> None that drops the client's TCP connection without flushing (a client that reads nothing would keep a
    closed-but-unflushed socket forever), where the server's send exposes its transport (uvicorn's does); else
    None."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    abort = getattr(transport, "abort", None)
    return abort if callable(abort) else None


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _replay(messages: list, receive):
    async def replayed():
        if messages:
            return messages.pop(0)
        return await receive()

    return replayed
