"""How a generation reaches its HTTP client. A non-streaming one runs when its response is sent (a JSON body); a
streaming one waits (up to the keep-alive interval) for its worker and first event, so that a refusal is still an
HTTP error, and then becomes a text/event-stream whose failures are in-band error events. A client that disconnects
aborts the generation; one that stops reading has its connection closed after --sse-write-timeout.

Releasing is not done here: the Generation releases its ticket itself (inferd/api/generation.py); every way out of
this module only closes it (synchronous, idempotent), and nothing in the cleanup awaits."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..config import TIERS
from ..gateway.tenants import Tenant
from .errors import APIError
from .generation import Generation
from .middleware.request_context import ABORT_CONNECTION
from .refusals import worker_error
from .request_tier import requested_tier_rank, requested_timeout
from .responses import SSE_DONE, complete, first_event, sse, stream
from .serving import Prepared

log = logging.getLogger("inferd.api")


@dataclass(frozen=True)
class Shape:
    """How one API writes a generation: its whole (non-streaming) body, its event stream (given the events iterator
    and the first event), the stream's in-band end when the request fails before its first event, and an HTTP error.
    The OpenAI shape is inferd/api/responses.py's; the Responses and Messages APIs have their own."""
    complete: Callable[[Generation], Awaitable[dict]]
    stream: Callable[[Generation, AsyncIterator, object], AsyncIterator[bytes]]
    stream_error: Callable[[Exception], list[bytes]]
    error_response: Callable[[APIError], Response]


OPENAI = Shape(complete, stream, lambda e: [sse(worker_error(e).body()), SSE_DONE], lambda e: e.response())


async def respond(request: Request, prep: Prepared, tenant: Tenant, shape: Shape = OPENAI) -> Response:
    """Admission (quota, queue, overload) in the tier the request asks for, then the generation: a JSON body, or
    an SSE stream. Refusals before the response starts are HTTP errors; after it, in-band error events."""
    state = request.app.state.inferd
    tier_rank = requested_tier_rank(request, tenant)
    generation = await state.generation.admit(prep, tenant, tier_rank, requested_timeout(request, tier_rank))
    headers = generation.ticket.decision.headers()
    if prep.stream:
        return await _start_stream(state, generation, request, headers, shape)

    async def run() -> Response:
        await generation.start()
        body = await shape.complete(generation)
        response = JSONResponse(body, headers={**headers, **_dispatch_headers(generation.ticket)})
        _observe_overhead(state, generation)
        return response

    return _GenerationResponse(run, generation, shape)


class _GenerationResponse(Response):
    """A non-streaming generation, run when the response is sent rather than in the route: by then the route's
    frame, and FastAPI's that parsed the body, are gone, so a request waiting in the queue holds its token ids but
    not its request body. Errors before the response starts are still HTTP errors; a client that disconnects
    aborts the generation."""

    def __init__(self, run, generation: Generation, shape: Shape):
        super().__init__(status_code=200)
        self.run = run
        self.generation = generation
        self.shape = shape

    async def __call__(self, scope, receive, send) -> None:
        try:
            response = await until_disconnect(receive, self.run())
        except ClientGone:  # nobody is left to read a response: do not log it as a server error
            response = Response(status_code=499)
        except APIError as e:
            response = self.shape.error_response(e)
        except Exception as e:  # QueueTimeout, Overloaded (shed), NoWorkerAvailable, WorkerDead, RequestRejected..
            self.generation.error = e
            response = self.shape.error_response(worker_error(e))
        finally:
            self.generation.close()
        await response(scope, receive, send)


def _observe_overhead(state, generation: Generation) -> None:
    """The gateway's own time: receipt to response, less the queue and the worker (dispatch to last output)."""
    now = time.perf_counter()
    worker_s = (generation.last_output_at or now) - (generation.dispatched_at or now)
    queue_s = generation.ticket.queue_seconds
    state.metrics.gateway_overhead.observe(max(0.0, now - generation.prep.received_at - queue_s - worker_s))


def _dispatch_headers(ticket) -> dict[str, str]:
    headers = {"x-inferd-queue-seconds": f"{ticket.queue_seconds:.4f}",
               "x-inferd-dispatch-seq": str(ticket.dispatch_seq),
               "x-inferd-dispatched-ahead": str(ticket.dispatched_ahead), "x-inferd-tier": TIERS[ticket.tier_rank]}
    worker = ticket.first_worker
    if worker is not None and worker.hello is not None:  # where it ran (first dispatch): routing is observable
        headers["x-inferd-worker"] = worker.hello.worker_id
        headers["x-inferd-model-version"] = worker.hello.version
    return headers


async def _start_stream(state, generation: Generation, request: Request, headers: dict[str, str],
                        shape: Shape) -> Response:
    """Waits (up to the keep-alive interval) for a worker and the first event, so that a refusal is still an HTTP
    error; a stream still waiting after that starts with keep-alive comments and ends in band if it fails. From
    here the response body owns the generation (its cleanup closes it)."""

    async def start():
        await generation.start()
        return await first_event(generation)

    starting = asyncio.ensure_future(start())
    try:
        await until_disconnect(request.receive, asyncio.wait({starting}, timeout=state.sse_keepalive_s))
        sse_headers = {**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        if starting.done():
            starting.result()  # raises a refusal as an HTTP error
            sse_headers.update(_dispatch_headers(generation.ticket))
    except BaseException as e:
        starting.cancel()
        if isinstance(e, Exception) and not isinstance(e, (ClientGone, APIError)):
            generation.error = e
        generation.close()
        if isinstance(e, ClientGone):
            return Response(status_code=499)
        if isinstance(e, Exception) and not isinstance(e, APIError):
            raise worker_error(e) from None
        raise
    abort_connection = request.scope.get(ABORT_CONNECTION)

    def on_write_timeout() -> None:
        log.warning("closing the stream of %s: its client read nothing for %g s (--sse-write-timeout)",
                    generation.prep.id, state.sse_write_timeout)
        state.metrics.sse_write_timeouts.inc()
        generation.close()
        if abort_connection is not None:
            abort_connection()

    return _SSEResponse(_stream_body(generation, starting, state.sse_keepalive_s, shape), state.sse_write_timeout,
                        on_write_timeout,
                        media_type="text/event-stream", headers=sse_headers)


async def _stream_body(generation: Generation, starting: asyncio.Future, keepalive_s: float, shape: Shape):
    try:
        while not starting.done():
            await asyncio.wait({starting}, timeout=keepalive_s)
            if not starting.done():
                yield b": keep-alive\n\n"
        try:
            events, first = starting.result()
        except Exception as e:  # queue timeout, shed, worker lost, ...: the headers are gone, the error goes in band
            generation.error = e
            for chunk in shape.stream_error(e):
                yield chunk
            return
        async for chunk in shape.stream(generation, events, first):
            yield chunk
    finally:  # synchronous only: on a disconnect this runs in a cancelled scope, where every await raises again
        starting.cancel()
        generation.close()


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


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def until_disconnect(receive, coro):
    """Awaits coro unless the client disconnects first (receive: the ASGI receive): then coro is cancelled (which
    aborts the request in the worker) and ClientGone is raised."""
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
    raise ClientGone()


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
