"""The waiting queue: requests admitted but not yet bound to a worker.

Priority tiers (tier rank 0 = interactive before 1 = standard before 2 = batch). Inside a tier, fair sharing
between tenants by virtual token counters (VTC, Sheng et al., OSDI 2024): each tenant has a counter of the weighted
service it received in that tier (prompt tokens x FAIRNESS_PROMPT_WEIGHT when dispatched, generated tokens x
FAIRNESS_OUTPUT_WEIGHT as they arrive, divided by the tenant's weight); the next request comes from the backlogged
tenant with the smallest counter, FCFS inside a tenant. A tenant that becomes backlogged is lifted to the tier's
current minimum (or, when nobody else waits, to where the tier's service has got to), so that an idle period earns
no credit to starve others with later. The `fcfs` policy (arrival order inside a tier) is kept for comparison.

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
    tier_rank: int
    weight: float
    prompt_tokens: int
    reserved_tokens: int  # prompt + max_tokens of every choice: what bounds the queue
    expected_tokens: float  # prompt + expected output: what the wait estimate drains
    seq: int = 0  # arrival order (set by the queue)
    payload: Any = None  # the admission code's own object


@dataclass
class _TierQueue:
    queues: dict[str, deque] = field(default_factory=dict)  # tenant -> its waiters in arrival order (backlogged)
    counters: dict[str, float] = field(default_factory=dict)  # tenant -> virtual service counter
    floor: float = 0.0  # the counter of the last tenant served: where a newcomer to an empty tier starts


class WaitingQueue:
    def __init__(self, max_requests: int, max_tokens: int, policy: str = "vtc"):
        if policy not in POLICIES:
            raise ValueError(f"unknown fairness policy {policy!r} (choose {' or '.join(POLICIES)})")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.policy = policy
        self.tier_queues = [_TierQueue() for _ in TIERS]
        self.num_requests = 0
        self.num_tokens = 0  # reserved tokens of the waiters
        self.expected_tokens = [0.0] * len(TIERS)  # per tier
        self.num_by_tier = [0] * len(TIERS)
        self.tokens_by_tier = [0] * len(TIERS)  # reserved tokens of the waiters, per tier
        self._by_tenant: dict[str, list[int]] = {}  # tenant -> [waiters, their reserved tokens], all tiers
        self._seq = 0

    def __len__(self) -> int:
        return self.num_requests

    def fits(self, reserved_tokens: int) -> bool:
        return self.num_requests < self.max_requests and self.num_tokens + reserved_tokens <= self.max_tokens

    def tenant_load(self, tenant: str) -> tuple[int, int]:
        """(requests, reserved tokens) of one tenant's waiters, all tiers together."""
        held = self._by_tenant.get(tenant)
        return (held[0], held[1]) if held is not None else (0, 0)

    def expected_ahead(self, tier_rank: int) -> float:
        """Expected tokens of the waiters that go before a new request of this tier (its tier and the better)."""
        return sum(self.expected_tokens[: tier_rank + 1])

    # ---- in and out ------------------------------------------------------------------------------------------
    def push(self, w: Waiter) -> None:
        if not self.fits(w.reserved_tokens):
            raise OverflowError("the waiting queue is full")  # the admission code checks fits() first
        tier_queue = self.tier_queues[w.tier_rank]
        queue = tier_queue.queues.get(w.tenant)
        if queue is None:  # the tenant becomes backlogged in this tier: lift its counter
            start = min(tier_queue.counters[t] for t in tier_queue.queues) if tier_queue.queues else tier_queue.floor
            tier_queue.counters[w.tenant] = max(tier_queue.counters.get(w.tenant, 0.0), start)
            queue = tier_queue.queues[w.tenant] = deque()
        self._seq += 1
        w.seq = self._seq
        queue.append(w)
        self._count(w, +1)

    def peek(self, tier_rank: int | None = None) -> Waiter | None:
        """The waiter that goes next: the best tier's (or the given tier's), by policy."""
        for rank, tier_queue in enumerate(self.tier_queues):
            if not tier_queue.queues or (tier_rank is not None and rank != tier_rank):
                continue
            if self.policy == "fcfs":
                return min((q[0] for q in tier_queue.queues.values()), key=lambda w: w.seq)
            # VTC: the least served backlogged tenant; ties go to the earlier arrival
            tenant = min(tier_queue.queues, key=lambda t: (tier_queue.counters[t], tier_queue.queues[t][0].seq))
            return tier_queue.queues[tenant][0]
        return None

    def pop(self, w: Waiter) -> float:
        """Takes w out (dispatched): its prompt is charged to its tenant's counter. Returns the amount charged."""
        self.remove(w)
        amount = self.charge(w.tier_rank, w.tenant, w.weight, prompt_tokens=w.prompt_tokens)
        self.tier_queues[w.tier_rank].floor = self.tier_queues[w.tier_rank].counters[w.tenant]
        return amount

    def remove(self, w: Waiter) -> bool:
        """Takes w out without service (timed out, cancelled). False if it was not waiting."""
        tier_queue = self.tier_queues[w.tier_rank]
        queue = tier_queue.queues.get(w.tenant)
        if queue is None or w not in queue:
            return False
        queue.remove(w)
        if not queue:
            del tier_queue.queues[w.tenant]
        self._count(w, -1)
        return True

    def charge(self, tier_rank: int, tenant: str, weight: float, prompt_tokens: int = 0, output_tokens: int = 0
               ) -> float:
        """Adds service to a tenant's counter in a tier; returns the weighted amount."""
        amount = (FAIRNESS_PROMPT_WEIGHT * prompt_tokens + FAIRNESS_OUTPUT_WEIGHT * output_tokens) / weight
        counters = self.tier_queues[tier_rank].counters
        counters[tenant] = counters.get(tenant, 0.0) + amount
        return amount

    def counter(self, tier_rank: int, tenant: str) -> float:
        return self.tier_queues[tier_rank].counters.get(tenant, 0.0)

    def waiters(self) -> list[Waiter]:
        return [w for tier_queue in self.tier_queues for q in tier_queue.queues.values() for w in q]

    def _count(self, w: Waiter, sign: int) -> None:
        self.num_requests += sign
        self.num_tokens += sign * w.reserved_tokens
        self.num_by_tier[w.tier_rank] += sign
        self.tokens_by_tier[w.tier_rank] += sign * w.reserved_tokens
        held = self._by_tenant.setdefault(w.tenant, [0, 0])
        held[0] += sign
        held[1] += sign * w.reserved_tokens
        if held[0] == 0:
            del self._by_tenant[w.tenant]
        self.expected_tokens[w.tier_rank] += sign * w.expected_tokens
        if self.num_by_tier[w.tier_rank] == 0:
            self.expected_tokens[w.tier_rank] = 0.0  # no float drift left behind by an empty tier
