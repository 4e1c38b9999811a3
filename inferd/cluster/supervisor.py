"""LocalWorker: runs `inferd worker` as a child process, connects the gateway's WorkerClient to it, attaches it to
the router, and starts it again when it dies.

The child is started from the event loop's thread (the main thread, which lives as long as the server) with
--die-with-parent, so a killed server never leaves a worker behind. Its stderr (logs, the model-loading progress
bar) goes to the server's stderr; its stdout carries the READY line and is drained after it.

A worker that dies (exit, kill, closed connection, or silence past the heartbeat timeout: then it is killed) is
detached at once, so that new requests get 503 rather than waiting, and restarted after a back-off that doubles
up to a limit and resets once a worker has served for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

from ..config import (
    CLIENT_SECRET_ENVS,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_MODEL_VERSION,
    WORKER_RESTART_BACKOFF_S,
    WORKER_SECRET_ENV,
    WORKER_START_TIMEOUT_S,
)
from ..gateway.router import Router
from ..worker.client import WorkerClient, WorkerDead
from ..worker.faults import ENV as FAULT_ENV
from .child import ChildProcess

log = logging.getLogger("inferd.cluster")

STABLE_AFTER_S = 60.0  # a worker that served this long resets the restart back-off
STOP_TIMEOUT_S = 10.0  # after a shutdown request, seconds before a worker is killed


class WorkerStartError(RuntimeError):
    """The worker process exited or stayed silent before it was ready."""


class LocalWorker:
    def __init__(self, worker_args: list[str], router: Router, worker_id: str = "worker-0",
                 heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
                 start_timeout: float = WORKER_START_TIMEOUT_S, on_attach=None, version: str = DEFAULT_MODEL_VERSION,
                 secret: str = ""):
        """worker_args: the `inferd worker` options (model and engine settings) besides host, port and identity.
        on_attach(client): called with every newly connected client (to hook metrics)."""
        self.worker_args = worker_args
        self.secret = secret  # the handshake's (given to the worker in its environment, never in argv)
        self.router = router
        self.worker_id = worker_id
        self.version = version
        self.heartbeat_timeout = heartbeat_timeout
        self.start_timeout = start_timeout
        self.on_attach = on_attach
        self.proc: ChildProcess | None = None
        self.client: WorkerClient | None = None
        self.num_starts = 0
        self._stopping = False
        self._drain: asyncio.Task | None = None

    async def start(self) -> None:
        """Starts the worker and waits until it is attached. Raises WorkerStartError."""
        self.num_starts += 1
        env = dict(os.environ)
        if self.num_starts > 1:  # an injected fault (tests) acts in a worker's first life only
            env.pop(FAULT_ENV, None)
        for name in CLIENT_SECRET_ENVS:  # the API's keys are none of a worker's business
            env.pop(name, None)
        env.pop(WORKER_SECRET_ENV, None)
        if self.secret:  # none (tests' bare supervisors): the worker runs the handshake with the empty key
            env[WORKER_SECRET_ENV] = self.secret
        self.proc = await ChildProcess.start(  # not asyncio's subprocess: see child.py
            [sys.executable, "-m", "inferd", "worker", "--host", "127.0.0.1", "--port", "0", "--die-with-parent",
             "--worker-id", self.worker_id, "--model-version", self.version, *self.worker_args], env)
        try:
            host, port = await asyncio.wait_for(self._read_ready(), self.start_timeout)
        except TimeoutError:
            await self._kill()
            raise WorkerStartError(f"the worker printed no READY line within {self.start_timeout:.0f} s") from None
        except WorkerStartError:
            await self._kill()
            raise
        self._drain = asyncio.create_task(self._drain_stdout(self.proc))
        try:
            self.client = await WorkerClient.connect(host, port, self.heartbeat_timeout, secret=self.secret.encode())
        except WorkerDead as e:
            await self._kill()
            raise WorkerStartError(str(e)) from None
        if self.on_attach is not None:
            self.on_attach(self.client)
        self.router.attach(self.client)
        log.info("worker %s (pid %d) attached on %s:%d", self.worker_id, self.proc.pid, host, port)

    async def supervise(self) -> None:
        """Runs until stop(): waits for the attached worker to die, then starts a new one (with back-off). Any
        failure on the way (a start that fails, an OSError spawning the process, a bug) is logged and retried after
        the back-off: the supervisor itself never ends before stop()."""
        first, longest = WORKER_RESTART_BACKOFF_S
        backoff = first
        loop = asyncio.get_running_loop()
        while not self._stopping:
            started = loop.time()
            try:
                reason = await self._wait_dead()
            except Exception as e:  # noqa: BLE001 - watching it failed: treat it as dead, start another
                log.exception("watching worker %s failed", self.worker_id)
                reason = f"watching it failed: {e!r}"
                await self._kill_quietly()
            if self._stopping:
                return
            log.error("worker %s died: %s; restarting in %.1f s", self.worker_id, reason, backoff)
            if loop.time() - started > STABLE_AFTER_S:
                backoff = first
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, longest)
            while not self._stopping:
                try:
                    await self.start()
                    break
                except Exception as e:  # noqa: BLE001 - WorkerStartError, or anything else: keep trying
                    log.error("worker %s failed to start: %s; retrying in %.1f s", self.worker_id, e, backoff,
                              exc_info=not isinstance(e, WorkerStartError))
                    self.router.not_ready_reason = f"the worker failed to start: {e}"
                    await self._kill_quietly()
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, longest)

    async def _kill_quietly(self) -> None:
        """Kills the worker process of a failed start or watch, if it runs (so that no orphan is left)."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(Exception):
                await self._kill()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def stop(self, grace_period: float = 0.0) -> None:
        """Drains the worker for good (no restart): it takes no new request, in-flight ones get grace_period
        seconds, then it hands the rest back (the gateway replays them elsewhere) and exits; killed if it does
        not."""
        self._stopping = True
        client, proc = self.client, self.proc
        if client is not None and client.dead is None:
            with contextlib.suppress(WorkerDead):
                await asyncio.wait_for(client.shutdown(grace_period), grace_period + STOP_TIMEOUT_S)
        if proc is not None:
            try:
                await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                await self._kill()
        if self._drain is not None:
            self._drain.cancel()
        if client is not None:
            self.router.detach(client, f"worker {self.worker_id} was stopped")

    # ---- internals ------------------------------------------------------------------------------------------
    async def _wait_dead(self) -> str:
        client, proc = self.client, self.proc
        dead = asyncio.ensure_future(client.wait_dead())
        exited = asyncio.ensure_future(proc.wait())
        await asyncio.wait({dead, exited}, return_when=asyncio.FIRST_COMPLETED)
        if exited.done():
            reason = _describe_exit(proc.returncode)
            await client.close()
        else:
            reason = str(client.dead)
        dead.cancel()
        exited.cancel()
        self.router.detach(client, f"the worker died ({reason}) and is being restarted")
        await self._kill()  # a hung worker is still running: it must not come back to life later
        return reason

    async def _read_ready(self) -> tuple[str, int]:
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                code = await self.proc.wait()
                raise WorkerStartError(f"the worker exited ({_describe_exit(code)}) before it was ready; "
                                       "its log is above")
            text = line.decode(errors="replace").strip()
            if text.startswith("READY tcp://"):
                host, port = text.removeprefix("READY tcp://").rsplit(":", 1)
                return host, int(port)

    @staticmethod
    async def _drain_stdout(proc: ChildProcess) -> None:
        while await proc.stdout.read(65536):
            pass

    async def _kill(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
