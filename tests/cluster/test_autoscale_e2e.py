"""The autoscaler wired to a real server: load raises inferd_desired_workers and the local backend starts a worker;
when the load is gone, after the cool-down, a worker is retired. (The decision rule itself, over a scripted ramp,
is tested in test_autoscaler.py.)"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from cluster_util import versions, wait_for

pytestmark = pytest.mark.timeout(180)


def test_load_starts_a_worker_and_its_absence_retires_it(cluster):
    server = cluster("--workers", "1", "--worker-capacity", "200", "--autoscale", "--min-workers", "1",
                     "--max-workers", "2", "--scale-down-cooldown", "2", "--autoscale-window", "2", echo=True,
                     name="autoscale")
    assert server.metrics()["inferd_desired_workers"] == 1.0

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(server.url + "/v1/completions", json={
                "model": "tiny", "prompt": list(range(10, 60)), "max_tokens": 50}) for _ in range(20)))

    responses = asyncio.run(burst())  # ~2,000 tokens within the 2 s window: ~1,000 tok/s over 160 tok/s a worker
    assert [r.status_code for r in responses] == [200] * 20
    server.wait_metrics(lambda m: m["inferd_desired_workers"] == 2.0, timeout=10)
    wait_for(lambda: versions(server) == {"v1": 2})
    # the load is gone: the rate falls to 0 over the window, then the cool-down passes, then one worker retires
    server.wait_metrics(lambda m: m["inferd_desired_workers"] == 1.0, timeout=30)
    wait_for(lambda: versions(server) == {"v1": 1})
    assert "autoscaler: 2 worker(s)" in server.log() and "retiring" in server.log()
