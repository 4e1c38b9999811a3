"""The gateway: a request's way from "valid" to "bound to a worker" (docs/architecture.md, "The request path").

`Gateway.admit` reserves the tenant's quota (429 when the tenant is over its own limits), then either binds the
request to a worker that has room now, or puts it in the queue, or refuses it at once with 503 `overloaded`
(the queue is full, or the wait it would face, queued work / measured drain rate, is over its deadline); Retry-After
comes from the drain rate. A waiting request leaves the queue when a worker has room for it (`Ticket.wait` returns the
worker), or at its deadline with QueueTimeout, having cost no GPU time. `Ticket.finish` settles the quota with the
tokens really used and frees the worker's room, which dispatches the next in the queue.

Room: a worker offers max_num_seqs + worker_queue_depth seats (sequences), shared between the tiers by
`--tier-shares` (inferd/engine/tier_shares.py): a request fits where a seat is free, or where its tier holds fewer
than its own seats while other tiers hold more than theirs (the worker is then over-filled by at most those, and its
engine takes the seats back from the tiers that borrowed them, by preemption). The next request dispatched comes
from the tier the shares name (the least filled below its own seats, then the most important); a tier with no room
anywhere does not hold up the others. Under `--tier-shares strict` a worker holds up to its seats of a tier or
better instead (work of a worse tier does not count against a better one) and tiers go in strict priority.

When the queue is full, a request of a better tier sheds the newest waiter of the worst tier below it (503
`overloaded` to that one), so that priority holds at the bound too.

Words: a *tier* is the named class a tenant (or a request, x-inferd-tier) is in: interactive, standard, batch
(config.TIERS); `tier_rank` is the same tier as the integer the code compares, its index in TIERS (0 =
interactive, served first). The engine receives the tier rank as the request's `priority`. The *queue* is where
admitted requests wait for a worker (inferd/gateway/waiting_queue.py); "line" is only ever a Batch API input line.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import (
    DEFAULT_AUTOSCALE_WINDOW_S,
    DEFAULT_MAX_QUEUE_REQUESTS,
    DEFAULT_MAX_QUEUE_TOKENS,
    DEFAULT_QUEUE_TIMEOUT_S,
    DEFAULT_TENANT_QUEUE_SHARE,
    DEFAULT_TIER_SHARES,
    DEFAULT_WORKER_QUEUE_DEPTH,
    SETTLE_GIVE_UP_S,
    SETTLE_RETRY_S,
    TIERS,
)
from ..engine.tier_shares import TierShares
from ..telemetry.metrics import Metrics
from ..worker.client import WorkerClient
from .failover import Failover
from .leases import LeaseKeeper
from .limits import Decision, InProcessLimiter, Limiter
from .router import NoWorkerAvailable, Router
from .tenants import Tenant
from .waiting_queue import Waiter, WaitingQueue

log = logging.getLogger("inferd.gateway")

DRAIN_WINDOW_S = 30.0  # the drain rate is measured over this recent window (of busy time)
MAX_RETRY_AFTER_S = 120  # a Retry-After computed from the drain rate is capped here
NO_VERSION = "\0none"  # a version no worker serves: "wait" (no candidate matches it)
SHUTDOWN_RETRY_AFTER_S = 5  # Retry-After while the server shuts down (a restart or another replica takes over)


class RateLimited(Exception):
    """The tenant is over its own limits: 429."""

    def __init__(self, tenant: Tenant, decision: Decision, tokens: int, window: float):
        self.tenant, self.decision, self.tokens, self.window = tenant, decision, tokens, window
        super().__init__(self.message)

    @property
    def message(self) -> str:
        d, t = self.decision, self.tenant
        assert d.reason is not None  # raised only for a refusal, and both limiters name every refusal's reason
        if d.reason == "too_large":
            return (f"Request too large for tenant {t.name}: it needs {self.tokens} tokens (prompt + max_tokens) "
                    f"but the tenant's limit is {t.tpm} tokens per {self.window:g} s. Reduce the prompt or "
                    "max_tokens.")
        what = {"requests": f"requests per {self.window:g} s (limit {t.rpm})",
                "tokens": f"tokens per {self.window:g} s (limit {t.tpm}, remaining {d.remaining_tokens}, requested "
                          f"{self.tokens})",
                "concurrency": f"concurrent requests (limit {t.max_concurrency})"}[d.reason]
        return f"Rate limit reached for tenant {t.name} on {what}. Retry after {d.retry_after_header} s."


class Overloaded(Exception):
    """The service is saturated: 503 with Retry-After."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class QueueShareExceeded(Exception):
    """The tenant already holds its share of the queue (so that one tenant cannot fill it): 429."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class QueueTimeout(Exception):
    """The request's deadline passed while it waited: it never reached a worker."""

    def __init__(self, waited: float):
        super().__init__(f"the request waited {waited:.1f} s in the queue without reaching a worker (its queue "
                         "deadline)")
        self.waited = waited


