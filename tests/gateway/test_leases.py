"""Concurrency leases in Redis (issue 13, part 4): short, renewed by the gateway's LeaseKeeper while a request runs,
so that a live request keeps its slot past the lease while a dead gateway's (a process killed with SIGKILL) comes back
within seconds; a Redis that is dead or silent fails every call with LimiterUnavailable within the socket timeout
(never a hang, never the host in the message), the keeper lives on, and both serve again once Redis is back.

Every wait is on a condition: the lease's life is read on Redis' own clock (TIME), the clock its expiry uses."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from inferd.config import REDIS_LEASE_RENEW_S, REDIS_LEASE_S
from inferd.gateway.leases import LeaseKeeper
from inferd.gateway.limits import InProcessLimiter, LimiterUnavailable, TenantLimits
from inferd.gateway.redis_limits import RedisLimiter

LEASE_S = 1.5  # renewed every LEASE_S / 10: a live lease survives a stall of the test's loop of up to 1.35 s
ROOT = Path(__file__).resolve().parents[2]


def _unique(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:8]}"


async def _redis_now(lim: RedisLimiter) -> float:
    seconds, micros = await lim._redis.time()
    return seconds + micros / 1e6


async def _until(condition, what: str, timeout: float = 30.0) -> None:
    """Polls an async condition until it holds; fails the test after `timeout` (a bound, not a timing assert)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, f"never: {what}"
        await asyncio.sleep(0.05)


async def _slot_free(lim: RedisLimiter, tenant: str, limits: TenantLimits, lease_id: str) -> bool:
    return (await lim.reserve(tenant, limits, lease_id, 0)).allowed


def test_a_kept_lease_outlives_its_ttl_and_a_discarded_one_runs_out(redis_url):
    tenant, other_tenant, limits = _unique("t"), _unique("t"), TenantLimits(max_concurrency=1)

    async def body():
        lim = RedisLimiter(redis_url, lease_s=LEASE_S, prefix=_unique("test"))
        keeper = LeaseKeeper(lim, period=LEASE_S / 10)
        try:
            assert (await lim.reserve(tenant, limits, "live", 0)).allowed
            assert (await lim.reserve(other_tenant, limits, "live-2", 0)).allowed  # renewed in the same pipeline
            taken = await _redis_now(lim)
            keeper.add(tenant, "live")
            keeper.add(other_tenant, "live-2")
            keeper.start()

            async def past_twice_the_lease():
                return await _redis_now(lim) > taken + 2 * LEASE_S
            await _until(past_twice_the_lease, "Redis' clock passed twice the lease")
            # the lease would have expired twice over: renewed, it still holds the tenant's only slot
            for t in (tenant, other_tenant):
                assert (await lim.reserve(t, limits, "other", 0)).reason == "concurrency"
            assert keeper.renewals >= 1 and keeper.failures == 0
            # a request whose settlement was lost: no longer renewed, its lease runs out and the slot comes back
            keeper.discard("live")
            assert len(keeper) == 1  # the other tenant's request still runs
            await _until(lambda: _slot_free(lim, tenant, limits, "after"), "the discarded lease expired")
            # a settled lease is not brought back by a renewal that comes late
            await lim.settle(tenant, limits, "after", 0, 0)
            await lim.renew([(tenant, "after")])
            assert (await lim.reserve(tenant, limits, "again", 0)).allowed
        finally:
            keeper.stop()
            await lim.close()

    asyncio.run(body())


_GATEWAY = """
import asyncio, sys
from inferd.config import REDIS_LEASE_RENEW_S, REDIS_LEASE_S
from inferd.gateway.leases import LeaseKeeper
from inferd.gateway.limits import TenantLimits
from inferd.gateway.redis_limits import RedisLimiter

async def main(url, prefix, tenant, lease_s):
    lim = RedisLimiter(url, lease_s=lease_s, prefix=prefix)
    assert (await lim.reserve(tenant, TenantLimits(max_concurrency=1), "gateway-lease", 0)).allowed
    keeper = LeaseKeeper(lim, period=lease_s / 10)
    keeper.add(tenant, "gateway-lease")
    keeper.start()
    print("held", flush=True)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
"""


