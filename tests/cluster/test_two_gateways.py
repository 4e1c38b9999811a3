"""Several gateways per worker (issue 13, part 2): two `inferd gateway --redis` processes share two registered echo
workers (a worker secret on every connection). Streams through both gateways all complete (a new connection no longer
replaces another: the old code knocked the gateways off each other in a tight loop, 0 of 8 streams completed), each
worker holds exactly one connection per gateway, and the tenant's token quota, kept in the same Redis, is one bucket
for both gateways (how exact a shared limit is under load is tests/gateway/test_limits_e2e.py's). A malformed
registration entry is skipped, never stopping discovery."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import redis
from cluster_util import wait_for
from remote_workers import start_workers

from inferd.gateway.tenants import create_key
from servers import kill_group, sse_data

pytestmark = pytest.mark.timeout(240)

SECRET = "a-shared-worker-secret"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
REQUEST_TOKENS = 80 + 10  # prompt + max_tokens of each quota request (the echo worker runs them out)
TPM = 2 * REQUEST_TOKENS + 20  # two requests fit the bucket, a third does not
WINDOW = 3600.0  # the bucket barely refills during the test: what was admitted is what the quota held


def test_two_gateways_share_two_workers(cluster, redis_url, tiny_llama_dir, tmp_path):
    db = redis_url.rsplit("/", 1)[0] + "/6"  # a database of its own: no other test's keys
    store = redis.Redis.from_url(db)
    store.flushdb()
    store.set("inferd:worker:junk", b"{not json")  # malformed entries: skipped and logged
    store.set("inferd:worker:bad-address", b'{"worker_id": "x", "address": "nowhere"}')
    store.sadd("inferd:worker:a-set", "x")  # not even a string key
    keys = {"t": create_key(str(tmp_path / "keys.json"), "t", tpm=TPM)[0],
            "free": create_key(str(tmp_path / "keys.json"), "free")[0]}
    slow = {"INFERD_FAULT": "action=slow,ms=10,times=0"}  # streams overlap
    # the gateways and the workers all start side by side (the gateways find the workers in Redis, below)
    gateways = [cluster.begin("--redis", db, "--worker-secret", SECRET, "--keys", str(tmp_path / "keys.json"),
                              "--rate-window", str(WINDOW), "--heartbeat-interval", "0.1", command="gateway",
                              name=f"gateway-{i}") for i in range(2)]
    workers = start_workers(tmp_path, tiny_llama_dir, ["w-a", "w-b"], "--echo", "--register", db,
                            "--heartbeat-interval", "0.1", "--worker-secret", SECRET, env=slow)
    try:
        gateways = [g.ready() for g in gateways]
        def versions(g) -> dict:  # /v1/models needs a key here
            r = httpx.get(g.url + "/v1/models", headers=bearer(keys["free"]), timeout=10)
            return r.json()["data"][0]["versions"]

        for g in gateways:
            wait_for(lambda g=g: versions(g) == {"v1": 2})

        async def stream(client, gateway, i):
            body = {"model": "tiny", "prompt": f"stream {i} one two three", "max_tokens": 40, "stream": True}
            r = await client.post(gateway.url + "/v1/completions", json=body, headers=bearer(keys["free"]))
            return r.status_code, sse_data(r.content)

        async def all_streams():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(stream(client, gateways[i % 2], i) for i in range(8)))

        for status, events in asyncio.run(all_streams()):
            assert status == 200 and events[-1] == "[DONE]", events[-3:]
            chunks = [e for e in events[:-1] if "error" not in e]
            assert len(chunks) == len(events) - 1, [e for e in events if "error" in e]  # none aborted
            assert "".join(c["choices"][0]["text"] for c in chunks)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # each worker holds one connection per gateway: nothing knocked anything off
        for w in workers:
            assert w.log_path.read_text().count("authenticated") == 2, w.log_path.read_text()[-2000:]

        # the tenant's quota is one bucket for both gateways: alternating, two requests fit and the next two are
        # refused for tokens (a bucket per gateway would still have had room for one more on each)
        answers = [httpx.post(gateways[i % 2].url + "/v1/completions", headers=bearer(keys["t"]), timeout=60,
                              json={"model": "tiny", "prompt": [5] * 80, "max_tokens": 10}) for i in range(4)]
        assert [r.status_code for r in answers] == [200, 200, 429, 429], [r.text for r in answers]
        assert [r.json()["usage"]["total_tokens"] for r in answers[:2]] == [REQUEST_TOKENS] * 2
        assert {r.json()["error"]["code"] for r in answers[2:]} == {"rate_limit_exceeded"}
        for g in gateways:
            assert "malformed registration" in g.log()
    finally:
        for w in workers:
            kill_group(w.proc)
        store.close()