@dataclass
class GatewayOptions:
    max_queue_requests: int = DEFAULT_MAX_QUEUE_REQUESTS
    max_queue_tokens: int = DEFAULT_MAX_QUEUE_TOKENS
    queue_timeout: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_QUEUE_TIMEOUT_S))
    fairness: str = "vtc"
    worker_queue_depth: int = DEFAULT_WORKER_QUEUE_DEPTH
    # the most of the queue's requests and reserved tokens one tenant may hold (1.0: no per-tenant bound; a server
    # without a keys file has one tenant, and gets 1.0)
    tenant_queue_share: float = DEFAULT_TENANT_QUEUE_SHARE
    # each tier's nominal share of a worker's room (inferd/engine/tier_shares.py), or "strict"
    tier_shares: str = DEFAULT_TIER_SHARES


class DrainRate:
    """Tokens the workers get through per second of BUSY time (some request bound to a worker), over the recent
    window: prompt tokens when a request's first output arrives, generated tokens as they arrive. Idle time does not
    count, so after a quiet spell the rate is the service's capacity at once, not its recent (low) demand; a new busy
    period starts afresh. None while there is nothing to go on (idle, or under half a second of busy time)."""

    def __init__(self, window: float = DRAIN_WINDOW_S):
        self.window = window
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0
        self._busy_since: float | None = None

    def busy(self, now: float) -> None:
        """Work was bound to a worker while none was: a busy period starts (earlier events no longer count)."""
        if self._busy_since is None:
            self._busy_since = now
            self._events.clear()
            self._total = 0

    def idle(self) -> None:
        self._busy_since = None

    def record(self, now: float, tokens: int) -> None:
        if tokens > 0:
            self._events.append((now, tokens))
            self._total += tokens
            self._trim(now)

    def _trim(self, now: float) -> None:
        """Drops the events before the window (on every append too: memory stays bounded by the window's events
        even when nobody reads the rate)."""
        start = max(now - self.window, now if self._busy_since is None else self._busy_since)
        while self._events and self._events[0][0] < start:
            self._total -= self._events.popleft()[1]

    def rate(self, now: float) -> float | None:
        if self._busy_since is None:
            return None
        self._trim(now)
        span = now - max(now - self.window, self._busy_since)
        if span < 0.5 or len(self._events) < 3:
            return None
        return self._total / span


