"""Rollouts through the admin API and `inferd rollout`: from v1 to v2 under steady streaming load with zero failed or
truncated streams (canary, automatic promotion, the old worker drained and gone); a canary whose worker fails
(injected errors) is rolled back automatically; the admin API needs the admin key."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest
from cluster_util import random_prompts
from streams import request_body, stream_completion

from servers import ENV

pytestmark = pytest.mark.timeout(300)

ADMIN = "admin-key-for-tests"
TARGETS = ("--admin-key", ADMIN, "--rollout-min-requests", "8", "--rollout-min-seconds", "1",
           "--rollout-max-latency-ratio", "50", "--shutdown-grace", "20")


def rollout_cli(server, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "inferd", "rollout", *args, "--url", server.url, "--admin-key", ADMIN],
                          capture_output=True, text=True, env=ENV, timeout=200)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def steady_load(url: str, stop: asyncio.Event, clients: int = 3, stream: bool = True) -> list:
    """`clients` loops, each sending one request after the other until stop; returns every result."""
    prompts = random_prompts(clients, (10, 30), seed=41)
    results = []

    async def loop(prompt):
        async with httpx.AsyncClient(timeout=120) as client:
            while not stop.is_set():
                if stream:
                    results.append(await stream_completion(client, url, request_body("tiny", prompt, 24, None)))
                else:
                    results.append(await client.post(url + "/v1/completions",
                                                     json={"model": "tiny", "prompt": prompt, "max_tokens": 8}))

    await asyncio.gather(*(loop(p) for p in prompts))
    return results


def wait_status(server, predicate, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = httpx.get(server.url + "/admin/rollout", headers={"Authorization": f"Bearer {ADMIN}"},
                           timeout=10).json()
        if predicate(status):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.1)


def test_rollout_under_streaming_load_drops_nothing(cluster, tiny_llama_dir):
    server = cluster("--workers", "1", *TARGETS, env={"INFERD_FAULT": "action=slow,ms=4,times=0"}, name="rollout")

    async def main():
        stop = asyncio.Event()
        load = asyncio.create_task(steady_load(server.url, stop))
        await asyncio.sleep(0.5)
        started = await asyncio.to_thread(rollout_cli, server, "start", "--model", "tiny", "--version", "v2",
                                          "--path", str(tiny_llama_dir), "--canary", "50")
        status = await asyncio.to_thread(wait_status, server, lambda s: s["state"] == "promoted")
        # the old worker drains and leaves: only v2 serves
        deadline = time.monotonic() + 60
        while httpx.get(server.url + "/v1/models").json()["data"][0]["versions"] != {"v2": 1}:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # load on v2 alone for a moment
        stop.set()
        return started, status, await load

    started, status, results = asyncio.run(main())
    assert started["state"] == "canary" and started["new_version"] == "v2" and started["old_version"] == "v1"
    assert "automatic promotion" in status["reason"]
    assert status["figures"]["v2"]["requests"] >= 8
    failed = [r for r in results if not (r.done and not r.errors and len(r.tokens) == 24)]
    assert not failed, f"{len(failed)} of {len(results)} streams failed or were cut: {failed[:2]}"
    versions = {r.headers["x-inferd-model-version"] for r in results}
    assert versions == {"v1", "v2"}
    assert rollout_cli(server, "status")["state"] == "promoted"


def test_a_failing_canary_is_rolled_back(cluster, tiny_llama_dir):
    server = cluster("--workers", "1", *TARGETS, env={"INFERD_FAULT": "action=fail,version=v2,times=0"},
                     name="rollback")
    headers = {"Authorization": f"Bearer {ADMIN}"}
    # the admin API needs the admin key
    assert httpx.get(server.url + "/admin/rollout", timeout=10).status_code == 401

    async def main():
        stop = asyncio.Event()
        load = asyncio.create_task(steady_load(server.url, stop, stream=False))
        async with httpx.AsyncClient(timeout=200) as client:
            start = await client.post(server.url + "/admin/rollout/start", headers=headers,
                                      json={"version": "v2", "path": str(tiny_llama_dir), "canary": 50})
        status = await asyncio.to_thread(wait_status, server, lambda s: s["state"] == "rolled_back")
        deadline = time.monotonic() + 60
        while httpx.get(server.url + "/v1/models").json()["data"][0]["versions"] != {"v1": 1}:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        stop.set()
        await load
        after = await asyncio.gather(*(httpx.AsyncClient(timeout=60).post(
            server.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
            for _ in range(6)))
        return start, status, after

    start, status, after = asyncio.run(main())
    assert start.status_code == 200, start.text
    assert "automatic rollback" in status["reason"] and "error rate" in status["reason"]
    assert status["figures"]["v2"]["errors"] >= 1
    assert [r.status_code for r in after] == [200] * 6
    assert {r.headers["x-inferd-model-version"] for r in after} == {"v1"}
    # a second rollout can start after a rollback; a bad one is refused with a clear error
    bad = httpx.post(server.url + "/admin/rollout/start", headers=headers, timeout=30,
                     json={"version": "v1", "path": str(tiny_llama_dir)})
    assert bad.status_code == 400 and "must differ" in bad.json()["error"]["message"]
