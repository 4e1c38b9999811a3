"""The local supervisor keeps restarting a worker whatever goes wrong on the way (issue 13, part 4): a worker killed
with SIGKILL is started again even when the first restart raises something that is not a WorkerStartError (an
OSError spawning it, a bug), with back-off, and the supervisor task itself never ends before stop()."""

from __future__ import annotations

import asyncio
import os
import signal

from inferd.cluster.supervisor import LocalWorker
from inferd.gateway.router import Router


class FlakyStart(LocalWorker):
    """A real worker process whose second start raises first (the failure the supervisor must survive)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.failures = 0

    async def start(self) -> None:
        if self.num_starts == 1 and self.failures == 0:
            self.failures += 1
            raise OSError(24, "Too many open files (injected)")
        await super().start()


def test_the_supervisor_restarts_after_any_exception(tiny_llama_dir):
    async def main():
        router = Router()
        worker = FlakyStart(["--echo", "--model", str(tiny_llama_dir), "--max-model-len", "256",
                             "--heartbeat-interval", "0.1"], router, heartbeat_timeout=1.0)
        await worker.start()
        first_pid = worker.pid
        supervising = asyncio.create_task(worker.supervise())
        try:
            os.kill(first_pid, signal.SIGKILL)
            deadline = asyncio.get_running_loop().time() + 60
            while not (worker.num_starts == 2 and worker.client is not None and worker.client.dead is None
                       and worker.pid != first_pid):
                assert not supervising.done(), supervising
                assert asyncio.get_running_loop().time() < deadline, "the worker was never started again"
                await asyncio.sleep(0.05)
            assert worker.failures == 1  # the failed start happened, and was survived
            assert router.ready
        finally:
            await worker.stop(0.0)
            await asyncio.wait_for(supervising, 10)

    asyncio.run(main())
