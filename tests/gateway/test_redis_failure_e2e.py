"""Redis down or failing (issue 13, part 4): requests get 503 `limiter_unavailable` with Retry-After (never a 500,
never the host in the message), a settlement that fails is retried in the background until Redis is back, and the
server serves again once it is. Leases are short and renewed while a request runs, so a dead gateway's slots come
back in seconds. A real redis-server of this module's own, killed (SIGKILL) and restarted on the same port."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from gw import bearer, make_keys
from servers import free_port, kill_redis, start_redis
from inferd.gateway.limits import LimiterUnavailable, TenantLimits
from inferd.gateway.redis_limits import RedisLimiter

STEP_MS = 20


@pytest.fixture
def redis_server(tmp_path):
    """A restartable redis-server: .port, .url, .stop(), .start()."""
    class Redis:
        port = free_port()
        url = f"redis://127.0.0.1:{port}/0"
        proc = None

        def start(self):
            self.proc = start_redis(tmp_path, self.port)

        def stop(self):
            kill_redis(self.proc)

    r = Redis()
    r.start()
    yield r
    if r.proc.poll() is None:
        r.stop()


def test_redis_down_is_a_503_then_served_again(redis_server, tmp_path, tiny_llama_dir):
    from servers import kill_group, start_server

    keys = make_keys(tmp_path / "keys.json", {"t": {"max_concurrency": 4}})
    server = start_server(tiny_llama_dir, tmp_path / "serve.log", "--echo", "--max-model-len", "256",
                          "--heartbeat-interval", "0.1", "--keys", str(tmp_path / "keys.json"), "--redis",
                          redis_server.url, model_name="tiny", env={"INFERD_FAULT": f"action=slow,times=0,ms={STEP_MS}"})
    try:
        def post(max_tokens: int = 4, **kw) -> httpx.Response:
            return httpx.post(server.url + "/v1/completions", headers=bearer(keys["t"]), timeout=60,
                              json={"model": server.model, "prompt": "a b c", "max_tokens": max_tokens, **kw})

        assert post().status_code == 200
        with httpx.Client(timeout=60) as client:
            # a request running while Redis dies: it completes; its settlement fails and is retried
            with client.stream("POST", server.url + "/v1/completions", headers=bearer(keys["t"]),
                               json={"model": server.model, "prompt": "a b c", "max_tokens": 100,
                                     "stream": True}) as running:
                assert running.status_code == 200
                redis_server.stop()
                body = b"".join(running.iter_bytes())
        assert body.endswith(b"data: [DONE]\n\n")
        server.wait_metrics(lambda m: m.get("inferd_gateway_settlements_pending", 0) >= 1)
        for r in (post(), httpx.post(server.url + "/tokenize", headers=bearer(keys["t"]), timeout=60,
                                     json={"model": server.model, "prompt": "a b c"})):
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "limiter_unavailable"
            assert int(r.headers["retry-after"]) >= 1
            assert "127.0.0.1" not in error["message"] and str(redis_server.port) not in error["message"]
        redis_server.start()
        server.wait_metrics(lambda m: m.get("inferd_gateway_settlements_pending", 0) == 0
                            and m.get("inferd_gateway_open_requests") == 0)
        assert post().status_code == 200
        assert "Exception in ASGI" not in server.log()
    finally:
        kill_group(server.proc)


def test_leases_are_renewed_while_running_and_expire_when_not(redis_url):
    """A gateway that stops renewing (it died) gives its slot back after lease_s; renewed, a lease outlives it."""
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", TenantLimits(max_concurrency=1)

    async def body():
        lim = RedisLimiter(redis_url, lease_s=0.5, prefix=f"test-{uuid.uuid4().hex[:8]}")
        try:
            assert (await lim.reserve(tenant, limits, "live", 0)).allowed
            for _ in range(6):  # 1.2 s: over twice the lease, renewed every 0.2 s
                await asyncio.sleep(0.2)
                await lim.renew([(tenant, "live")])
                assert (await lim.reserve(tenant, limits, "other", 0)).reason == "concurrency"
            # no more renewals (the gateway died): the slot comes back once the lease has run out
            deadline = asyncio.get_running_loop().time() + 5
            while not (await lim.reserve(tenant, limits, "after", 0)).allowed:
                assert asyncio.get_running_loop().time() < deadline, "the unrenewed lease never expired"
                await asyncio.sleep(0.05)
            # a settled lease is not brought back by a late renewal, and settling twice refunds once
            await lim.settle(tenant, limits, "after", 0, 0)
            await lim.renew([(tenant, "after")])
            assert (await lim.reserve(tenant, limits, "again", 0)).allowed
        finally:
            await lim.close()

    asyncio.run(body())


def test_settle_twice_refunds_once(redis_url):
    tenant, limits = f"t-{uuid.uuid4().hex[:8]}", TenantLimits(tpm=100)

    async def body():
        lim = RedisLimiter(redis_url, window=3600, prefix=f"test-{uuid.uuid4().hex[:8]}")
        try:
            assert (await lim.reserve(tenant, limits, "a", 60)).allowed
            await lim.settle(tenant, limits, "a", 60, 10)  # 50 back: 90 left
            await lim.settle(tenant, limits, "a", 60, 10)  # a retry after a lost reply: nothing more
            decision = await lim.reserve(tenant, limits, "b", 95)
            assert not decision.allowed and decision.reason == "tokens"
            assert decision.remaining_tokens == 90
        finally:
            await lim.close()

    asyncio.run(body())


def test_an_unreachable_redis_raises_limiter_unavailable_quickly():
    async def body():
        lim = RedisLimiter(f"redis://127.0.0.1:{free_port()}/0")
        try:
            with pytest.raises(LimiterUnavailable) as e:
                await lim.reserve("t", TenantLimits(rpm=5), "x", 1)
            assert "127.0.0.1" not in str(e.value)
        finally:
            await lim.close()

    asyncio.run(body())
