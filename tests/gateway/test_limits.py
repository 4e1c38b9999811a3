"""The per-tenant limits, both backends through one contract (inferd.gateway.limits.Limiter): InProcessLimiter and
RedisLimiter on a real redis-server (the `redis_url` fixture of tests/conftest.py).

Time runs for real (Redis refills on its own clock), so no test asserts on milliseconds: a level measured after some
elapsed time is checked against [what was left, what was left + rate x elapsed], elapsed measured around the calls.
The exactness tests hammer one tenant from many tasks, and for Redis from two OS processes, and check what was
admitted against capacity + rate x elapsed (elapsed on the limiter's own clock)."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from _hammer import InFlight, hammer

from inferd.gateway.limits import (
    CONCURRENCY,
    REQUESTS,
    TOKENS,
    TOO_LARGE,
    Decision,
    InProcessLimiter,
    TenantLimits,
    format_duration,
)

HAMMER = Path(__file__).with_name("_hammer.py")
EPS = 1e-6  # float slack on exact bounds


@pytest.fixture(params=["memory", "redis"])
def make_limiter(request):
    """A factory of limiters of one backend: make_limiter(window) (created inside the test's event loop)."""
    if request.param == "memory":
        return lambda window=60.0, **kw: InProcessLimiter(window=window)
    from inferd.gateway.redis_limits import RedisLimiter

    url = request.getfixturevalue("redis_url")
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    return lambda window=60.0, **kw: RedisLimiter(url, window=window, prefix=prefix, **kw)


def run(make_limiter, body, window: float = 60.0, **kw):
    """asyncio.run(body(limiter)) on a fresh limiter, closed at the end."""
    async def main():
        limiter = make_limiter(window, **kw)
        try:
            return await body(limiter)
        finally:
            await limiter.close()
    return asyncio.run(main())


def new_tenant() -> str:
    return f"tenant-{uuid.uuid4().hex[:12]}"


def lease() -> str:
    return uuid.uuid4().hex


class Timer:
    """Elapsed time since the block began, until it ended (the widest interval the limiter's clock could have seen
    between calls made inside it)."""

    def __enter__(self):
        self.start, self.end = time.monotonic(), None
        return self

    def __exit__(self, *exc):
        self.end = time.monotonic()

    @property
    def elapsed(self) -> float:
        return (self.end or time.monotonic()) - self.start


# ---- the contract, on both backends --------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_fresh_tenant_gets_full_buckets(make_limiter):
    limits = TenantLimits(rpm=10, tpm=1000, max_concurrency=2)

    async def body(lim):
        t = new_tenant()
        d = await lim.reserve(t, limits, lease(), 100)
        assert d.allowed and d.reason is None and d.retry_after == 0
        assert (d.limit_requests, d.remaining_requests, d.limit_tokens, d.remaining_tokens) == (10, 9, 1000, 900)
        assert d.reset_requests == pytest.approx(6.0)  # 1 request at 10 per 60 s
        assert d.reset_tokens == pytest.approx(6.0)  # 100 tokens at 1000 per 60 s
        # no limits: nothing reported, nothing refused
        free = await lim.reserve(new_tenant(), TenantLimits(), lease(), 10**9)
        assert free.allowed and free.headers() == {}
        assert (free.limit_requests, free.remaining_requests, free.limit_tokens, free.remaining_tokens) == (None,) * 4
        # one limit only: the other is not reported
        only_rpm = await lim.reserve(new_tenant(), TenantLimits(rpm=5), lease(), 10**9)
        assert only_rpm.allowed and only_rpm.remaining_requests == 4
        assert only_rpm.limit_tokens is None and only_rpm.remaining_tokens is None

    run(make_limiter, body)


@pytest.mark.timeout(30)
def test_rpm_refusal(make_limiter):
    limits = TenantLimits(rpm=2, tpm=1000)

    async def body(lim):
        t = new_tenant()
        assert (await lim.reserve(t, limits, lease(), 1)).allowed
        assert (await lim.reserve(t, limits, lease(), 1)).allowed
        d = await lim.reserve(t, limits, lease(), 1)
        assert not d.allowed and d.reason == REQUESTS
        # an empty request bucket at 2 per 60 s: the next request fits in just under 30 s
        assert 25 < d.retry_after <= 30 + EPS
        assert d.remaining_requests == 0 and d.retry_after_header == "30"
        assert d.remaining_tokens >= 998  # the refused reservation took no token

    run(make_limiter, body)


@pytest.mark.timeout(30)
def test_tpm_refusal_retry_after(make_limiter):
    limits = TenantLimits(tpm=1000)
    rate = 1000 / 60

    async def body(lim):
        t = new_tenant()
        with Timer() as timer:
            assert (await lim.reserve(t, limits, lease(), 900)).remaining_tokens == 100
            d = await lim.reserve(t, limits, lease(), 300)
        assert not d.allowed and d.reason == TOKENS
        # level in [100, 100 + rate x elapsed]: retry_after = (300 - level) / rate
        assert (200 - rate * timer.elapsed) / rate - EPS <= d.retry_after <= 200 / rate + EPS
        # and consistent with what the refusal itself reports: level in [remaining, remaining + 1)
        assert (300 - d.remaining_tokens - 1) / rate - EPS <= d.retry_after <= (300 - d.remaining_tokens) / rate + EPS
        assert d.reset_tokens == pytest.approx(d.retry_after + 700 / rate)  # (1000 - level) / rate

    run(make_limiter, body)


@pytest.mark.timeout(30)
def test_too_large_takes_nothing(make_limiter):
    limits = TenantLimits(rpm=10, tpm=1000, max_concurrency=1)

    async def body(lim):
        t = new_tenant()
        d = await lim.reserve(t, limits, lease(), 1001)
        assert not d.allowed and d.reason == TOO_LARGE and d.retry_after == 0
        assert (d.remaining_requests, d.remaining_tokens) == (10, 1000)
        # no request, no token and no concurrency slot was taken: the whole bucket still fits
        d = await lim.reserve(t, limits, lease(), 1000)
        assert d.allowed and (d.remaining_requests, d.remaining_tokens) == (9, 0)

    run(make_limiter, body)


@pytest.mark.timeout(30)
def test_all_or_nothing(make_limiter):
    tok_rate = 1000 / 60

    async def body(lim):
        # refused on tokens: no request taken
        limits = TenantLimits(rpm=10, tpm=1000)
        t = new_tenant()
        assert (await lim.reserve(t, limits, lease(), 900)).remaining_requests == 9
        d = await lim.reserve(t, limits, lease(), 500)
        assert not d.allowed and d.reason == TOKENS and d.remaining_requests == 9
        d = await lim.reserve(t, limits, lease(), 50)
        assert d.allowed and d.remaining_requests == 8  # 10 - 1 - 1: the refused one took nothing

        # refused on requests: no token taken
        limits = TenantLimits(rpm=1, tpm=1000)
        t = new_tenant()
        with Timer() as timer:
            assert (await lim.reserve(t, limits, lease(), 10)).allowed
            d = await lim.reserve(t, limits, lease(), 10)
        assert not d.allowed and d.reason == REQUESTS
        assert 990 <= d.remaining_tokens <= 990 + tok_rate * timer.elapsed

        # refused on concurrency: neither tokens nor requests taken
        limits = TenantLimits(rpm=10, tpm=1000, max_concurrency=1)
        t = new_tenant()
        a = lease()
        with Timer() as timer:
            assert (await lim.reserve(t, limits, a, 100)).allowed
            d = await lim.reserve(t, limits, lease(), 100)
            assert not d.allowed and d.reason == CONCURRENCY and d.retry_after == 1.0
            assert d.remaining_requests == 9 and 900 <= d.remaining_tokens <= 900 + tok_rate * timer.elapsed
            await lim.settle(t, limits, a, 100, 100)
            d = await lim.reserve(t, limits, lease(), 100)
        assert d.allowed and d.remaining_requests == 8
        assert 800 <= d.remaining_tokens <= 800 + tok_rate * timer.elapsed

    run(make_limiter, body)


@pytest.mark.timeout(30)
def test_concurrency_refused_then_released_by_settle(make_limiter):
    limits = TenantLimits(max_concurrency=2)

    async def body(lim):
        t = new_tenant()
        a, b, c = lease(), lease(), lease()
        assert (await lim.reserve(t, limits, a, 1)).allowed
        assert (await lim.reserve(t, limits, b, 1)).allowed
        d = await lim.reserve(t, limits, c, 1)
        assert not d.allowed and d.reason == CONCURRENCY and d.retry_after == 1.0 and d.retry_after_header == "1"
        await lim.settle(t, limits, a, 1, 1)
        assert (await lim.reserve(t, limits, c, 1)).allowed
        assert (await lim.reserve(t, limits, lease(), 1)).reason == CONCURRENCY
        # settling a lease twice (or one never held) frees nothing more
        await lim.settle(t, limits, a, 1, 1)
        await lim.settle(t, limits, "never-held", 1, 1)
        assert (await lim.reserve(t, limits, lease(), 1)).reason == CONCURRENCY
        await lim.settle(t, limits, b, 1, 1)
        await lim.settle(t, limits, c, 1, 1)
        assert (await lim.reserve(t, limits, lease(), 1)).allowed
        # other tenants have their own slots
        assert (await lim.reserve(new_tenant(), limits, lease(), 1)).allowed

    run(make_limiter, body)


@pytest.mark.timeout(30)
def test_refund_of_unused_tokens(make_limiter):
    limits = TenantLimits(tpm=10_000)
    rate = 10_000 / 60
    prompt = 100

    async def body(lim):
        t = new_tenant()
        a = lease()
        with Timer() as timer:
            before = (await lim.reserve(t, limits, a, 500 + prompt)).remaining_tokens
            await lim.settle(t, limits, a, reserved_tokens=500 + prompt, used_tokens=prompt + 20)
            probe = lease()
            after = (await lim.reserve(t, limits, probe, 0)).remaining_tokens
        assert before == 10_000 - 600
        # 480 back, plus what refilled meanwhile (floor on both sides: up to one more)
        assert 480 <= after - before <= 480 + rate * timer.elapsed + 1
        await lim.settle(t, limits, probe, 0, 0)

        # more used than reserved (a longer answer than planned): nothing back, nothing more taken
        b = lease()
        with Timer() as timer:
            before = (await lim.reserve(t, limits, b, 1000)).remaining_tokens
            await lim.settle(t, limits, b, reserved_tokens=1000, used_tokens=1500)
            after = (await lim.reserve(t, limits, lease(), 0)).remaining_tokens
        assert 0 <= after - before <= rate * timer.elapsed + 1

    run(make_limiter, body)


@pytest.mark.timeout(30)
def test_refund_is_capped_at_capacity(make_limiter):
    limits = TenantLimits(tpm=1000)

    async def body(lim):
        t = new_tenant()
        a = lease()
        assert (await lim.reserve(t, limits, a, 100)).remaining_tokens == 900
        await lim.settle(t, limits, a, 100, 0)
        await lim.settle(t, limits, a, 500, 0)  # a refund the bucket has no room for
        d = await lim.reserve(t, limits, lease(), 0)
        assert d.remaining_tokens == 1000 and d.reset_tokens == 0
        assert (await lim.reserve(t, limits, lease(), 1000)).allowed
        d = await lim.reserve(t, limits, lease(), 100)  # 1000, not 1500: the extra refund was dropped
        assert not d.allowed and d.reason == TOKENS

    run(make_limiter, body)


@pytest.mark.timeout(30)
def test_refund_request(make_limiter):
    limits = TenantLimits(rpm=2)

    async def body(lim):
        t = new_tenant()
        a, b = lease(), lease()
        assert (await lim.reserve(t, limits, a, 0)).remaining_requests == 1
        assert (await lim.reserve(t, limits, b, 0)).remaining_requests == 0
        await lim.settle(t, limits, b, 0, 0, refund_request=True)  # refused by the service before any work
        d = await lim.reserve(t, limits, lease(), 0)
        assert d.allowed and d.remaining_requests == 0
        await lim.settle(t, limits, a, 0, 0)  # a request that ran: not given back
        assert (await lim.reserve(t, limits, lease(), 0)).reason == REQUESTS

        # capped at capacity too
        t = new_tenant()
        await lim.settle(t, limits, lease(), 0, 0, refund_request=True)
        assert (await lim.reserve(t, limits, lease(), 0)).remaining_requests == 1

    run(make_limiter, body)


@pytest.mark.timeout(30)
def test_buckets_refill_over_the_window(make_limiter):
    window = 1.0
    limits = TenantLimits(rpm=4, tpm=1000)  # 4 requests and 1000 tokens per second

    async def body(lim):
        t = new_tenant()
        before1 = time.monotonic()
        d = await lim.reserve(t, limits, lease(), 1000)
        after1 = time.monotonic()
        assert d.remaining_tokens == 0 and d.reset_tokens == pytest.approx(1.0)
        await asyncio.sleep(0.3)
        before2 = time.monotonic()
        d = await lim.reserve(t, limits, lease(), 0)
        after2 = time.monotonic()
        # the limiter's clock read somewhere inside each call
        assert math.floor(1000 * (before2 - after1)) - 1 <= d.remaining_tokens <= 1000 * (after2 - before1)
        assert d.reset_tokens == pytest.approx((1000 - d.remaining_tokens) / 1000, abs=0.0011)
        await asyncio.sleep(max(0.0, after2 + window + 0.05 - time.monotonic()))
        d = await lim.reserve(t, limits, lease(), 0)  # a whole window later: full again
        assert d.remaining_tokens == 1000 and d.reset_tokens == 0
        assert d.remaining_requests == 3  # full (4) minus this one

    run(make_limiter, body, window=window)


@pytest.mark.timeout(30)
def test_headers_of_a_real_decision(make_limiter):
    async def body(lim):
        d = await lim.reserve(new_tenant(), TenantLimits(rpm=10, tpm=1000), lease(), 100)
        assert d.headers() == {
            "x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "9",
            "x-ratelimit-reset-requests": "6s",
            "x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "900",
            "x-ratelimit-reset-tokens": "6s",
        }

    run(make_limiter, body)


# ---- Decision and the header formats ---------------------------------------------------------------------------------

def test_decision_headers():
    d = Decision(allowed=True, limit_requests=10, remaining_requests=9, reset_requests=6.0, limit_tokens=1000,
                 remaining_tokens=-3, reset_tokens=0.5)
    assert d.headers() == {
        "x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "6s",
        "x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "0",  # never negative
        "x-ratelimit-reset-tokens": "0.5s",
    }
    assert Decision(allowed=True).headers() == {}
    assert set(Decision(allowed=True, limit_tokens=5, remaining_tokens=5).headers()) == {
        "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"}
    for retry, header in [(0.0, "1"), (0.2, "1"), (1.0, "1"), (1.01, "2"), (29.999, "30"), (30.0, "30")]:
        assert Decision(allowed=False, retry_after=retry).retry_after_header == header


@pytest.mark.parametrize("seconds,text", [(0, "0s"), (-1, "0s"), (0.0004, "0s"), (0.5, "0.5s"), (1, "1s"),
                                          (1.25, "1.25s"), (6.0, "6s"), (59.5, "59.5s"), (60, "1m0s"),
                                          (360, "6m0s"), (61.2, "1m2s"), (3600, "1h0m0s"), (3661, "1h1m1s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


# ---- Redis only --------------------------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_redis_keys_share_a_slot_expire_and_dead_leases_free_their_slot(redis_url):
    import redis
    from redis.crc import key_slot

    from inferd.gateway.redis_limits import RedisLimiter

    prefix, tenant = f"test-{uuid.uuid4().hex[:8]}", new_tenant()
    limits = TenantLimits(rpm=10, tpm=1000, max_concurrency=1)
    keys = [f"{prefix}:{{{tenant}}}:{kind}" for kind in ("req", "tok", "leases")]
    assert len({key_slot(k.encode()) for k in keys}) == 1

    async def body():
        lim = RedisLimiter(redis_url, window=2.0, lease_s=0.3, prefix=prefix)
        try:
            await lim.ping()
            assert (await lim.reserve(tenant, limits, "dead-gateway", 10)).allowed  # never settled
            client = redis.Redis.from_url(redis_url)
            try:
                assert 0 < client.pttl(keys[0]) <= 4000 and 0 < client.pttl(keys[1]) <= 4000  # 2 x window
                assert 0 < client.pttl(keys[2]) <= 1300  # lease_s + 1 s
                assert client.zrange(keys[2], 0, -1) == [b"dead-gateway"]
                expires_us = client.zscore(keys[2], "dead-gateway")
                assert (await lim.reserve(tenant, limits, lease(), 10)).reason == CONCURRENCY
                # until the lease's expiry on Redis' clock (the one the script prunes by), its slot stays taken
                while _redis_now_us(client) <= expires_us:
                    await asyncio.sleep(0.01)
            finally:
                client.close()
            assert (await lim.reserve(tenant, limits, lease(), 10)).allowed  # the expired lease was pruned
            with pytest.raises(ValueError):
                await lim.reserve(tenant, TenantLimits(rpm=0), lease(), 1)
        finally:
            await lim.close()

    asyncio.run(body())


@pytest.mark.timeout(30)
def test_redis_ping_fails_clearly():
    from inferd.gateway.redis_limits import RedisLimiter, RedisUnavailable

    async def body():
        lim = RedisLimiter("redis://user:s3cret@127.0.0.1:1/0")  # port 1: nothing listens there
        try:
            with pytest.raises(RedisUnavailable) as info:
                await lim.ping()
        finally:
            await lim.close()
        assert "127.0.0.1:1" in str(info.value) and "s3cret" not in str(info.value)

    asyncio.run(body())


# ---- exactness under contention ------------------------------------------------------------------------------------

def check_bounds(result: dict, limits: TenantLimits, window: float, elapsed: float, binding: str) -> None:
    """Admitted <= capacity + rate x elapsed for every limit, exactly; and the binding limit was used well (a limiter
    that admits nothing, or far too little, fails too)."""
    for kind, cap in (("requests", limits.rpm), ("tokens", limits.tpm)):
        bound = cap + cap / window * elapsed
        assert result[kind] <= bound + EPS, f"{kind}: {result[kind]} admitted > {bound:.1f} ({result})"
        if kind == binding:
            assert result[kind] > cap / 2, f"{kind}: only {result[kind]} admitted (bound {bound:.1f}; {result})"
    if limits.max_concurrency is not None:
        assert 1 <= result["peak_in_flight"] <= limits.max_concurrency, result


@pytest.mark.timeout(30)
def test_in_process_exact_under_concurrency():
    window, seconds = 2.0, 2.0
    phases = [("tokens", TenantLimits(rpm=600, tpm=3000)),
              ("requests", TenantLimits(rpm=60, tpm=1_000_000, max_concurrency=4))]

    async def body():
        lim = InProcessLimiter(window=window)
        for binding, limits in phases:
            start = time.monotonic()
            result = await hammer(lim, new_tenant(), limits, seconds, tasks=16, seed=1, in_flight=InFlight())
            check_bounds(result, limits, window, time.monotonic() - start, binding)

    asyncio.run(body())


def _redis_time(client) -> float:
    sec, usec = client.time()
    return sec + usec / 1e6


def _redis_now_us(client) -> int:
    """Redis' TIME as the limiter's scripts compute `now`: integer microseconds."""
    sec, usec = client.time()
    return sec * 1_000_000 + usec


@pytest.mark.timeout(90)
def test_redis_exact_across_two_processes(redis_url, tmp_path):
    """Two OS processes, 8 tasks each, share one tenant's limits: what they admitted together stays within capacity
    + rate x elapsed on Redis' clock. One phase binds on tokens, the other on requests (with a concurrency limit)."""
    import redis

    window, seconds, tasks = 2.0, 2.5, 8
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    phases = [("tokens", TenantLimits(rpm=600, tpm=3000)),
              ("requests", TenantLimits(rpm=60, tpm=1_000_000, max_concurrency=4))]
    logs = [tmp_path / f"hammer{i}.log" for i in range(2)]
    procs = []
    for log in logs:
        with open(log, "wb") as err:
            procs.append(subprocess.Popen([sys.executable, str(HAMMER), redis_url, prefix, str(window)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True))
    client = redis.Redis.from_url(redis_url)

    def read(i: int, p: subprocess.Popen) -> dict:
        line = p.stdout.readline()
        assert line, f"hammer {i} ended: {logs[i].read_text(errors='replace')}"
        return json.loads(line)

    try:
        for i, p in enumerate(procs):  # both imported, connected and waiting for the word
            assert read(i, p) == {"ready": True}
        for n, (binding, limits) in enumerate(phases):
            tenant = new_tenant()
            phase = {"tenant": tenant, "limits": limits.__dict__, "seconds": seconds, "tasks": tasks,
                     "in_flight_key": f"{prefix}:{tenant}:in-flight"}
            start = _redis_time(client)
            for i, p in enumerate(procs):
                p.stdin.write(json.dumps({**phase, "seed": 10 * n + i}) + "\n")
                p.stdin.flush()
            results = [read(i, p) for i, p in enumerate(procs)]
            elapsed = _redis_time(client) - start
            both = {kind: sum(r[kind] for r in results) for kind in ("requests", "tokens")}
            # each process saw the shared counter's value after its own increments: the max is the global peak
            both["peak_in_flight"] = max(r["peak_in_flight"] for r in results)
            assert all(r["requests"] > 0 for r in results), results  # both processes really took part
            assert sum(r["refused"].get(binding, 0) for r in results) > 0, results  # the limit was reached
            check_bounds(both, limits, window, elapsed, binding)
        for p in procs:
            p.stdin.close()
            assert p.wait(timeout=20) == 0, logs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        client.close()
