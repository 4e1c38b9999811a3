"""The engine's waiting queue is bounded (ENGINE_MAX_WAITING): several gateways may each fill their room on one
worker, so past the bound the worker refuses new requests retryably (the gateway sends them elsewhere) instead of
queueing without end. An echo worker with one batch slot, its first two steps slowed to 500 ms (so that nothing
finishes while the requests arrive, however loaded the machine), gets 260 requests at once."""

from __future__ import annotations

import asyncio

from inferd.config import ENGINE_MAX_WAITING
from inferd.engine import SamplingParams
from inferd.worker.client import WorkerClient, WorkerUnavailable


def test_past_the_bound_requests_are_refused_retryably(spawn_worker):
    proc = spawn_worker("--echo", "--max-num-seqs", "1", "--heartbeat-interval", "0.1",
                        env={"INFERD_FAULT": "action=slow,ms=500,times=2"})
    n = ENGINE_MAX_WAITING + 4

    async def main():
        async with await WorkerClient.connect(proc.host, proc.port) as client:
            params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

            async def one(i: int):
                try:
                    async for out in client.generate(f"r{i}", [5, 6, 7], params):
                        if out.finished:
                            return "done"
                except WorkerUnavailable as e:
                    return str(e)

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 120)

    results = asyncio.run(main())
    refused = [r for r in results if r != "done"]
    # one runs, ENGINE_MAX_WAITING wait (the first may still be waiting when the others arrive)
    assert 3 <= len(refused) <= 4, refused[:3]
    assert all("queue is full" in r for r in refused)
