"""The Batch API's runner: validates new batches, runs the pending lines of every batch in progress, resumes after a
restart, finalizes, expires, cancels, and sweeps finished batches out after the retention period.

Lines go through the same admission as HTTP requests (the batch owner's quota, fair sharing, the queue) in
the `batch` tier, so interactive traffic goes first and preempts them on the workers. Between tenants the runner is
fair and keeps them apart:
- the tenants with work take turns (round robin), whatever the age of their batches;
- each tenant has its own concurrency, which adapts to what the service takes for it: +1 after a served line, halved
  when its line was refused as "busy" (503, a 429 of its rate or concurrency limits), between 1 and
  `--batch-concurrency`; all of them together stay under `--batch-concurrency` (one at a time while more important
  work runs);
- only busy answers are retried, and a busy answer pauses what it speaks for: a 429 of the tenant's limits pauses
  that tenant, a 503 (the service saturated, not ready) every tenant, for the answer's Retry-After or the back-off
  (BATCH_RETRY_S doubled at each new refusal, up to BATCH_RETRY_MAX_S), whichever is longer; no line of theirs starts
  before then (a pause per line let a tenant's refusals grow with its pending lines: each refusal freed a slot that
  the next line took at once). Any other answer (a 4xx that is the line's own fault, a 429 that can never fit such as
  request_too_large) is the line's result, at once;
- a batch whose tenant is gone (removed from the keys file, or the server started without it) fails: before it runs
  with the error tenant_gone, while it runs with its lines not run yet in the error file under that code;
- each batch's validation and finalization is a task of its own, whose failure (even an unexpected exception) is
  that batch's alone: the batch fails, or its step is tried again after a back-off; the loop never stops for it.
Everything that touches the store or a file runs in a thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..config import (
    BATCH_BUSY_COOLDOWN_S,
    BATCH_RETENTION_S,
    BATCH_RETRY_MAX_S,
    BATCH_RETRY_S,
    BATCH_SWEEP_INTERVAL_S,
    BATCH_VALIDATIONS,
    BUSY_BATCH_CONCURRENCY,
    DEFAULT_BATCH_CONCURRENCY,
    MAX_REQUEST_BODY_BYTES,
)
from .batch_input import parse_input
from .batches import ACTIVE, BatchStore

log = logging.getLogger("inferd.batches")

TICK_S = 0.25  # the runner looks at the batches this often when nothing wakes it
INITIAL_TENANT_CONCURRENCY = 4  # a tenant's lines in flight at first (then it adapts)


@dataclass
class LineOutcome:
    status: int  # the HTTP status the request would have had
    body: dict  # the response body, or the error body
    retry: bool = False  # the service was busy (503, a 429 rate or concurrency limit): run the line again later
    retry_after: float | None = None  # the answer's Retry-After, seconds
    service_busy: bool = False  # busy for everyone (a 503), not only for this line's tenant (a 429)


def backoff(attempt: int, retry_after: float | None = None) -> float:
    """The pause before the attempt-th retry: BATCH_RETRY_S doubled at each, at least the answer's Retry-After,
    at most BATCH_RETRY_MAX_S."""
    delay = BATCH_RETRY_S * 2 ** min(max(attempt - 1, 0), 16)
    return min(BATCH_RETRY_MAX_S, max(delay, retry_after or 0.0))


@dataclass
class Pause:
    """What busy answers say to the runner, for one tenant or for all: start nothing before `until` (monotonic
    seconds). The back-off doubles with each refusal of a line started after the pause was last set; the refusals
    of lines already in flight then are the same burst: they may lengthen the pause (their Retry-After), never
    double it."""
    until: float = float("-inf")
    refusals: int = 0  # consecutive refused bursts
    set_at: float = float("-inf")

    def refused(self, started: float, now: float, retry_after: float | None) -> None:
        if started >= self.set_at:
            self.refusals += 1
            self.set_at = now
        self.until = max(self.until, now + backoff(self.refusals, retry_after))

    def served(self) -> None:
        self.refusals = 0


class BatchRunner:
    """execute(tenant identity, endpoint, body JSON text) -> LineOutcome runs one request through the gateway (the
    API process's own path, in the batch tier). count(outcome, n) counts lines: "ok", "error" (the line's result is
    an error), "retried" (busy: it runs again later), "invalid" (refused when its file was validated)."""

    def __init__(self, store: BatchStore, execute: Callable[[str, str, str], Awaitable[LineOutcome]],
                 max_concurrency: int = DEFAULT_BATCH_CONCURRENCY, interactive_busy: Callable[[], int] = lambda: 0,
                 max_line_bytes: int = MAX_REQUEST_BODY_BYTES, retention_s: float | None = BATCH_RETENTION_S,
                 count: Callable[[str, int], None] = lambda outcome, n: None,
                 tenant_exists: Callable[[str], bool] = lambda identity: True):
        self.store = store
        self.execute = execute
        self.tenant_exists = tenant_exists  # tenant identity -> whether the server still has that tenant
        # more important work (interactive, standard) running or waiting: lines are then sent one at a time, so that
        # the batch fills the capacity that work leaves idle instead of sharing every step with it
        self.interactive_busy = interactive_busy
        self.max_concurrency = max(1, max_concurrency)
        self.max_line_bytes = max_line_bytes
        self.retention_s = retention_s
        self.count = count
        self._inflight: dict[tuple[str, int], tuple[str, asyncio.Task]] = {}  # (batch, line) -> (tenant, task)
        self._retry_at: dict[tuple[str, int], float] = {}
        self._attempts: dict[tuple[str, int], int] = {}
        self._tenant_limit: dict[str, int] = {}  # each tenant's adaptive concurrency
        self._tenant_pause: dict[str, Pause] = {}  # set by 429s of the tenant's limits
        self._service_pause = Pause()  # set by 503s: the service is busy for every tenant
        self._last_tenant: str | None = None  # the tenant served last: the next round starts after it
        self._steps: dict[str, asyncio.Task] = {}  # batch id -> its validation or finalization
        self._held_until: dict[str, float] = {}  # batch id -> when a step that failed may run again
        self._step_failures: dict[str, int] = {}
        self._traced: set[str] = set()  # batches whose lines' unexpected failures were logged with a traceback
        self._validations = asyncio.Semaphore(BATCH_VALIDATIONS)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.lines_done = 0
        self._busy_at = float("-inf")  # when more important work was last seen

    # ---- the loops --------------------------------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run())]
        if self.retention_s is not None:
            self._tasks.append(loop.create_task(self._sweep()))

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._steps.values(), *(t for _, t in self._inflight.values())]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def tenant_concurrency(self, tenant: str) -> int:
        return self._tenant_limit.get(tenant, min(INITIAL_TENANT_CONCURRENCY, self.max_concurrency))

    async def _run(self) -> None:
        failures = 0
        while True:
            pause = TICK_S
            try:
                await self._tick()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception:  # the store itself failed (each batch's own failures are caught where they happen)
                failures += 1
                pause = backoff(failures)
                log.exception("the batch runner could not read its batches; trying again in %.1f s", pause)
            self._wake.clear()
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for loses a cancel that comes as the event is set
                async with asyncio.timeout(pause):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _sweep(self) -> None:
        """Finished batches and their output files go once they are retention_s old."""
        interval = min(BATCH_SWEEP_INTERVAL_S, self.retention_s / 2)
        while True:
            try:
                gone = await asyncio.to_thread(self.store.sweep, self.retention_s)
                if gone:
                    log.info("removed %d batches finished over %g s ago (--batch-retention)", gone, self.retention_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the batch retention sweep failed; trying again in %g s", interval)
            await asyncio.sleep(interval)

    async def _tick(self) -> None:
        store, now = self.store, time.time()
        batches = await asyncio.to_thread(store.batches_in, *ACTIVE)
        active = {b["id"] for b in batches}
        for table in (self._held_until, self._step_failures):
            for batch_id in [k for k in table if k not in active]:
                del table[batch_id]
        running = [b["id"] for b in batches if b["status"] == "in_progress" and b["id"] not in self._steps]
        has_pending = await asyncio.to_thread(store.with_pending, running) if running else set()
        runnable = []
        for batch in batches:
            batch_id, status = batch["id"], batch["status"]
            if batch_id in self._steps or self._held_until.get(batch_id, 0.0) > now:
                continue
            if status in ("validating", "in_progress") and not self.tenant_exists(batch["tenant"]):
                if self._cancel_inflight(batch_id):
                    self._step(batch, self._tenant_gone(batch))
            elif status == "validating":
                self._step(batch, self._validate(batch))
            elif status == "cancelling":
                if self._cancel_inflight(batch_id):
                    self._step(batch, self._finalize(batch, "cancelled", "batch_cancelled"))
            elif status == "in_progress" and now >= batch["expires_at"]:
                if self._cancel_inflight(batch_id):
                    self._step(batch, self._finalize(batch, "expired", "batch_expired"))
            elif status == "finalizing" or batch_id not in has_pending:
                if not self._inflight_of(batch_id):
                    self._step(batch, self._finalize(batch, "completed", None))
            else:
                runnable.append(batch)
        await self._schedule(runnable, now)

    # ---- lines --------------------------------------------------------------------------------------------------
    async def _schedule(self, runnable: list[dict], now: float) -> None:
        """Starts lines of the runnable batches: their tenants in turn, each up to its own concurrency, all of them
        up to the runner's."""
        if self.interactive_busy():
            self._busy_at = now
        quiet = now - self._busy_at >= BATCH_BUSY_COOLDOWN_S
        cap = self.max_concurrency if quiet else min(self.max_concurrency, BUSY_BATCH_CONCURRENCY)
        by_tenant: dict[str, list[dict]] = {}
        for batch in runnable:
            by_tenant.setdefault(batch["tenant"], []).append(batch)
        busy_tenants = {tenant for tenant, _ in self._inflight.values()}
        clock = time.monotonic()
        for tenant in [t for t in self._tenant_limit if t not in by_tenant and t not in busy_tenants]:
            del self._tenant_limit[tenant]  # nothing left to run: it starts afresh next time
        for tenant in [t for t, p in self._tenant_pause.items() if p.until <= clock and t not in by_tenant
                       and t not in busy_tenants]:
            del self._tenant_pause[tenant]
        if self._service_pause.until > clock:  # the service said it is busy: nothing starts before its time
            return
        by_tenant = {t: b for t, b in by_tenant.items() if t not in self._tenant_pause
                     or self._tenant_pause[t].until <= clock}
        room = cap - len(self._inflight)
        if room <= 0 or not by_tenant:
            return
        names = sorted(by_tenant)
        if self._last_tenant is not None:  # round robin: start after the tenant served last
            cut = next((i for i, t in enumerate(names) if t > self._last_tenant), 0)
            names = names[cut:] + names[:cut]
        in_flight = {}
        for tenant, _ in self._inflight.values():
            in_flight[tenant] = in_flight.get(tenant, 0) + 1
        wants = []  # (tenant, [(batch, lines excluded)], how many)
        for tenant in names:
            n = min(room, self.tenant_concurrency(tenant) - in_flight.get(tenant, 0))
            if n > 0:
                wants.append((tenant, [(b, self._excluded(b["id"], now)) for b in by_tenant[tenant]], n))
        if not wants:
            return
        found = await asyncio.to_thread(self._candidates, wants)
        queues = {tenant: deque(lines) for tenant, lines in found.items()}
        while room > 0 and any(queues.values()):
            for tenant in names:
                if room > 0 and queues.get(tenant):
                    batch, line = queues[tenant].popleft()
                    key = (batch["id"], line["line_no"])
                    if key in self._inflight:
                        continue
                    self._retry_at.pop(key, None)
                    task = asyncio.get_running_loop().create_task(self._line(batch, line, clock))
                    self._inflight[key] = (tenant, task)
                    self._last_tenant = tenant
                    room -= 1

    def _candidates(self, wants: list) -> dict[str, list[tuple[dict, dict]]]:
        """(In a thread.) Up to n pending lines of each tenant, from its batches oldest first."""
        out = {}
        for tenant, batches, n in wants:
            picked = []
            for batch, exclude in batches:
                if len(picked) >= n:
                    break
                picked += [(batch, line) for line in self.store.pending_lines(batch["id"], exclude, n - len(picked))]
            out[tenant] = picked
        return out

    def _excluded(self, batch_id: str, now: float) -> set[int]:
        """The batch's lines in flight or waiting for their retry."""
        busy = {k[1] for k in self._inflight if k[0] == batch_id}
        return busy | {k[1] for k, t in self._retry_at.items() if k[0] == batch_id and t > now}

    def _inflight_of(self, batch_id: str) -> bool:
        return any(k[0] == batch_id for k in self._inflight)

    def _cancel_inflight(self, batch_id: str) -> bool:
        """Cancels the batch's lines in flight; True when none is left."""
        for key, (_, task) in list(self._inflight.items()):
            if key[0] == batch_id:
                task.cancel()
        return not self._inflight_of(batch_id)

    async def _line(self, batch: dict, line: dict, started: float) -> None:
        """Runs one line (started: the monotonic time it was scheduled) and records its result; a busy answer leaves
        it pending and pauses its tenant (a 429) or every tenant (a 503)."""
        key = (batch["id"], line["line_no"])
        tenant = batch["tenant"]
        outcome = None
        try:
            outcome = await self.execute(tenant, batch["endpoint"], line["body"])
            if outcome.retry:
                self._tenant_limit[tenant] = max(1, self.tenant_concurrency(tenant) // 2)
                pause = self._service_pause if outcome.service_busy else self._tenant_pause.setdefault(tenant, Pause())
                now = time.monotonic()
                pause.refused(started, now, outcome.retry_after)
                self.count("retried", 1)
                error = outcome.body.get("error") or {}
                log.info("batch %s line %d: busy (%d %s, Retry-After %s); %s wait %.2f s", batch["id"],
                         line["line_no"], outcome.status, error.get("code"), outcome.retry_after,
                         "all batch lines" if outcome.service_busy else f"tenant {tenant}'s lines", pause.until - now)
                return
            if outcome.status != 200 and not self.tenant_exists(tenant):
                return  # refused because its tenant went: it stays pending, and the batch ends as tenant_gone
            self._service_pause.served()
            if tenant in self._tenant_pause:
                self._tenant_pause[tenant].served()
            self._tenant_limit[tenant] = min(self.max_concurrency, self.tenant_concurrency(tenant) + 1)
            await self._record(batch, line, outcome)
        except asyncio.CancelledError:
            raise
        except Exception:
            if outcome is None:  # never expected (execute answers every failure): the line's result is a 500
                log.error("batch %s line %d failed in the runner", batch["id"], line["line_no"],
                          exc_info=batch["id"] not in self._traced)  # a traceback once per batch: no flood
                self._traced.add(batch["id"])
                try:
                    await self._record(batch, line, LineOutcome(500, {"error": {
                        "message": "the server failed this request", "type": "server_error", "param": None,
                        "code": "internal_error"}}))
                    return
                except Exception:
                    pass
            log.exception("batch %s line %d: its result could not be stored; it runs again", batch["id"],
                          line["line_no"])
            self._retry_later(key)
        finally:
            self._inflight.pop(key, None)
            self._wake.set()

    async def _record(self, batch: dict, line: dict, outcome: LineOutcome) -> None:
        key = (batch["id"], line["line_no"])
        request_id = "batch_req_" + secrets.token_hex(12)
        result = {"id": request_id, "custom_id": line["custom_id"],
                  "response": {"status_code": outcome.status, "request_id": request_id, "body": outcome.body},
                  "error": None}
        await asyncio.to_thread(self.store.record, batch["id"], line["line_no"], outcome.status == 200, result)
        self._retry_at.pop(key, None)
        self._attempts.pop(key, None)
        self.count("ok" if outcome.status == 200 else "error", 1)
        self.lines_done += 1

    def _retry_later(self, key: tuple[str, int]) -> None:
        """A line whose result could not be stored runs again after a back-off of its own."""
        attempt = self._attempts[key] = self._attempts.get(key, 0) + 1
        self._retry_at[key] = time.time() + backoff(attempt)

    # ---- a batch's steps --------------------------------------------------------------------------------------
    def _step(self, batch: dict, step: Awaitable[None]) -> None:
        """Runs a batch's validation or finalization as its own task: its failure is the batch's alone."""
        batch_id = batch["id"]

        async def guarded() -> None:
            try:
                await step
                self._step_failures.pop(batch_id, None)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                await self._step_failed(batch, e)
            finally:
                self._steps.pop(batch_id, None)
                self._wake.set()

        self._steps[batch_id] = asyncio.get_running_loop().create_task(guarded())

    async def _step_failed(self, batch: dict, error: Exception) -> None:
        """A validation that failed fails its batch (reading the same file again would fail the same way); a
        finalization (the disk, the database) is tried again after a back-off, logged once per try."""
        batch_id = batch["id"]
        n = self._step_failures[batch_id] = self._step_failures.get(batch_id, 0) + 1
        pause = backoff(n)
        self._held_until[batch_id] = time.time() + pause
        log.error("batch %s: its %s failed (%s: %s); %s", batch_id, batch["status"], type(error).__name__, error,
                  "the batch fails" if batch["status"] == "validating" else f"trying again in {pause:.0f} s",
                  exc_info=n == 1)
        if batch["status"] == "validating":
            errors = [{"code": "validation_failed", "message": f"the server could not validate the input file "
                       f"({type(error).__name__})", "param": "input_file_id", "line": None}]
            try:
                await asyncio.to_thread(self.store.set_status, batch_id, "failed", ("validating",),
                                        errors=json.dumps(errors))
            except Exception:
                log.exception("batch %s could not be marked failed; trying again in %.0f s", batch_id, pause)

    async def _validate(self, batch: dict) -> None:
        store = self.store
        async with self._validations:
            try:
                lines, errors, refused = await asyncio.to_thread(parse_input, store.path(batch["input_file_id"]),
                                                                 batch["endpoint"], self.max_line_bytes)
            except FileNotFoundError:
                lines, refused = [], 0
                errors = [{"code": "file_not_found", "message": "the input file is gone", "param": "input_file_id",
                           "line": None}]
            if refused:
                self.count("invalid", refused)
            if errors:
                await asyncio.to_thread(store.set_status, batch["id"], "failed", ("validating",),
                                        errors=json.dumps(errors))
            else:
                await asyncio.to_thread(store.store_lines, batch["id"], lines)

    async def _tenant_gone(self, batch: dict) -> None:
        """The batch's tenant is gone: a batch not started yet fails with tenant_gone; one in progress fails with its
        results so far in its output and error files, and its lines not run in the error file under tenant_gone."""
        errors = [{"code": "tenant_gone", "message": "the batch's tenant no longer exists on this server",
                   "param": None, "line": None}]
        log.warning("batch %s: its tenant %s is gone; the batch fails", batch["id"], batch["tenant"])
        if batch["status"] == "validating":
            await asyncio.to_thread(self.store.set_status, batch["id"], "failed", ("validating",),
                                    errors=json.dumps(errors))
        else:
            await self._finalize(batch, "failed", "tenant_gone", errors)

    async def _finalize(self, batch: dict, status: str, unfinished_code: str | None,
                        errors: list[dict] | None = None) -> None:
        if status == "completed":
            await asyncio.to_thread(self.store.set_status, batch["id"], "finalizing", ("in_progress",))
        await asyncio.to_thread(self.store.finalize, batch, status, unfinished_code, errors)
        for table in (self._retry_at, self._attempts):
            for key in [k for k in table if k[0] == batch["id"]]:
                del table[key]
        self._traced.discard(batch["id"])
