"""SIGTERM drains: to `inferd serve` (new requests 503 + Retry-After, running streams finish within the grace period,
what outlives it ends with an error event `shutdown` and [DONE]) and to one worker of two (its streams that outlive
its grace period move to the other worker by the replay path, exactly)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from cluster_util import random_prompts
from streams import assert_same_stream, request_body, run_all, stream_completion

pytestmark = pytest.mark.timeout(240)

SLOW = {"INFERD_FAULT": "action=slow,ms=15,times=0"}  # every step 15 ms longer: streams last while the test acts


async def start_streams(client: httpx.AsyncClient, url: str, bodies: list[dict], server) -> list[asyncio.Task]:
    """Starts the streams and returns once every one of them is running in a worker."""
    tasks = [asyncio.create_task(stream_completion(client, url, b)) for b in bodies]
    deadline = time.monotonic() + 60
    while sum(v for k, v in server.metrics().items() if k.startswith("inferd_worker_streams{")) < len(bodies):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    return tasks


def test_sigterm_to_serve_finishes_streams_and_refuses_new_ones(cluster):
    server = cluster("--workers", "1", "--shutdown-grace", "30", env=SLOW, name="drain-serve")
    prompts = random_prompts(6, (10, 30), seed=21)
    bodies = [request_body("tiny", p, 80, None) for p in prompts]

    async def main():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=20)) as client:
            tasks = await start_streams(client, server.url, bodies, server)
            sent = time.monotonic()
            os.kill(server.proc.pid, signal.SIGTERM)
            refused = None
            while refused is None or refused.status_code != 503:  # the signal is handled between two requests
                refused = await client.post(server.url + "/v1/completions",
                                            json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
                assert time.monotonic() - sent < 10 and (refused.status_code in (200, 503)), refused.text
            ready = await client.get(server.url + "/ready")
            streams = await asyncio.gather(*tasks)
            return refused, ready, streams, time.monotonic() - sent

    refused, ready, streams, drain_s = asyncio.run(main())
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
    assert "shutting down" in refused.json()["error"]["message"]
    assert ready.status_code == 503
    for s in streams:  # none cut short: every stream finished its 80 tokens
        assert s.done and not s.errors and len(s.tokens) == 80 and s.finish_reason == "length"
    assert server.proc.wait(timeout=30) == 0
    assert "drained: requests done in" in server.log()


def test_streams_outliving_the_grace_period_end_with_a_shutdown_event(cluster):
    server = cluster("--workers", "1", "--shutdown-grace", "0.3", env=SLOW, name="drain-cut")
    bodies = [request_body("tiny", p, 200, None) for p in random_prompts(3, (10, 30), seed=22)]

    async def main():
        async with httpx.AsyncClient() as client:
            tasks = await start_streams(client, server.url, bodies, server)
            os.kill(server.proc.pid, signal.SIGTERM)
            return await asyncio.gather(*tasks)

    for s in asyncio.run(main()):
        assert s.done, "no [DONE] after the error event"
        assert [e["code"] for e in s.errors] == ["shutdown"]
        assert 0 < len(s.tokens) < 200
    assert server.proc.wait(timeout=30) == 0


def test_sigterm_to_one_worker_moves_its_streams_to_the_other(cluster, reference_server):
    server = cluster("--workers", "2", "--threads", "1", "--shutdown-grace", "0.3", env=SLOW, name="drain-worker")
    prompts = random_prompts(6, (10, 40), seed=23)
    bodies = [request_body("tiny", p, 100, None if i % 2 == 0 else 300 + i) for i, p in enumerate(prompts)]
    worker_pids = server.worker_pids()
    assert len(worker_pids) == 2

    async def main():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=20)) as client:
            tasks = await start_streams(client, server.url, bodies, server)
            os.kill(worker_pids[0], signal.SIGTERM)
            return await asyncio.gather(*tasks)

    ours = asyncio.run(main())
    assert server.metrics().get('inferd_replays_total{reason="drain"}', 0) >= 1
    ref = asyncio.run(run_all(reference_server.url, bodies))
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert_same_stream(a, b, bodies[i], len(prompts[i]))