class Ticket:
    """An admitted request: its reservation, its place in the queue, then its worker."""

    def __init__(self, gateway: Gateway, tenant: Tenant, tier_rank: int, lease_id: str, reserved_tokens: int,
                 decision: Decision, timeout: float, num_seqs: int = 1):
        self.gateway = gateway
        self.tenant = tenant
        self.tier_rank = tier_rank
        self.lease_id = lease_id
        self.reserved_tokens = reserved_tokens
        self.num_seqs = num_seqs  # sequences it runs (prompts x n): the room it takes on a worker
        self.decision = decision
        self.timeout = timeout
        self.admitted_at = time.perf_counter()
        self.dispatched_at: float | None = None
        self.worker: WorkerClient | None = None
        self.first_worker: WorkerClient | None = None  # where it was first dispatched (a replay moves `worker`)
        self.waiter: Waiter | None = None
        self.dispatch_seq = 0  # order of dispatch (1, 2, ...)
        self.dispatched_ahead = 0  # requests dispatched while this one waited
        self._dispatches_at_admission = gateway._num_dispatched
        self._future: asyncio.Future[WorkerClient] = asyncio.get_running_loop().create_future()
        self._timer: asyncio.TimerHandle | None = None
        self._finished = False
        self._drained_prompt = False
        self.prompt_hashes: list[bytes] = []  # the first prompt's block hashes (prefix affinity)
        self.adapter: str | None = None  # its LoRA adapter's name: workers that hold it are preferred
        self.version: str | None = None  # the model version it runs on: fixed at its first dispatch
        self.num_replays = 0  # times it moved to another worker (gateway/failover.py)

    @property
    def waiting(self) -> bool:
        return not self._future.done()

    @property
    def queue_seconds(self) -> float:
        return (self.dispatched_at or time.perf_counter()) - self.admitted_at

    async def wait(self) -> WorkerClient:
        """The worker this request is bound to (at once when it was not queued); QueueTimeout or Overloaded (shed)
        when it leaves the queue without one."""
        return await asyncio.shield(self._future)

    def _fail(self, error: Exception) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self._future.done():
            self._future.set_exception(error)
            self._future.exception()  # retrieved here: the request may already be gone

    def on_output(self, num_tokens: int) -> None:
        """Generated tokens arrived: charged to the tenant's fair-share counter, and counted as drained work (with
        the prompt, at the first output)."""
        if num_tokens:
            g = self.gateway
            drained = num_tokens
            if not self._drained_prompt:
                self._drained_prompt = True
                drained += self.waiter.prompt_tokens if self.waiter is not None else 0
            g.drain.record(time.perf_counter(), drained)
            amount = g.queue.charge(self.tier_rank, self.tenant.name, self.tenant.weight, output_tokens=num_tokens)
            if g.metrics is not None:
                g.metrics.tenant_service.labels(self.tenant.name).inc(amount)
                g.metrics.tier_generated.labels(TIERS[self.tier_rank]).inc(num_tokens)

    @property
    def finished(self) -> bool:
        return self._finished

    def finish(self, used_tokens: int) -> None:
        """Frees everything the request holds, at once and exactly once (idempotent): its place in the queue, its
        room on a worker, the in-flight count, then the quota: refunds reserved - used (everything, the request
        included, when it never reached a worker) and the tenant's concurrency lease. Synchronous on purpose: it runs
        from cleanup paths inside cancelled scopes (a client that disconnected), where any await would raise again
        and skip the rest; the limiter's settlement (Redis: a round trip) runs in the gateway's background, with
        retries."""
        if self._finished:
            return
        self._finished = True
        g = self.gateway
        dispatched = self.dispatched_at is not None  # it reached a worker (it may have lost it since)
        if self.waiter is not None and g.queue.remove(self.waiter):
            g._update_queue_metrics()
        if self._timer is not None:
            self._timer.cancel()
        if not self._future.done():
            self._future.cancel()
        g.failover.forget(self)
        if self.worker is not None:
            g.release_room(self.worker, self.tier_rank, self.num_seqs)
        g._close_ticket(self)
        if dispatched:
            g._observe_output(used_tokens, self.reserved_tokens)
        used = used_tokens if dispatched else 0
        if g.metrics is not None:
            g.metrics.tenant_tokens.labels(self.tenant.name).inc(min(used, self.reserved_tokens))
        g._settle(self.tenant, self.lease_id, self.reserved_tokens, used, refund_request=not dispatched)
        g.pump()


