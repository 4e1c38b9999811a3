"""LeaseKeeper: keeps the concurrency leases of a gateway's running requests alive in the limiter.

A concurrency slot in Redis is a lease that expires REDIS_LEASE_S after its last renewal, so that a gateway that dies
(SIGKILL, a lost host) gives its tenants' slots back within seconds instead of never. A live gateway therefore
renews, every `period` seconds, the leases of every request it admitted and has not finished, all in one call
(`Limiter.renew`: one pipeline to Redis; a no-op in process, where leases die with the process).

A failing limiter (Redis down or slow) is logged and tried again next period: the task never ends before stop(). A
lease that expired meanwhile is not brought back by a later renewal (its slot may have been handed out again).
"""

from __future__ import annotations

import asyncio
import logging

from inferd.config import REDIS_LEASE_RENEW_S
from inferd.gateway.limits import Limiter

log = logging.getLogger("inferd.gateway")


class LeaseKeeper:
    """The leases of open requests (add when admitted, discard when finished) and the task that renews them."""

    def __init__(self, limiter: Limiter, period: float | None = None):
        """period: seconds between renewals; by default REDIS_LEASE_RENEW_S, shortened to a third of the limiter's
        lease when that is shorter (`--redis-lease`)."""
        lease_s = getattr(limiter, "lease_s", None)  # RedisLimiter's; in-process leases never expire
        if period is None:
            period = REDIS_LEASE_RENEW_S if lease_s is None else min(REDIS_LEASE_RENEW_S, lease_s / 3)
        if period <= 0:
            raise ValueError("the lease renewal period must be > 0 seconds")
        if lease_s is not None and period > lease_s / 2:  # one lost renewal must not cost a live request its slot
            raise ValueError(f"the lease renewal period ({period:g} s) must be at most half the lease ({lease_s:g} s)")
        self.limiter = limiter
        self.period = period
        self._leases: dict[str, str] = {}  # lease id -> tenant
        self._task: asyncio.Task | None = None
        self.renewals = 0  # successful renewals that carried at least one lease
        self.failures = 0  # renewals that failed (the limiter was unavailable)

    def add(self, tenant: str, lease_id: str) -> None:
        self._leases[lease_id] = tenant

    def discard(self, lease_id: str) -> None:
        self._leases.pop(lease_id, None)

    def __len__(self) -> int:
        return len(self._leases)

    def start(self) -> None:
        """Starts the renewing task on the running loop (again after stop()); a no-op while it runs."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="inferd-lease-keeper")

    def stop(self) -> None:
        """Stops renewing (shutdown). The leases still held expire on their own, or are settled."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def renew_now(self) -> bool:
        """Renews every lease held now, once. False when the limiter failed (logged; the next period tries again)."""
        leases = [(tenant, lease_id) for lease_id, tenant in self._leases.items()]
        if not leases:
            return True
        try:
            await self.limiter.renew(leases)
        except Exception as e:  # noqa: BLE001 - Redis down, or anything else: the task must live on
            self.failures += 1
            log.warning("renewing %d concurrency lease(s) failed (%s); retrying in %g s", len(leases), e,
                        self.period)
            return False
        self.renewals += 1
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            await self.renew_now()  # never raises: a failure is logged and the next period tries again
