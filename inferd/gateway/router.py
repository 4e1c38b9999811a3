"""Router: the attached workers, and a request's stream from the worker it was bound to.

Workers attach when their connection is up and detach when it dies; `on_change` callbacks (the gateway's dispatch)
run when one attaches. Which worker a request goes to is the gateway's decision (inferd/gateway/admission.py: only
a worker with room); without one, `pick` takes the attached worker with the fewest requests in flight. Every dispatch
carries a fresh epoch (see the worker protocol), so that outputs a worker sends for a dispatch the router gave up on
are dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable

from ..engine.request import SamplingParams
from ..worker.client import WorkerClient
from ..worker.protocol import WorkerHello, WorkerOutput, WorkerStats


class NoWorkerAvailable(Exception):
    """No worker can take a request now (none attached yet, or all are down): a 503 with Retry-After."""

    def __init__(self, reason: str, retry_after: int = 1):
        super().__init__(reason)
        self.retry_after = retry_after


class Router:
    def __init__(self) -> None:
        self.workers: list[WorkerClient] = []
        self._reason = "the model is loading"  # why no worker is attached
        self._epochs = itertools.count(1)
        self.on_change: list[Callable[[], None]] = []

    def attach(self, client: WorkerClient) -> None:
        self.workers.append(client)
        for callback in self.on_change:
            callback()

    def detach(self, client: WorkerClient, reason: str) -> None:
        if client in self.workers:
            self.workers.remove(client)
        self._reason = reason

    @property
    def not_ready_reason(self) -> str:
        """Why no worker can take a request (meaningful when not ready)."""
        dead = [w.dead for w in self.workers if w.dead is not None]
        if dead and len(dead) == len(self.workers):
            return f"the worker died ({dead[0]}) and is being restarted"
        return self._reason

    @not_ready_reason.setter
    def not_ready_reason(self, reason: str) -> None:
        self._reason = reason

    @property
    def ready(self) -> bool:
        return any(w.dead is None for w in self.workers)

    @property
    def hello(self) -> WorkerHello | None:
        """What the workers serve (they all serve the same model)."""
        return next((w.hello for w in self.workers if w.hello is not None), None)

    def latest_stats(self) -> WorkerStats | None:
        stats = [w.latest_stats for w in self.workers if w.latest_stats is not None]
        if not stats:
            return None
        if len(stats) == 1:
            return stats[0]
        return WorkerStats(**{name: sum(getattr(s, name) for s in stats) for name in WorkerStats.__dataclass_fields__})

    def pick(self) -> WorkerClient:
        live = [w for w in self.workers if w.dead is None]
        if not live:
            raise NoWorkerAvailable(f"no worker is available: {self.not_ready_reason}")
        return min(live, key=lambda w: w.num_streams)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       worker: WorkerClient | None = None) -> AsyncIterator[WorkerOutput]:
        """The request's outputs, step by step, from `worker` (default: pick()). Raises NoWorkerAvailable before
        anything was sent, else what WorkerClient.generate raises. Leaving the iteration early aborts the request in
        the worker."""
        worker = worker if worker is not None else self.pick()
        stream = worker.generate(request_id, prompt_token_ids, params, epoch=next(self._epochs))
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()
