"""The waiting queue: requests admitted but not yet bound to a worker.

Priority bands by tier (band 0 = interactive before 1 = standard before 2 = batch). Inside a band, fair sharing
between tenants by virtual token counters (VTC, Sheng et al., OSDI 2024): each tenant has a counter of the weighted
service it received in that band (prompt tokens x FAIRNESS_PROMPT_WEIGHT when dispatched, generated tokens x
FAIRNESS_OUTPUT_WEIGHT as they arrive, divided by the tenant's weight); the next request comes from the backlogged
tenant with the smallest counter, FCFS inside a tenant. A tenant that becomes backlogged is lifted to the band's
current minimum (or, when nobody else waits, to where the band's service has got to), so that an idle period earns
no credit to starve others with later. The `fcfs` policy (arrival order inside a band) is kept for comparison.

The queue is bounded by request count and by queued (reserved) tokens; `fits` tells the admission code whether one
more would; the queue itself never grows past its bounds. Pure data structure: no asyncio, no clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..config import FAIRNESS_OUTPUT_WEIGHT, FAIRNESS_PROMPT_WEIGHT, TIERS

POLICIES = ("vtc", "fcfs")


@dataclass(eq=False)
class Waiter:
    """One admitted request in the queue."""
    tenant: str
    band: int
    weight: float
    prompt_tokens: int
    reserved_tokens: int  # prompt + max_tokens of every choice: what bounds the queue
    expected_tokens: float  # prompt + expected output: what the wait estimate drains
    seq: int = 0  # arrival order (set by the queue)
    payload: Any = None  # the admission code's own object


@dataclass
class _Band:
    queues: dict[str, deque] = field(default_factory=dict)  # tenant -> its waiters in arrival order (backlogged)
    counters: dict[str, float] = field(default_factory=dict)  # tenant -> virtual service counter
    floor: float = 0.0  # the counter of the last tenant served: where a newcomer to an empty band starts


class WaitingQueue:
    def __init__(self, max_requests: int, max_tokens: int, policy: str = "vtc"):
        if policy not in POLICIES:
            raise ValueError(f"unknown fairness policy {policy!r} (choose {' or '.join(POLICIES)})")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.policy = policy
        self.bands = [_Band() for _ in TIERS]
        self.num_requests = 0
        self.num_tokens = 0  # reserved tokens of the waiters
        self.expected_tokens = [0.0] * len(TIERS)  # per band
        self.num_by_band = [0] * len(TIERS)
        self.tokens_by_band = [0] * len(TIERS)  # reserved tokens of the waiters, per band
        self._by_tenant: dict[str, list[int]] = {}  # tenant -> [waiters, their reserved tokens], all bands
        self._seq = 0

    def __len__(self) -> int:
        return self.num_requests

    def fits(self, reserved_tokens: int) -> bool:
        return self.num_requests < self.max_requests and self.num_tokens + reserved_tokens <= self.max_tokens

    def tenant_load(self, tenant: str) -> tuple[int, int]:
        """(requests, reserved tokens) of one tenant's waiters, all bands together."""
        held = self._by_tenant.get(tenant)
        return (held[0], held[1]) if held is not None else (0, 0)

    def expected_ahead(self, band: int) -> float:
        """Expected tokens of the waiters that go before a new request of this band (its band and the better)."""
        return sum(self.expected_tokens[: band + 1])

    # ---- in and out ------------------------------------------------------------------------------------------
    def push(self, w: Waiter) -> None:
        if not self.fits(w.reserved_tokens):
            raise OverflowError("the waiting queue is full")  # the admission code checks fits() first
        band = self.bands[w.band]
        queue = band.queues.get(w.tenant)
        if queue is None:  # the tenant becomes backlogged in this band: lift its counter
            start = min(band.counters[t] for t in band.queues) if band.queues else band.floor
            band.counters[w.tenant] = max(band.counters.get(w.tenant, 0.0), start)
            queue = band.queues[w.tenant] = deque()
        self._seq += 1
        w.seq = self._seq
        queue.append(w)
        self._count(w, +1)

    def peek(self) -> Waiter | None:
        """The waiter that goes next: the best band's, by policy."""
        for band in self.bands:
            if not band.queues:
                continue
            if self.policy == "fcfs":
                return min((q[0] for q in band.queues.values()), key=lambda w: w.seq)
            # VTC: the least served backlogged tenant; ties go to the earlier arrival
            tenant = min(band.queues, key=lambda t: (band.counters[t], band.queues[t][0].seq))
            return band.queues[tenant][0]
        return None

    def pop(self, w: Waiter) -> float:
        """Takes w out (dispatched): its prompt is charged to its tenant's counter. Returns the amount charged."""
        self.remove(w)
        amount = self.charge(w.band, w.tenant, w.weight, prompt_tokens=w.prompt_tokens)
        self.bands[w.band].floor = self.bands[w.band].counters[w.tenant]
        return amount

    def remove(self, w: Waiter) -> bool:
        """Takes w out without service (timed out, cancelled). False if it was not waiting."""
        band = self.bands[w.band]
        queue = band.queues.get(w.tenant)
        if queue is None or w not in queue:
            return False
        queue.remove(w)
        if not queue:
            del band.queues[w.tenant]
        self._count(w, -1)
        return True

    def charge(self, band: int, tenant: str, weight: float, prompt_tokens: int = 0, output_tokens: int = 0
               ) -> float:
        """Adds service to a tenant's counter in a band; returns the weighted amount."""
        amount = (FAIRNESS_PROMPT_WEIGHT * prompt_tokens + FAIRNESS_OUTPUT_WEIGHT * output_tokens) / weight
        counters = self.bands[band].counters
        counters[tenant] = counters.get(tenant, 0.0) + amount
        return amount

    def counter(self, band: int, tenant: str) -> float:
        return self.bands[band].counters.get(tenant, 0.0)

    def waiters(self) -> list[Waiter]:
        return [w for band in self.bands for q in band.queues.values() for w in q]

    def _count(self, w: Waiter, sign: int) -> None:
        self.num_requests += sign
        self.num_tokens += sign * w.reserved_tokens
        self.num_by_band[w.band] += sign
        self.tokens_by_band[w.band] += sign * w.reserved_tokens
        held = self._by_tenant.setdefault(w.tenant, [0, 0])
        held[0] += sign
        held[1] += sign * w.reserved_tokens
        if held[0] == 0:
            del self._by_tenant[w.tenant]
        self.expected_tokens[w.band] += sign * w.expected_tokens
        if self.num_by_band[w.band] == 0:
            self.expected_tokens[w.band] = 0.0  # no float drift left behind by an empty band
