"""Workers on other hosts: `inferd worker --listen HOST:PORT --register REDIS` announce themselves in Redis with a
TTL renewed every heartbeat; `inferd gateway --redis URL` finds them (also ones that start later), serves through
them, and forgets one that left."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from cluster_util import versions, wait_for
import redis
from remote_workers import start_worker
from servers import kill_group

pytestmark = pytest.mark.timeout(180)


def test_gateway_finds_registered_workers(cluster, redis_url, tiny_llama_dir, tmp_path):
    db = redis_url.rsplit("/", 1)[0] + "/5"  # a database of its own: no other test's keys
    redis.Redis.from_url(db).flushdb()
    first = start_worker(tmp_path, tiny_llama_dir, "reg-a", "--register", db, "--heartbeat-interval", "0.1")
    workers = [first]
    try:
        gateway = cluster("--redis", db, command="gateway", name="registry-gateway")
        r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.headers["x-inferd-worker"] == "reg-a"
        workers.append(start_worker(tmp_path, tiny_llama_dir, "reg-b", "--register", db, "--model-version", "v2",
                                    "--heartbeat-interval", "0.1"))
        wait_for(lambda: versions(gateway) == {"v1": 1, "v2": 1})
        keys = sorted(k.decode() for k in redis.Redis.from_url(db).keys("inferd:worker:*"))
        assert keys == ["inferd:worker:reg-a", "inferd:worker:reg-b"]
        os.kill(first.pid, signal.SIGTERM)  # a clean exit deregisters at once
        wait_for(lambda: versions(gateway) == {"v2": 1})
        assert first.proc.wait(timeout=30) == 0
        assert redis.Redis.from_url(db).keys("inferd:worker:*") == [b"inferd:worker:reg-b"]
        r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.headers["x-inferd-worker"] == "reg-b"
    finally:
        for w in workers:
            kill_group(w.proc)
