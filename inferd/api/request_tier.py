"""What a request asks of its tier, from its headers: x-inferd-tier (a lower tier than its tenant's, never a higher
one) and x-inferd-queue-timeout (seconds it may wait in the queue, capped by its tier's maximum)."""

from __future__ import annotations

from starlette.requests import Request

from ..config import MAX_QUEUE_TIMEOUT_BY_TIER_S, MAX_QUEUE_TIMEOUT_S, TIERS
from ..gateway.tenants import Tenant
from .errors import APIError, invalid

TIER_HEADER = "x-inferd-tier"  # a request may ask for a lower tier than its tenant's, never a higher one
QUEUE_TIMEOUT_HEADER = "x-inferd-queue-timeout"  # seconds the request may wait for a worker (default: its tier's)


def requested_tier_rank(request: Request, tenant: Tenant) -> int:
    asked = request.headers.get(TIER_HEADER)
    if asked is None:
        return tenant.tier_rank
    asked = asked.strip().lower()
    if asked not in TIERS:
        raise invalid(f"{TIER_HEADER} must be one of {', '.join(TIERS)}, got {asked!r}", param=TIER_HEADER)
    if TIERS.index(asked) < tenant.tier_rank:
        raise APIError(403, f"tenant {tenant.name} is in tier {tenant.tier} and may not ask for tier {asked} "
                       "(a request may ask for a lower tier, never a higher one)", "permission_error",
                       param=TIER_HEADER, code="tier_not_allowed")
    return TIERS.index(asked)


def requested_timeout(request: Request, tier_rank: int) -> float | None:
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
    return min(value, MAX_QUEUE_TIMEOUT_BY_TIER_S[TIERS[tier_rank]])
