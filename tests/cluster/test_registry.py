"""Workers on other hosts: `inferd worker --listen HOST:PORT --register REDIS` announce themselves in Redis with a
TTL renewed every heartbeat; `inferd gateway --redis URL` finds them (also ones that start later), serves through
them, and forgets one that left."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from cluster_util import versions, wait_for
from remote_workers import start_worker

from inferd.config import MAX_HELLO_STRING
from inferd.worker.registry import KEY_PREFIX, discover
from servers import free_port, kill_group, kill_redis, start_redis

pytestmark = pytest.mark.timeout(180)


def test_gateway_finds_registered_workers(cluster, redis_url, tiny_llama_dir, tmp_path):
    db = redis_url.rsplit("/", 1)[0] + "/5"  # a database of its own: no other test's keys
    redis.Redis.from_url(db).flushdb()
    # echo workers (no weights: they start in a fraction of the time); discovery is what is tested here
    gateway = cluster.begin("--redis", db, command="gateway", name="registry-gateway")  # side by side with reg-a
    first = start_worker(tmp_path, tiny_llama_dir, "reg-a", "--register", db, "--heartbeat-interval", "0.1", "--echo")
    workers = [first]
    try:
        gateway = gateway.ready()
        wait_for(lambda: versions(gateway) == {"v1": 1})  # found in Redis
        r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.headers["x-inferd-worker"] == "reg-a"
        workers.append(start_worker(tmp_path, tiny_llama_dir, "reg-b", "--register", db, "--model-version", "v2",
                                    "--heartbeat-interval", "0.1", "--echo"))
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


def test_malformed_registrations_are_skipped_and_logged(redis_url, caplog):
    """Every entry is validated: one that is not what a worker writes is skipped (and logged), the others found."""
    good = {"address": "127.0.0.1:9000", "worker_id": "good", "model": "m", "version": "v1"}
    bad = {"junk": b"{not json", "binary": b"\xff\xfe", "a-list": b"[1, 2]", "no-address": {"worker_id": "x"},
           "bad-address": {**good, "address": "nowhere"}, "port-0": {**good, "address": "h:0"},
           "id-not-a-string": {**good, "worker_id": 5}, "model-not-a-string": {**good, "model": 7},
           "id-too-long": {**good, "worker_id": "w" * (MAX_HELLO_STRING + 1)}}

    async def main():
        store = aioredis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/7")
        try:
            await store.flushdb()
            await store.set(KEY_PREFIX + "good", json.dumps(good))
            for name, value in bad.items():
                await store.set(KEY_PREFIX + name, value if isinstance(value, bytes) else json.dumps(value))
            await store.sadd(KEY_PREFIX + "a-set", "x")  # another Redis type under our prefix
            return await discover(store)
        finally:
            await store.aclose()

    with caplog.at_level(logging.WARNING, logger="inferd.worker"):
        found = asyncio.run(main())
    assert found == {"good": good}
    logged = caplog.text
    for name in [*bad, "a-set"]:
        assert KEY_PREFIX + name in logged, name


def test_workers_are_attached_by_model_and_task_and_a_killed_embedder_loses_no_input(cluster, redis_url,
                                                                                     tiny_llama_dir, tmp_path):
    """`inferd gateway --redis --embedding-model M` serves its chat model through the chat workers and M through M's
    embedding workers (`worker --task embed --register`); a worker announcing another model (given with --worker,
    or registered) is not attached, and said so in the log. SIGKILL of an embedding worker while inputs wait in it:
    every request still answers 200, with the vectors of a calm run (its inputs run again on the other worker)."""
    db = redis_url.rsplit("/", 1)[0] + "/6"
    redis.Redis.from_url(db).flushdb()
    embedder = tmp_path / "tiny-embedder"  # the decoder, under a name of its own (workers are told apart by name)
    embedder.symlink_to(tiny_llama_dir, target_is_directory=True)
    other = tmp_path / "other-model"  # the same files under another name: only the announced name differs
    other.symlink_to(tiny_llama_dir, target_is_directory=True)
    # inputs wait 1.5 s in a worker for others to join: the window in which one is killed
    slow = ("--task", "embed", "--register", db, "--embed-max-wait-ms", "1500")
    with ThreadPoolExecutor(5) as pool:  # started side by side
        starting = [pool.submit(start_worker, tmp_path, tiny_llama_dir, "reg-chat", "--register", db, "--echo"),
                    pool.submit(start_worker, tmp_path, embedder, "emb-a", *slow),
                    pool.submit(start_worker, tmp_path, embedder, "emb-b", *slow),
                    pool.submit(start_worker, tmp_path, other, "given", "--echo"),
                    pool.submit(start_worker, tmp_path, other, "registered", "--echo", "--register", db)]
    workers = [f.result() for f in starting if f.exception() is None]
    try:
        assert len(workers) == 5, [f.exception() for f in starting]
        gateway = cluster("--redis", db, "--worker", workers[3].address, "--embedding-model", str(embedder),
                          "--admin-key", "adm", command="gateway", name="embed-gateway")
        wait_for(lambda: f"not attaching the worker at {workers[3].address}: it serves the model 'other-model'"
                 in gateway.log())
        wait_for(lambda: "not connecting to the registered worker registered" in gateway.log())
        assert "registered worker emb-" not in gateway.log()  # the embedding model's: served, not other
        assert versions(gateway) == {"v1": 1}
        r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.headers["x-inferd-worker"] == "reg-chat"
        assert "authenticated" not in workers[4].log_path.read_text()  # never even connected to
        admin = {"Authorization": "Bearer adm"}

        def embedding_workers() -> dict:
            cards = httpx.get(gateway.url + "/admin/workers", headers=admin, timeout=10).json()
            return {c["worker_id"]: c for c in cards["embedding_workers"]["tiny-embedder"]}

        wait_for(lambda: {w for w, c in embedding_workers().items() if c["usable"]} == {"emb-a", "emb-b"})
        models = [m["id"] for m in httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"]]
        assert models == ["tiny", "tiny-embedder"]
        inputs = [[f"text {i} number {j}" for j in range(3)] for i in range(12)]
        url = gateway.url + "/v1/embeddings"
        # the calm run: every input's vector, from one request (its 36 inputs wait out the 1.5 s together)
        calm = httpx.post(url, json={"model": "tiny-embedder", "input": [t for x in inputs for t in x]}, timeout=60)
        assert calm.status_code == 200, calm.text
        reference = np.asarray([d["embedding"] for d in calm.json()["data"]])
        assert reference.shape[0] == 3 * len(inputs)
        # normalized vectors: a dot product is a cosine; the bound below tells any two of these inputs apart
        assert float((reference @ reference.T - 2 * np.eye(len(reference))).max()) < 0.9999

        async def load():
            async with httpx.AsyncClient(timeout=60) as c:
                sent = [asyncio.ensure_future(c.post(url, json={"model": "tiny-embedder", "input": x}))
                        for x in inputs]
                while not embedding_workers()["emb-a"]["streams"]:  # inputs are waiting in emb-a
                    await asyncio.sleep(0.02)
                os.kill(workers[1].pid, signal.SIGKILL)
                return await asyncio.gather(*sent)

        responses = asyncio.run(load())
        assert [r.status_code for r in responses] == [200] * len(inputs)
        for i, r in enumerate(responses):  # every input's vector is its own (a replayed one too)
            data = r.json()["data"]
            assert [d["index"] for d in data] == [0, 1, 2], (i, r.text[:200])
            for j, d in enumerate(data):
                cosine = float(np.asarray(d["embedding"]) @ reference[3 * i + j])
                assert cosine >= 0.9999, (inputs[i][j], cosine)
        wait_for(lambda: {w for w, c in embedding_workers().items() if c["usable"]} == {"emb-b"})
    finally:
        for w in workers:
            kill_group(w.proc)


def test_registrations_outside_worker_allow_are_never_connected_to(cluster, redis_url, tiny_llama_dir, tmp_path):
    """`gateway --worker-allow 127.0.0.1/32`: a worker registered at 127.0.0.3 (outside) is refused and logged, never
    connected to; the one at 127.0.0.1 serves. Whoever can write to Redis cannot point a gateway at any host."""
    db = redis_url.rsplit("/", 1)[0] + "/4"
    redis.Redis.from_url(db).flushdb()
    # the gateway starts side by side with the workers (it finds them in Redis)
    gateway = cluster.begin("--redis", db, "--worker-allow", "127.0.0.1/32", command="gateway", name="allow-gateway")
    with ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(start_worker, tmp_path, tiny_llama_dir, "inside", "--register", db, "--echo"),
                    pool.submit(start_worker, tmp_path, tiny_llama_dir, "outside", "--listen", "127.0.0.3:0",
                                "--register", db, "--echo")]
    workers = [f.result() for f in starting if f.exception() is None]
    try:
        assert len(workers) == 2, [f.exception() for f in starting]
        inside, outside = workers
        assert outside.address.startswith("127.0.0.3:")
        gateway = gateway.ready()
        wait_for(lambda: f"not connecting to the registered worker at {outside.address}: 127.0.0.3 is outside "
                 "--worker-allow" in gateway.log())
        wait_for(lambda: versions(gateway) == {"v1": 1})  # inside, found in Redis
        r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.headers["x-inferd-worker"] == "inside"
        assert versions(gateway) == {"v1": 1}
        assert "authenticated" in inside.log_path.read_text()
        assert "authenticated" not in outside.log_path.read_text()  # never connected to
        assert gateway.log().count(f"not connecting to the registered worker at {outside.address}") == 1
    finally:
        for w in workers:
            kill_group(w.proc)


def test_the_default_worker_allow_list_is_loopback_and_private_ranges():
    """By default a registration may point a gateway at loopback and private addresses (where a cluster's pods are),
    never at a link-local one (a cloud's metadata endpoint) or a public one."""
    from inferd.cluster.remote import DEFAULT_ALLOW, allowed, parse_allow

    for ip in ("127.0.0.1", "10.4.5.6", "172.20.0.9", "192.168.1.2", "100.64.3.4", "::1", "fd12::7",
               "::ffff:10.0.0.1"):
        assert allowed(ip, DEFAULT_ALLOW), ip
    for ip in ("169.254.169.254", "fe80::1", "8.8.8.8", "2001:db8::1", "::ffff:8.8.8.8", "0.0.0.0"):
        assert not allowed(ip, DEFAULT_ALLOW), ip
    given = parse_allow("192.0.2.7, [2001:db8::/32]")
    assert allowed("192.0.2.7", given) and allowed("2001:db8::5", given) and not allowed("192.0.2.8", given)
    for bad in ("10.0.0.0/8,nowhere", "", " , "):
        with pytest.raises(ValueError, match="--worker-allow"):
            parse_allow(bad)


def test_a_redis_with_a_password_gets_it_from_the_environment(cluster, tiny_llama_dir, tmp_path):
    """deploy/k8s runs Redis with requirepass: $INFERD_REDIS_PASSWORD (from a Secret) goes into every Redis URL that
    carries none, worker --register and gateway --redis (quotas and discovery), and never onto the command line."""
    password = "p@ss:w/rd %1"  # characters a URL must quote
    port = free_port()
    redis_proc = start_redis(tmp_path, port, password=password)
    url = f"redis://127.0.0.1:{port}/0"
    env = {"INFERD_REDIS_PASSWORD": password}
    worker = None
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url).ping()  # nothing gets in without it
        gateway = cluster.begin("--redis", url, env=env, command="gateway", name="pw-gateway")  # beside the worker
        worker = start_worker(tmp_path, tiny_llama_dir, "pw-worker", "--register", url, "--echo", env=env)
        gateway = gateway.ready()
        wait_for(lambda: versions(gateway) == {"v1": 1})  # found in Redis
        r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.headers["x-inferd-worker"] == "pw-worker"
        assert redis.Redis.from_url(url, password=password).keys("inferd:worker:*") == [b"inferd:worker:pw-worker"]
        for pid in (worker.pid, gateway.proc.pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert password.encode() not in f.read()
    finally:
        if worker is not None:
            kill_group(worker.proc)
        kill_redis(redis_proc)
