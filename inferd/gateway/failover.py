"""Failover: a request whose worker is lost mid-request (died, hung, drained under it) moves to another worker and
its stream goes on. Both halves live here:

- `replaying` is the request's side: it reads a request's outputs from its worker and keeps the journal (every token
  id generated so far). When the worker is lost it asks for another (`Failover.rebind`) and replays there: the prompt
  plus the journal, with the original prompt length (so max_tokens, penalties, min_tokens and seeded sampling
  positions are the original request's) and a new request id (a new epoch); the caller's stream just continues. A
  request without state to carry over (an embedding) passes no journal and runs again from its prompt.
- `Failover` is the gateway's side: the requests waiting for a new worker, served ahead of the queue (their clients
  are mid-stream), each until its replay deadline. A worker of the request's model version is required once it
  generated a token (a replay must continue the same model's text); before that any version will do, so a request
  refused by a draining canary goes to the version that stays.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol

from ..config import DEFAULT_REPLAY_TIMEOUT_S, MAX_REPLAYS_PER_REQUEST
from ..engine.request import SamplingParams
from ..worker.client import WorkerClient, WorkerDead, WorkerUnavailable
from ..worker.protocol import WorkerOutput
from .router import Router


# What failover uses of the gateway and of its tickets, as Protocols: gateway/admission.py (Gateway, Ticket)
# imports this module, so it cannot be imported here.
class FailoverGateway(Protocol):
    """The Gateway (gateway/admission.py), as failover sees it: the room lost requests take on its workers."""

    @property
    def closing(self) -> bool: ...
    @property
    def router(self) -> Router: ...
    @property
    def failover(self) -> Failover: ...
    def candidates(self, tier_rank: int, version: str | None, num_seqs: int = 1) -> list[WorkerClient]: ...
    def choose_version(self, tier_rank: int) -> str | None: ...
    def load(self, worker: WorkerClient) -> int: ...
    def take_room(self, worker: WorkerClient, tier_rank: int, num_seqs: int = 1) -> None: ...
    def release_room(self, worker: WorkerClient, tier_rank: int, num_seqs: int = 1) -> None: ...
    def pump(self) -> None: ...
    def count(self, outcome: str) -> None: ...


class FailoverTicket(Protocol):
    """The gateway's Ticket (gateway/admission.py), as failover sees it: what it reads, and the worker it moves."""

    worker: WorkerClient | None
    version: str | None  # the model version it runs on (None: any)
    num_replays: int

    @property
    def gateway(self) -> FailoverGateway: ...
    @property
    def tier_rank(self) -> int: ...
    @property
    def num_seqs(self) -> int: ...
    @property
    def prompt_hashes(self) -> list[bytes]: ...
    @property
    def adapter(self) -> str | None: ...  # its LoRA adapter (the router prefers workers that hold it)
    @property
    def finished(self) -> bool: ...


@dataclass(eq=False)
class _Pending:
    """A request whose worker was lost, waiting for another (ahead of the queue) until its timer fails it."""
    ticket: FailoverTicket
    lost: WorkerClient
    error: Exception
    future: asyncio.Future[WorkerClient]
    timer: asyncio.TimerHandle | None = None


