"""Per-tenant quotas: requests per window (RPM), tokens per window (TPM) and concurrent requests.

RPM and TPM are token buckets: capacity = the limit, refilled continuously at limit / window per second (window =
`--rate-window`, 60 s by default). Tokens are reserved at admission (prompt tokens + the effective max_tokens of
every choice), so a tenant can never overshoot its TPM while its requests run; `settle` gives the unused part back
at the end (capped at the capacity) and releases the concurrency slot. A reservation is all or nothing: a request
that does not fit every limit takes nothing.

Two backends with one contract: `InProcessLimiter` (one `inferd serve` process) and `RedisLimiter`
(inferd/gateway/redis_limits.py: several processes share the same buckets; reserve and settle are atomic Lua scripts
on Redis' clock).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

# why a reservation was refused
REQUESTS, TOKENS, CONCURRENCY, TOO_LARGE = "requests", "tokens", "concurrency", "too_large"


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits; None = unlimited."""
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None


@dataclass
class Decision:
    """The answer to a reservation, with what the x-ratelimit-* headers report (after it, when allowed)."""
    allowed: bool
    reason: str | None = None  # REQUESTS | TOKENS | CONCURRENCY | TOO_LARGE when refused
    retry_after: float = 0.0  # seconds until this reservation would fit (refused, not TOO_LARGE)
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: float = 0.0  # seconds until the request bucket is full again
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens: float = 0.0

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers, for the limits this tenant has."""
        out: dict[str, str] = {}
        if self.limit_requests is not None:
            out["x-ratelimit-limit-requests"] = str(self.limit_requests)
            out["x-ratelimit-remaining-requests"] = str(max(0, self.remaining_requests or 0))
            out["x-ratelimit-reset-requests"] = format_duration(self.reset_requests)
        if self.limit_tokens is not None:
            out["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            out["x-ratelimit-remaining-tokens"] = str(max(0, self.remaining_tokens or 0))
            out["x-ratelimit-reset-tokens"] = format_duration(self.reset_tokens)
        return out

    @property
    def retry_after_header(self) -> str:
        """Whole seconds, rounded up, at least 1."""
        return str(max(1, math.ceil(self.retry_after - 1e-9)))


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: "1s", "6m0s", "0.5s" ("0s" when full)."""
    if seconds <= 0:
        return "0s"
    if seconds < 60:
        text = f"{seconds:.3f}".rstrip("0").rstrip(".")
        return f"{text}s"
    minutes, rest = divmod(int(math.ceil(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{rest}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m{rest}s"


class LimiterUnavailable(Exception):
    """The limits store (Redis) failed or did not answer: the request is refused with 503 and Retry-After; nothing
    about the store (its host) reaches the client."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class Limiter(Protocol):
    window: float

    async def reserve(self, tenant: str, limits: TenantLimits, lease_id: str, tokens: int) -> Decision:
        """Takes one request, `tokens` tokens and a concurrency slot (held by lease_id), or nothing."""
        ...

    async def settle(self, tenant: str, limits: TenantLimits, lease_id: str, reserved_tokens: int,
                     used_tokens: int, refund_request: bool = False) -> None:
        """Ends a reservation: gives back reserved - used tokens (and the request itself when refund_request: the
        service refused or timed it out before any work), releases the concurrency slot."""
        ...

    async def renew(self, leases: list[tuple[str, str]]) -> None:
        """Extends the (tenant, lease_id) leases of requests that still run (a store whose leases expire)."""
        ...

    async def close(self) -> None: ...


class _Bucket:
    __slots__ = ("level", "at")

    def __init__(self, capacity: float, now: float):
        self.level = capacity
        self.at = now

    def refill(self, capacity: float, rate: float, now: float) -> float:
        self.level = min(capacity, self.level + rate * (now - self.at))
        self.at = now
        return self.level


class InProcessLimiter:
    """The buckets in this process's memory (time.monotonic). asyncio-only: no locks needed."""

    def __init__(self, window: float = 60.0, clock=time.monotonic):
        if window <= 0:
            raise ValueError("the rate window must be > 0 seconds")
        self.window = window
        self._clock = clock
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}
        self._leases: dict[str, set[str]] = {}  # tenant -> lease ids holding a concurrency slot

    def _bucket(self, table: dict[str, _Bucket], tenant: str, capacity: int, now: float) -> tuple[_Bucket, float]:
        bucket = table.get(tenant)
        if bucket is None:
            bucket = table[tenant] = _Bucket(capacity, now)
        rate = capacity / self.window
        bucket.refill(capacity, rate, now)
        return bucket, rate

    async def reserve(self, tenant: str, limits: TenantLimits, lease_id: str, tokens: int) -> Decision:
        return self.reserve_now(tenant, limits, lease_id, tokens)

    def reserve_now(self, tenant: str, limits: TenantLimits, lease_id: str, tokens: int) -> Decision:
        now = self._clock()
        d = Decision(allowed=True, limit_requests=limits.rpm, limit_tokens=limits.tpm)
        req = tok = None
        if limits.rpm is not None:
            req, req_rate = self._bucket(self._requests, tenant, limits.rpm, now)
        if limits.tpm is not None:
            tok, tok_rate = self._bucket(self._tokens, tenant, limits.tpm, now)
        waits: list[tuple[float, str]] = []
        if tok is not None and tokens > limits.tpm:
            d.allowed, d.reason = False, TOO_LARGE
        else:
            if req is not None and req.level < 1:
                waits.append(((1 - req.level) / req_rate, REQUESTS))
            if tok is not None and tok.level < tokens:
                waits.append(((tokens - tok.level) / tok_rate, TOKENS))
            held = self._leases.get(tenant, set())
            if limits.max_concurrency is not None and len(held) >= limits.max_concurrency:
                waits.append((1.0, CONCURRENCY))  # a slot frees when a request ends: no rate to compute it from
            if waits:
                d.allowed = False
                d.retry_after, d.reason = max(waits)
        if d.allowed:
            if req is not None:
                req.level -= 1
            if tok is not None:
                tok.level -= tokens
            self._leases.setdefault(tenant, set()).add(lease_id)
        if req is not None:
            d.remaining_requests = math.floor(req.level)
            d.reset_requests = (limits.rpm - req.level) / req_rate
        if tok is not None:
            d.remaining_tokens = math.floor(tok.level)
            d.reset_tokens = (limits.tpm - tok.level) / tok_rate
        return d

    async def settle(self, tenant: str, limits: TenantLimits, lease_id: str, reserved_tokens: int,
                     used_tokens: int, refund_request: bool = False) -> None:
        now = self._clock()
        refund = max(0, reserved_tokens - used_tokens)
        if limits.tpm is not None and refund:
            bucket, _ = self._bucket(self._tokens, tenant, limits.tpm, now)
            bucket.level = min(limits.tpm, bucket.level + refund)
        if limits.rpm is not None and refund_request:
            bucket, _ = self._bucket(self._requests, tenant, limits.rpm, now)
            bucket.level = min(limits.rpm, bucket.level + 1)
        held = self._leases.get(tenant)
        if held is not None:
            held.discard(lease_id)
            if not held:
                del self._leases[tenant]

    def in_flight(self, tenant: str) -> int:
        return len(self._leases.get(tenant, ()))

    async def renew(self, leases: list[tuple[str, str]]) -> None:
        pass  # in-process leases never expire: they die with the process

    def leases_held(self) -> dict[str, int]:
        """tenant -> concurrency slots held now (metrics)."""
        return {tenant: len(held) for tenant, held in self._leases.items()}

    async def close(self) -> None:
        pass
