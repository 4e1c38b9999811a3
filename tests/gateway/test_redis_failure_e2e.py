"""Redis down or failing (issue 13, part 4): requests get 503 `limiter_unavailable` with Retry-After (never a 500,
never the host in the message), a settlement that fails is retried in the background until Redis is back, and the
server serves again once it is; a settlement retried after a lost reply refunds once. A real redis-server of the
test's own (the redis_server fixture), killed (SIGKILL) and restarted on the same port. The leases: test_leases.py."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
from gw import bearer, make_keys

from inferd.gateway.limits import LimiterUnavailable, TenantLimits
from inferd.gateway.redis_limits import RedisLimiter
from servers import free_port

STEP_MS = 20


def test_redis_down_is_a_503_then_served_again(redis_server, tmp_path, tiny_llama_dir):
    from servers import kill_group, start_server

    keys = make_keys(tmp_path / "keys.json", {"t": {"max_concurrency": 4}})
    server = start_server(tiny_llama_dir, tmp_path / "serve.log", "--echo", "--max-model-len", "256",
                          "--heartbeat-interval", "0.1", "--keys", str(tmp_path / "keys.json"), "--redis",
                          redis_server.url, model_name="tiny",
                          env={"INFERD_FAULT": f"action=slow,times=0,ms={STEP_MS}"})
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