def test_the_slot_of_a_gateway_killed_with_sigkill_comes_back_within_its_lease(redis_url):
    tenant, prefix, limits = _unique("t"), _unique("test"), TenantLimits(max_concurrency=1)
    gateway = subprocess.Popen([sys.executable, "-c", _GATEWAY, redis_url, prefix, tenant, str(LEASE_S)],
                               stdout=subprocess.PIPE, text=True, cwd=ROOT)

    async def body():
        lim = RedisLimiter(redis_url, lease_s=LEASE_S, prefix=prefix)
        try:
            assert await asyncio.to_thread(gateway.stdout.readline) == "held\n", "the gateway process failed"
            held = await _redis_now(lim)

            async def past_twice_the_lease():
                return await _redis_now(lim) > held + 2 * LEASE_S
            await _until(past_twice_the_lease, "Redis' clock passed twice the lease")
            # the other process renews its lease: its slot is still taken
            assert (await lim.reserve(tenant, limits, "mine", 0)).reason == "concurrency"
            gateway.kill()  # SIGKILL: no settlement, no goodbye
            await asyncio.to_thread(gateway.wait)
            killed = await _redis_now(lim)
            # its last renewal set the lease to run out within one lease of its death (not in an hour) ...
            expiry_us = await lim._redis.zscore(lim._keys(tenant)[2], "gateway-lease")
            assert expiry_us is not None and expiry_us / 1e6 <= killed + LEASE_S
            # ... and then the slot is given to someone else
            await _until(lambda: _slot_free(lim, tenant, limits, "mine"), "the dead gateway's slot came back")
        finally:
            await lim.close()

    try:
        asyncio.run(body())
    finally:
        gateway.kill()
        gateway.wait(timeout=10)


def test_a_dead_or_silent_redis_is_limiter_unavailable_and_the_keeper_lives_on(redis_server):
    tenant, limits = _unique("t"), TenantLimits(rpm=100, tpm=1000, max_concurrency=2)

    def no_host(error: LimiterUnavailable) -> None:
        assert error.retry_after >= 1
        assert "127.0.0.1" not in str(error) and str(redis_server.port) not in str(error)

    async def body():
        lim = RedisLimiter(redis_server.url, lease_s=LEASE_S, prefix=_unique("test"))
        keeper = LeaseKeeper(lim, period=LEASE_S / 10)
        try:
            assert (await lim.reserve(tenant, limits, "a", 10)).allowed
            keeper.add(tenant, "a")
            keeper.start()

            async def renewed_once_more():
                return keeper.renewals > renewals
            renewals = 0
            await _until(renewed_once_more, "the keeper renewed")

            # silent (SIGSTOP: the socket is open, nothing answers): the call fails within the socket timeout; the
            # outer bound only turns a hang into a failure of this test
            redis_server.pause()
            with pytest.raises(LimiterUnavailable) as e:
                await asyncio.wait_for(lim.reserve(tenant, limits, "b", 10), 60)
            no_host(e.value)
            redis_server.resume()
            assert (await lim.reserve(tenant, limits, "b", 10)).allowed

            # dead (SIGKILL): every call of the interface fails the same way, and the keeper keeps trying
            redis_server.stop()
            for call in (lim.reserve(tenant, limits, "c", 10), lim.settle(tenant, limits, "b", 10, 5),
                         lim.renew([(tenant, "a")])):
                with pytest.raises(LimiterUnavailable) as e:
                    await asyncio.wait_for(call, 60)
                no_host(e.value)

            async def failed_once_more():
                return keeper.failures > failures
            failures = keeper.failures
            await _until(failed_once_more, "the keeper's renewal failed while Redis was down")
            assert keeper.running

            # back (empty: no persistence): the same client and the same keeper serve again
            redis_server.start()
            renewals = keeper.renewals
            await _until(renewed_once_more, "the keeper renewed after Redis came back")
            assert (await lim.reserve(tenant, limits, "d", 10)).allowed
        finally:
            keeper.stop()
            await lim.close()

    asyncio.run(body())


