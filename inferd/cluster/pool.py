"""WorkerPool: the local worker processes of `inferd serve`, by model version: started, supervised (restarted when
they die), added and retired (drained, not restarted) by the autoscaler and by rollouts.

Worker ids are `worker-0`, `worker-1`, ... in start order and never reused, so logs and metrics stay unambiguous.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

from ..config import DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_MODEL_VERSION
from ..gateway.router import Router
from .supervisor import LocalWorker

log = logging.getLogger("inferd.cluster")


def spread_devices(args: list[str], index: int, device_count: int | None = None) -> list[str]:
    """`--device cuda` with several workers: worker i gets cuda:(i mod the number of GPUs), one engine per GPU.
    Any other device (cpu, or an explicit cuda:N) is left as given."""
    if "--device" not in args:
        return args
    at = args.index("--device") + 1
    if args[at] != "cuda":
        return args
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_count <= 0:
        return args  # the worker reports the missing GPU itself
    return [*args[:at], f"cuda:{index % device_count}", *args[at + 1:]]


class WorkerPool:
    def __init__(self, router: Router, args_for: Callable[[str], list[str]],
                 heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT, on_attach=None, secret: str = "",
                 name_prefix: str = "worker"):
        """args_for(version): the `inferd worker` options for a worker of that model version. secret: shared
        with the workers (handed over in their environment)."""
        self.router = router
        self.args_for = args_for
        self.secret = secret
        self.name_prefix = name_prefix  # worker ids: PREFIX-0, PREFIX-1, ...
        self.heartbeat_timeout = heartbeat_timeout
        self.on_attach = on_attach
        self.workers: list[LocalWorker] = []
        self._ids = itertools.count()
        self._tasks: dict[LocalWorker, asyncio.Task] = {}
        self._retiring: set[asyncio.Task] = set()

    def of_version(self, version: str) -> list[LocalWorker]:
        return [w for w in self.workers if w.version == version]

    def versions(self) -> list[str]:
        return sorted({w.version for w in self.workers})

    async def add(self, count: int = 1, version: str = DEFAULT_MODEL_VERSION) -> list[LocalWorker]:
        """Starts count workers of version together and supervises them; raises WorkerStartError if one cannot
        start (the others keep running)."""
        new = []
        for _ in range(count):
            index = next(self._ids)
            new.append(LocalWorker(spread_devices(self.args_for(version), index), self.router,
                                   f"{self.name_prefix}-{index}", self.heartbeat_timeout, on_attach=self.on_attach,
                                   version=version, secret=self.secret))
        self.workers.extend(new)
        results = await asyncio.gather(*(w.start() for w in new), return_exceptions=True)
        error = None
        for worker, result in zip(new, results):
            if isinstance(result, BaseException):
                error = error or result
                self.workers.remove(worker)
                await worker.stop()
            else:
                self._tasks[worker] = asyncio.create_task(worker.supervise())
        if error is not None:
            raise error
        return new

    def retire(self, worker: LocalWorker, grace_period: float) -> asyncio.Task:
        """Drains a worker for good in the background: no new work, its streams finish (or move after the grace
        period), then it exits."""
        if worker in self.workers:
            self.workers.remove(worker)
        task = self._tasks.pop(worker, None)
        if task is not None:
            task.cancel()
        log.info("retiring %s (%s), grace %.1f s", worker.worker_id, worker.version, grace_period)
        stopping = asyncio.create_task(worker.stop(grace_period))
        self._retiring.add(stopping)
        stopping.add_done_callback(self._retiring.discard)
        return stopping

    def least_loaded(self, version: str | None = None) -> LocalWorker | None:
        candidates = [w for w in self.workers if version is None or w.version == version]
        if not candidates:
            return None
        return min(candidates, key=lambda w: w.client.num_streams if w.client is not None else 0)

    async def stop_all(self, grace_period: float = 0.0) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        workers, self.workers = self.workers, []
        await asyncio.gather(*(w.stop(grace_period) for w in workers), *self._retiring, return_exceptions=True)