class Gateway:
    def __init__(self, router: Router, limiter: Limiter | None = None, options: GatewayOptions | None = None,
                 metrics: Metrics | None = None):
        self.router = router
        self.limiter = limiter if limiter is not None else InProcessLimiter()
        self.options = options or GatewayOptions()
        self.metrics = metrics
        self.queue = WaitingQueue(self.options.max_queue_requests, self.options.max_queue_tokens,
                                self.options.fairness)
        self.shares = TierShares.parse(self.options.tier_shares)
        self.drain = DrainRate()
        self._assigned: dict[WorkerClient, list[int]] = {}  # worker -> requests bound to it, per tier
        self._leases = itertools.count(1)
        self._num_dispatched = 0
        self._expected_output: float | None = None  # mean generated tokens per reserved output token (EWMA)
        self.high_water = (0, 0)  # the most requests and reserved tokens the queue ever held
        self.failover = Failover(self)  # requests whose worker was lost, waiting for another
        self.closing = False  # the server is shutting down: nothing new is admitted, nothing is replayed
        # model version -> share of new requests (a rollout's canary); None: any version
        self.version_shares: dict[str, float] | None = None
        self._version_counts: dict[str | None, int] = {}  # by WorkerClient.version (None only before a hello)
        self.on_bind: list[Callable[[Ticket], None]] = []  # called after every first dispatch (rollout statistics)
        self._arrivals: deque[tuple[float, float]] = deque()  # (time, expected tokens) of admitted requests
        self.open_by_tenant: dict[str, list[int]] = {}  # tenant -> [open tickets, their reserved tokens]
        self.leases = LeaseKeeper(self.limiter)  # the concurrency leases of open requests, renewed while they run
        self._settling: set[asyncio.Task] = set()  # limiter settlements under way (retried while Redis fails)
        router.on_change.append(self.pump)
        if metrics is not None:  # read at scrape time: never stale
            metrics.watch_gateway(self)
            metrics.drain_rate.set_function(lambda: self.drain.rate(time.perf_counter()) or 0.0)

    # ---- admission ------------------------------------------------------------------------------------------
    async def admit(self, tenant: Tenant, tier_rank: int, prompt_tokens: int, reserved_tokens: int,
                    queue_timeout: float | None = None, prompt: list[int] | None = None,
                    num_seqs: int = 1, cache_salt: str = "", adapter: str | None = None) -> Ticket:
        """Reserves quota and binds or queues the request. Raises RateLimited (429), QueueShareExceeded (429: the
        tenant already fills its share of the queue), Overloaded (503) or NoWorkerAvailable (503: no worker at all).
        num_seqs: the sequences the request runs (prompts x n), the room it takes on a worker."""
        if self.closing:
            raise NoWorkerAvailable("the server is shutting down", retry_after=SHUTDOWN_RETRY_AFTER_S)
        if not self.router.ready:
            raise NoWorkerAvailable(f"no worker is available: {self.router.not_ready_reason}")
        timeout = queue_timeout if queue_timeout is not None else self.options.queue_timeout[TIERS[tier_rank]]
        lease_id = f"{tenant.name}:{id(self)}:{next(self._leases)}:{time.time_ns()}"
        decision = await self.limiter.reserve(tenant.name, tenant.limits, lease_id, reserved_tokens)
        if not decision.allowed:
            self.count(f"rate_limited_{decision.reason}")
            raise RateLimited(tenant, decision, reserved_tokens, self.limiter.window)
        ticket = Ticket(self, tenant, tier_rank, lease_id, reserved_tokens, decision, timeout, max(1, num_seqs))
        self._open_ticket(ticket)
        ticket.adapter = adapter
        if prompt is not None:
            ticket.prompt_hashes = self.router.prompt_hashes(prompt, cache_salt)
        expected = prompt_tokens + self._expected_output_tokens(reserved_tokens - prompt_tokens)
        waiter = ticket.waiter = Waiter(tenant.name, tier_rank, tenant.weight, prompt_tokens, reserved_tokens, expected,
                                        payload=ticket)
        try:
            self._enqueue(ticket, waiter)
        except (Overloaded, QueueShareExceeded) as e:
            ticket.finish(0)
            self.count("overloaded" if isinstance(e, Overloaded) else "queue_share")
            raise
        self.count("admitted")
        now = time.perf_counter()
        self._arrivals.append((now, expected))
        self._trim_arrivals(now)
        return ticket

    async def charge_request(self, tenant: Tenant) -> None:
        """Counts a request that runs no generation (/tokenize) against the tenant's request rate: RateLimited when
        the tenant is over it."""
        lease_id = f"{tenant.name}:{id(self)}:{next(self._leases)}:{time.time_ns()}"
        decision = await self.limiter.reserve(tenant.name, tenant.limits, lease_id, 0)
        if not decision.allowed:
            self.count(f"rate_limited_{decision.reason}")
            raise RateLimited(tenant, decision, 0, self.limiter.window)
        self._settle(tenant, lease_id, 0, 0, refund_request=False)

    # ---- what admitted requests hold ------------------------------------------------------------------------
    def _open_ticket(self, ticket: Ticket) -> None:
        self.leases.add(ticket.tenant.name, ticket.lease_id)
        if not self.closing:
            self.leases.start()
        held = self.open_by_tenant.setdefault(ticket.tenant.name, [0, 0])
        held[0] += 1
        held[1] += ticket.reserved_tokens

    def _close_ticket(self, ticket: Ticket) -> None:
        self.leases.discard(ticket.lease_id)
        held = self.open_by_tenant.get(ticket.tenant.name)
        if held is not None:
            held[0] -= 1
            held[1] -= ticket.reserved_tokens
            if held[0] <= 0:
                del self.open_by_tenant[ticket.tenant.name]

    @property
    def num_open(self) -> int:
        """Admitted requests not finished yet (waiting, bound to a worker, or being moved to another)."""
        return sum(held[0] for held in self.open_by_tenant.values())

    @property
    def num_settling(self) -> int:
        """Quota settlements not done yet (retried while the limiter fails)."""
        return len(self._settling)

    def _settle(self, tenant: Tenant, lease_id: str, reserved: int, used: int, refund_request: bool) -> None:
        """Settles a lease with the limiter in the background (never awaited by a request's cleanup), retried with
        backoff while the limiter fails (Redis down): the lease is given back as soon as it can be."""
        task = asyncio.get_running_loop().create_task(
            self._settle_with_retries(tenant, lease_id, reserved, used, refund_request))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle_with_retries(self, tenant: Tenant, lease_id: str, reserved: int, used: int,
                                   refund_request: bool) -> None:
        delay, deadline = SETTLE_RETRY_S[0], time.monotonic() + SETTLE_GIVE_UP_S
        while True:
            try:
                await self.limiter.settle(tenant.name, tenant.limits, lease_id, reserved, used,
                                          refund_request=refund_request)
                return
            except Exception as e:  # noqa: BLE001 - any failure of the limiter: retry, the lease must come back
                if time.monotonic() + delay > deadline:
                    log.error("giving up settling lease %s of tenant %s after %.0f s: %s (its slot comes back when "
                              "the lease expires)", lease_id, tenant.name, SETTLE_GIVE_UP_S, e)
                    return
                log.warning("settling lease %s of tenant %s failed (%s); retrying in %.1f s", lease_id,
                            tenant.name, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, SETTLE_RETRY_S[1])

    async def wait_settled(self) -> None:
        """Returns once every settlement started so far has ended (shutdown, tests)."""
        while self._settling:
            await asyncio.gather(*list(self._settling), return_exceptions=True)

    def _enqueue(self, ticket: Ticket, w: Waiter) -> None:
        """Puts the ticket (its waiter: w) in the queue, or raises Overloaded / QueueShareExceeded."""
        queue = self.queue
        if not queue.fits(w.reserved_tokens):
            self._shed_for(w)
        if not queue.fits(w.reserved_tokens):
            raise Overloaded(f"the service is saturated: the queue is full ({queue.num_requests} requests, "
                             f"{queue.num_tokens} reserved tokens; limits {queue.max_requests} and {queue.max_tokens})",
                             self._retry_after(queue.expected_ahead(len(TIERS) - 1)))
        self._check_tenant_share(w)
        ahead, fraction = self._ahead_of(w.tier_rank)
        if ahead > 0 or not self._has_room(w.tier_rank, ticket.num_seqs):
            rate = self.drain.rate(time.perf_counter())
            if rate:
                rate *= fraction
                wait = (ahead + w.expected_tokens) / rate
                if wait > ticket.timeout:
                    raise Overloaded(f"the service is saturated: the estimated wait ({wait:.1f} s for "
                                     f"{ahead + w.expected_tokens:.0f} tokens of work ahead at {rate:.0f} tokens/s) "
                                     f"is over this request's deadline ({ticket.timeout:g} s)",
                                     self._retry_after(ahead))
        queue.push(w)
        ticket._timer = asyncio.get_running_loop().call_later(ticket.timeout, self._expire, ticket)
        self._update_queue_metrics()
        self.pump()

    def _ahead_of(self, tier_rank: int) -> tuple[float, float]:
        """(expected tokens of the waiters served before a new request of this tier, the part of the drain rate
        that serves them). Strict: its tier and the better, at the whole rate. With shares: its own tier, at its
        share among the tiers that have work (waiting or bound)."""
        queue = self.queue
        fractions = self.shares.fractions
        if fractions is None or fractions[tier_rank] <= 0:
            return queue.expected_ahead(tier_rank), 1.0
        bound = self.bound_by_tier()
        busy = [t for t in range(len(TIERS)) if t == tier_rank or queue.num_by_tier[t] or bound[t]]
        return queue.expected_tokens[tier_rank], fractions[tier_rank] / sum(fractions[t] for t in busy)

    def _check_tenant_share(self, w: Waiter) -> None:
        share = self.options.tenant_queue_share
        if share >= 1.0:
            return
        queue = self.queue
        requests, tokens = queue.tenant_load(w.tenant)
        max_requests = max(1, math.floor(queue.max_requests * share))
        max_tokens = max(w.reserved_tokens, math.floor(queue.max_tokens * share))
        if requests + 1 > max_requests or tokens + w.reserved_tokens > max_tokens:
            raise QueueShareExceeded(
                f"tenant {w.tenant} already has {requests} requests ({tokens} reserved tokens) waiting: its share of "
                f"the queue is {max_requests} requests and {max_tokens} tokens ({share:.0%}). Retry once some "
                "of them have started.", self._retry_after(queue.expected_ahead(w.tier_rank)))

    def _shed_for(self, w: Waiter) -> None:
        """Drops the newest waiters of worse tiers until w fits (or none is left)."""
        queue = self.queue
        while not queue.fits(w.reserved_tokens):
            victims = [v for v in queue.waiters() if v.tier_rank > w.tier_rank]
            if not victims:
                return
            victim = max(victims, key=lambda v: (v.tier_rank, v.seq))
            queue.remove(victim)
            self.count("shed")
            victim.payload._fail(Overloaded("the service is saturated: this request was shed from the waiting "
                                            "queue for more important work", self._retry_after(
                                                queue.expected_ahead(victim.tier_rank))))

    def _retry_after(self, work_ahead: float) -> int:
        rate = self.drain.rate(time.perf_counter())
        if not rate:
            return 1
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(work_ahead / rate)))

    def _expected_output_tokens(self, reserved_output: int) -> float:
        ratio = self._expected_output
        return reserved_output if ratio is None else reserved_output * ratio

    def _observe_output(self, used_tokens: int, reserved_tokens: int) -> None:
        if reserved_tokens > 0:
            ratio = min(1.0, used_tokens / reserved_tokens)
            self._expected_output = ratio if self._expected_output is None else \
                0.9 * self._expected_output + 0.1 * ratio

    def _expire(self, ticket: Ticket) -> None:
        if ticket.waiter is not None and self.queue.remove(ticket.waiter):
            self.count("queue_timeout")
            self._update_queue_metrics()
            ticket._fail(QueueTimeout(ticket.queue_seconds))

    # ---- dispatch -------------------------------------------------------------------------------------------
    def _capacity(self, worker: WorkerClient) -> int:
        hello = worker.hello
        return (hello.max_num_seqs if hello is not None else 1) + self.options.worker_queue_depth

    def _room_on(self, worker: WorkerClient, tier_rank: int, num_seqs: int = 1) -> bool:
        """Room for num_seqs more sequences of this tier: a free seat, or (with shares) seats its tier has not
        filled yet; strict: room among the seats of this tier or better. A request with more sequences than a worker
        holds at all still fits an idle worker (the engine runs what fits, the rest waits there)."""
        assigned = self._assigned.get(worker)
        if assigned is None:
            return True
        capacity = self._capacity(worker)
        if self.shares.strict:
            used = sum(assigned[: tier_rank + 1])
            return used == 0 or used + num_seqs <= capacity
        total = sum(assigned)
        if total == 0 or total + num_seqs <= capacity:
            return True
        # over-filled only where the engine can take the seats back: from tiers over their own
        return (self.shares.may_reclaim(assigned, tier_rank, capacity, num_seqs)
                and self.shares.lendable(assigned, tier_rank, capacity) >= num_seqs)

    def load(self, worker: WorkerClient) -> int:
        return sum(self._assigned.get(worker, ()))

    def candidates(self, tier_rank: int, version: str | None, num_seqs: int = 1) -> list[WorkerClient]:
        return [w for w in self.router.workers
                if w.usable and self._room_on(w, tier_rank, num_seqs) and (version is None or w.version == version)]

    def _has_room(self, tier_rank: int, num_seqs: int = 1) -> bool:
        return bool(self.candidates(tier_rank, None, num_seqs))

    def _pick(self, ticket: Ticket) -> WorkerClient | None:
        version = ticket.version or self.choose_version(ticket.tier_rank)
        candidates = self.candidates(ticket.tier_rank, version, ticket.num_seqs)
        if not candidates:
            return None
        return self.router.rank(candidates, self.load, ticket.prompt_hashes, ticket.adapter)

    def choose_version(self, tier_rank: int) -> str | None:
        """During a rollout: the version whose share of new requests is furthest behind its target, among those
        with room (counted, not drawn at random, so that a canary's share is exact over any run of requests)."""
        shares = self.version_shares
        if not shares:
            return None
        open_versions = {w.version for w in self.candidates(tier_rank, None)}
        total = sum(self._version_counts.get(v, 0) for v in shares) + 1
        best, best_deficit = None, None
        for version, share in shares.items():
            if share <= 0 or version not in open_versions:
                continue
            deficit = share * total - self._version_counts.get(version, 0)
            if best_deficit is None or deficit > best_deficit:
                best, best_deficit = version, deficit
        return best if best is not None else NO_VERSION  # no version with a share has room: wait

    def pump(self) -> None:
        """Binds waiters to workers while one has room somewhere: the head (VTC, inside its tier) of the tier the
        shares name next, or of the following tier when that one has no room anywhere. Strict: the best tier's head
        only (if it has no room, no worse tier has either)."""
        self.failover.pump()  # replays go first: their clients are mid-stream
        moved = False
        while True:
            w, worker = self._next_dispatch()
            if w is None or worker is None:
                break
            amount = self.queue.pop(w)
            moved = True
            ticket: Ticket = w.payload
            if ticket._timer is not None:
                ticket._timer.cancel()
            self._bind(ticket, worker)
            if self.metrics is not None:
                self.metrics.tenant_service.labels(w.tenant).inc(amount)
        if moved:
            self._update_queue_metrics()

    def _next_dispatch(self) -> tuple[Waiter | None, WorkerClient | None]:
        queue = self.queue
        if self.shares.strict:
            w = queue.peek()
            return w, (self._pick(w.payload) if w is not None else None)
        waiting = [t for t in range(len(TIERS)) if queue.num_by_tier[t]]
        if not waiting:
            return None, None
        capacity = sum(self._capacity(worker) for worker in self.router.workers if worker.usable)
        for tier_rank in self.shares.tier_order(self.bound_by_tier(), waiting, capacity):
            w = queue.peek(tier_rank)
            worker = self._pick(w.payload) if w is not None else None
            if worker is not None:
                return w, worker
        return None, None

    def bound_by_tier(self) -> list[int]:
        """Sequences bound to workers, per tier (all workers together)."""
        return [sum(a[t] for a in self._assigned.values()) for t in range(len(TIERS))]

    def borrowed_by_tier(self) -> list[int]:
        """Sequences bound beyond their tier's own seats, per tier (summed over workers; strict: 0)."""
        out = [0] * len(TIERS)
        for worker, assigned in self._assigned.items():
            for t, n in enumerate(self.shares.borrowed(assigned, self._capacity(worker))):
                out[t] += n
        return out

    def _bind(self, ticket: Ticket, worker: WorkerClient) -> None:
        if not self._assigned:
            self.drain.busy(time.perf_counter())
        self.take_room(worker, ticket.tier_rank, ticket.num_seqs)
        self._num_dispatched += 1
        ticket.worker = ticket.first_worker = worker
        ticket.version = worker.version
        self._version_counts[worker.version] = self._version_counts.get(worker.version, 0) + 1
        self.router.remember(worker, ticket.prompt_hashes)
        for callback in self.on_bind:
            callback(ticket)
        ticket.dispatched_at = time.perf_counter()
        ticket.dispatch_seq = self._num_dispatched
        ticket.dispatched_ahead = self._num_dispatched - 1 - ticket._dispatches_at_admission
        if self.metrics is not None:
            self.metrics.queue_wait.observe(ticket.dispatched_at - ticket.admitted_at)
        ticket._future.set_result(worker)

    def arrival_rate(self, now: float, window: float = DEFAULT_AUTOSCALE_WINDOW_S) -> float:
        """Expected tokens (prompt + expected output) of the requests admitted per second over the last window."""
        self._trim_arrivals(now, window)
        return sum(tokens for t, tokens in self._arrivals if t >= now - window) / window

    def _trim_arrivals(self, now: float, window: float = DEFAULT_AUTOSCALE_WINDOW_S) -> None:
        keep = max(window, DEFAULT_AUTOSCALE_WINDOW_S)  # on append: bounded by the autoscaler's window
        while self._arrivals and self._arrivals[0][0] < now - keep:
            self._arrivals.popleft()

    def close(self) -> None:
        """The server is shutting down: refuse new work, fail what waits in the queue and every pending replay."""
        self.closing = True
        self.leases.stop()
        for w in list(self.queue.waiters()):
            self.queue.remove(w)
            w.payload._fail(NoWorkerAvailable("the server is shutting down", retry_after=SHUTDOWN_RETRY_AFTER_S))
        self._update_queue_metrics()
        self.pump()

    def busy_above(self, tier_rank: int) -> int:
        """Sequences of more important tiers than `tier_rank` bound to a worker or waiting in the queue (the Batch API
        backs off while there are any)."""
        bound = sum(sum(a[:tier_rank]) for a in self._assigned.values())
        return bound + sum(1 for w in self.queue.waiters() if w.tier_rank < tier_rank)

    @property
    def num_in_flight(self) -> int:
        """Sequences bound to a worker (or being moved to another)."""
        return sum(sum(a) for a in self._assigned.values()) + self.failover.num_seqs

    def take_room(self, worker: WorkerClient, tier_rank: int, num_seqs: int = 1) -> None:
        """num_seqs sequences of this tier are bound to worker (release_room gives them back)."""
        self._assigned.setdefault(worker, [0] * len(TIERS))[tier_rank] += num_seqs

    def release_room(self, worker: WorkerClient, tier_rank: int, num_seqs: int = 1) -> None:
        assigned = self._assigned.get(worker)
        if assigned is not None:
            assigned[tier_rank] -= num_seqs
            if not any(assigned):
                del self._assigned[worker]
                if not self._assigned:
                    self.drain.idle()

    # ---- metrics --------------------------------------------------------------------------------------------
    def count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.admissions.labels(outcome).inc()

    def _update_queue_metrics(self) -> None:
        m = self.metrics
        if m is None:
            return
        for tier_rank, tier in enumerate(TIERS):
            m.queue_requests.labels(tier).set(self.queue.num_by_tier[tier_rank])
            m.queue_tier_tokens.labels(tier).set(self.queue.tokens_by_tier[tier_rank])
        m.queue_tokens.set(self.queue.num_tokens)
        queue = self.queue
        self.high_water = (max(self.high_water[0], queue.num_requests), max(self.high_water[1], queue.num_tokens))
        m.queue_requests_max.set(self.high_water[0])
        m.queue_tokens_max.set(self.high_water[1])