def test_the_keeper_renews_well_within_the_lease():
    async def body():
        for lease_s, default_period in ((REDIS_LEASE_S, REDIS_LEASE_RENEW_S), (0.3, 0.1)):
            lim = RedisLimiter("redis://127.0.0.1:1/0", lease_s=lease_s)  # never connected: construction only
            try:
                # by default: REDIS_LEASE_RENEW_S, or a third of a shorter lease (a test's)
                assert LeaseKeeper(lim).period == pytest.approx(default_period)
                assert LeaseKeeper(lim, period=lease_s / 2).period == lease_s / 2
                with pytest.raises(ValueError, match="half the lease"):  # one lost renewal would cost the slot
                    LeaseKeeper(lim, period=lease_s * 0.6)
            finally:
                await lim.close()
        with pytest.raises(ValueError):
            LeaseKeeper(InProcessLimiter(), period=0)
        keeper = LeaseKeeper(InProcessLimiter())  # in process: leases never expire, renew is a no-op
        assert keeper.period == REDIS_LEASE_RENEW_S
        keeper.add("t", "x")
        assert await keeper.renew_now() and keeper.renewals == 1

    asyncio.run(body())


def test_a_server_renews_the_lease_of_a_request_that_runs_past_it(redis_url, tmp_path, tiny_llama_dir):
    """`inferd serve --redis --redis-lease 1.5`: a stream that runs over twice its lease keeps its tenant's only slot
    (the gateway renews it: another request of the tenant is refused for concurrency); once it ends, the slot is
    free at once."""
    import httpx
    import redis
    from gw import bearer, make_keys

    from servers import kill_group, start_server

    keys = make_keys(tmp_path / "keys.json", {"t": {"max_concurrency": 1}})
    server = start_server(tiny_llama_dir, tmp_path / "serve.log", "--echo", "--max-model-len", "2048",
                          "--heartbeat-interval", "0.1", "--keys", str(tmp_path / "keys.json"), "--redis",
                          redis_url, "--redis-lease", str(LEASE_S), model_name="tiny",
                          env={"INFERD_FAULT": "action=slow,times=0,ms=20"})  # 1,500 tokens: 30 s or more
    clock = redis.Redis.from_url(redis_url)

    def redis_now() -> float:
        seconds, micros = clock.time()
        return seconds + micros / 1e6

    def post() -> httpx.Response:
        return httpx.post(server.url + "/v1/completions", headers=bearer(keys["t"]), timeout=60,
                          json={"model": server.model, "prompt": "a b c", "max_tokens": 4})

    try:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", server.url + "/v1/completions", headers=bearer(keys["t"]),
                               json={"model": server.model, "prompt": "a b c", "max_tokens": 1500,
                                     "stream": True}) as running:
                assert running.status_code == 200
                lines = running.iter_lines()
                next(lines)  # it runs
                started = redis_now()
                while redis_now() < started + 2 * LEASE_S:
                    next(lines)  # keep reading (no slow reader), until the lease would have run out twice
                refused = post()
                assert refused.status_code == 429, refused.text
                assert "concurrent requests" in refused.json()["error"]["message"]
                assert server.metrics().get("inferd_gateway_open_requests") == 1  # the stream still runs
            # the stream was dropped: its slot comes back (released by the gateway, not by the lease)
        server.wait_metrics(lambda m: m.get("inferd_gateway_open_requests") == 0
                            and m.get("inferd_gateway_settlements_pending", 0) == 0)
        assert post().status_code == 200
    finally:
        clock.close()
        kill_group(server.proc)
