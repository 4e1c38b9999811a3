"""How the gateway's refusals and the workers' failures look to a client: each as an APIError (OpenAI's error shape,
the status and code a client can act on, Retry-After where waiting helps), and which of them a model version answers
for (the rollout's error rate)."""

from __future__ import annotations

from ..gateway.admission import Overloaded, QueueShareExceeded, QueueTimeout, RateLimited
from ..gateway.limits import LimiterUnavailable
from ..gateway.router import NoWorkerAvailable
from ..worker.client import RequestFailed, RequestRejected, WorkerDead, WorkerUnavailable
from .errors import APIError, internal_error, invalid


def not_ready(reason: str, retry_after: int = 1) -> APIError:
    return APIError(503, reason, code="not_ready", headers={"Retry-After": str(retry_after)})


def rate_limited(e: RateLimited) -> APIError:
    """The tenant over its own limits: a 429 with the limiter's headers (and Retry-After unless it can never fit)."""
    d = e.decision
    headers = d.headers()
    if d.reason == "too_large":
        return APIError(429, e.message, "rate_limit_exceeded", code="request_too_large", headers=headers)
    headers["Retry-After"] = d.retry_after_header
    return APIError(429, e.message, "rate_limit_exceeded", code="rate_limit_exceeded", headers=headers)


def worker_error(exc: Exception) -> APIError:
    """A refusal of the gateway or a failure of the worker side as the client sees it."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RateLimited):
        return rate_limited(exc)
    if isinstance(exc, RequestRejected):
        return invalid(str(exc), code="invalid_value")
    if isinstance(exc, NoWorkerAvailable):
        return not_ready(str(exc), exc.retry_after)
    if isinstance(exc, Overloaded):
        return APIError(503, str(exc), code="overloaded", headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, LimiterUnavailable):
        return APIError(503, f"{exc}; retry shortly", code="limiter_unavailable",
                        headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, QueueShareExceeded):
        return APIError(429, str(exc), "rate_limit_exceeded", code="queue_share_exceeded",
                        headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, QueueTimeout):
        return APIError(503, str(exc), code="queue_timeout", headers={"Retry-After": "1"})
    if isinstance(exc, WorkerDead):
        return APIError(503, f"the worker serving this request was lost and no other could take it over: {exc}",
                        code="worker_lost", headers={"Retry-After": "1"})
    if isinstance(exc, WorkerUnavailable):  # its worker shut down and no other could take the request over
        return APIError(503, f"the request was stopped by a shutdown: {exc}", code="shutdown",
                        headers={"Retry-After": "1"})
    if isinstance(exc, RequestFailed) and exc.code is not None:  # the request's own fault: its grammar too slow
        return invalid(str(exc), code=exc.code)
    if isinstance(exc, RequestFailed):
        return internal_error("the engine failed this request", exc, code="engine_error")
    return internal_error("internal error", exc)


def is_server_error(exc: Exception | None) -> bool:
    """A failure on the server's side that a version answers for (the rollout's error rate): the engine failed the
    request, its worker died with it, or an unexpected error. Not the client's invalid request, not the gateway's
    refusals (quota, overload, queue deadline), not a drain moving it elsewhere."""
    if exc is None:
        return False
    if isinstance(exc, (RequestRejected, Overloaded, QueueShareExceeded, QueueTimeout, NoWorkerAvailable,
                        LimiterUnavailable, APIError)):
        return False
    if isinstance(exc, RequestFailed) and exc.code is not None:  # the request's own grammar ran out of time
        return False
    return isinstance(exc, (RequestFailed, WorkerDead)) or not isinstance(exc, WorkerUnavailable)