class Failover:
    """The gateway's requests waiting for a new worker. `gateway` is the Gateway whose room they take (its
    candidates, its count of requests per worker)."""

    def __init__(self, gateway: FailoverGateway, timeout: float = DEFAULT_REPLAY_TIMEOUT_S):
        self.gateway = gateway
        self.timeout = timeout  # seconds a lost request may wait for another worker (--replay-timeout)
        self._pending: list[_Pending] = []
        self._rebinding: dict[FailoverTicket, asyncio.Future[WorkerClient]] = {}  # ticket -> its new worker

    async def rebind(self, ticket: FailoverTicket, lost: WorkerClient, error: Exception,
                     started: bool = True) -> WorkerClient:
        """The worker `ticket` was bound to can no longer run it: a worker of the same version with room, ahead of
        the queue. Every choice of the request calls this with the same lost worker and gets the same new one.
        Raises `error` when none can take it before the replay deadline (or at once when the gateway is shutting
        down). started=False (no token was generated yet): any version will do."""
        if ticket.worker is not lost and ticket.worker is not None:
            return ticket.worker
        future = self._rebinding.get(ticket)
        if future is None or future.done():
            future = self._rebinding[ticket] = asyncio.get_running_loop().create_future()
            if not started:
                ticket.version = None
            self._lost(ticket, lost, error, future)
        return await asyncio.shield(future)

    def forget(self, ticket: FailoverTicket) -> None:
        """The ticket is finished: a rebinding it still waits for is cancelled."""
        future = self._rebinding.pop(ticket, None)
        if future is not None and not future.done():
            future.cancel()

    @property
    def num_seqs(self) -> int:
        """Sequences of the requests waiting for a new worker."""
        return sum(p.ticket.num_seqs for p in self._pending)

    def _lost(self, ticket: FailoverTicket, lost: WorkerClient, error: Exception,
              future: asyncio.Future[WorkerClient]) -> None:
        g = self.gateway
        g.release_room(lost, ticket.tier_rank, ticket.num_seqs)
        ticket.worker = None
        if g.closing:
            future.set_exception(error)
            return
        pending = _Pending(ticket, lost, error, future)
        pending.timer = asyncio.get_running_loop().call_later(self.timeout, self._expired, pending)
        self._pending.append(pending)
        g.pump()

    def _expired(self, pending: _Pending) -> None:
        """No worker took it by its deadline (a timer, not a clock comparison: it cannot be missed)."""
        if pending in self._pending:
            self._pending.remove(pending)
            self._fail(pending)

    def _fail(self, pending: _Pending) -> None:
        if not pending.future.done():
            self.gateway.count("replay_failed")
            pending.future.set_exception(pending.error)

    def pump(self) -> None:
        """Binds waiting requests to workers with room (the gateway calls this before it serves its queue). One that
        finds no worker by its deadline fails; so does one whose version has no worker left to come."""
        if not self._pending:
            return
        g = self.gateway
        waiting = []
        for pending in self._pending:
            ticket, lost, timer = pending.ticket, pending.lost, pending.timer
            assert timer is not None  # _lost sets it before the request joins _pending
            if pending.future.done() or ticket.finished:
                timer.cancel()
                continue
            version = ticket.version or g.choose_version(ticket.tier_rank)
            candidates = [w for w in g.candidates(ticket.tier_rank, version, ticket.num_seqs) if w is not lost]
            if candidates:
                worker = g.router.rank(candidates, g.load, ticket.prompt_hashes, ticket.adapter)
                g.take_room(worker, ticket.tier_rank, ticket.num_seqs)
                ticket.worker = worker
                ticket.version = worker.version
                ticket.num_replays += 1
                g.router.remember(worker, ticket.prompt_hashes)
                g.count("replayed")
                timer.cancel()
                pending.future.set_result(worker)
            elif g.closing or self._version_gone(ticket, lost, pending.error):
                timer.cancel()
                self._fail(pending)
            else:
                waiting.append(pending)
        self._pending = waiting

    def _version_gone(self, ticket: FailoverTicket, lost: WorkerClient, error: Exception) -> bool:
        """A drained worker (not a dead one, which is restarted) whose version has no other worker: nothing will
        come to take the request, so it fails now instead of at the replay deadline."""
        if isinstance(error, WorkerDead) or ticket.version is None:
            return False
        return not any(w is not lost and w.dead is None and w.version == ticket.version and not w.draining
                       for w in self.gateway.router.workers)


async def replaying(ticket: FailoverTicket, request_id: str, prompt: list[int], params: SamplingParams,
                    worker: WorkerClient, journal: list[int] | None, started: Callable[[], bool] = lambda: False,
                    may_replay: Callable[[], bool] = lambda: True,
                    on_replay: Callable[[Exception], None] | None = None) -> AsyncGenerator[WorkerOutput, None]:
    """One sequence's outputs from `worker` (ticket's: its gateway's router sends it), replayed on the worker the
    gateway rebinds the ticket to whenever its worker is lost, up to MAX_REPLAYS_PER_REQUEST times. journal: the
    token ids generated so far, extended here (None: nothing to carry over, the sequence runs again from its prompt).
    started() says whether the request generated anything yet (any version of the model may take it if not);
    may_replay() False ends a replay before it starts (the caller already has what it needs); on_replay(error) is
    told of each replay. Leaving the iteration early aborts the sequence in its worker."""
    gateway = ticket.gateway
    attempt = 0
    while True:
        rid = request_id + (f".r{attempt}" if attempt else "")
        carried = journal if journal else None
        stream = gateway.router.generate(rid, prompt + carried if carried else prompt, params, worker,
                                         num_prompt_tokens=len(prompt) if carried else None)
        try:
            async for out in stream:
                if journal is not None:
                    journal.extend(out.new_token_ids)
                yield out
            return
        except WorkerUnavailable as e:
            if attempt >= MAX_REPLAYS_PER_REQUEST or not may_replay():
                raise
            worker = await gateway.failover.rebind(ticket, worker, e, started())
            attempt += 1
            if on_replay is not None:
                on_replay(e)
        finally:
            await stream.aclose()
