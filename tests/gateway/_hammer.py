"""Hammers one tenant's limits with many concurrent reservations, for the exactness tests of tests/gateway.

As a process (`python tests/gateway/_hammer.py REDIS_URL PREFIX WINDOW`): connects a RedisLimiter, prints
{"ready": true}, then for each line `{"tenant": ..., "limits": {...}, "seconds": ..., ...}` read on stdin runs one
phase and prints its result as one JSON line; ends at EOF. Starting each phase on the parent's word lets the test time
the phase on Redis' clock without counting this process's start-up (imports take seconds).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from collections import Counter

from inferd.gateway.limits import TenantLimits


class InFlight:
    """Counts admitted-but-not-settled reservations, across processes when given a Redis client: incremented after
    an admission and decremented before its settle, so it can never exceed the slots really held."""

    def __init__(self, client=None, key: str = ""):
        self.client, self.key, self.local, self.peak = client, key, 0, 0

    async def enter(self) -> None:
        if self.client is None:
            self.local += 1
            now = self.local
        else:
            now = await self.client.incr(self.key)
        self.peak = max(self.peak, now)

    async def leave(self) -> None:
        if self.client is None:
            self.local -= 1
        else:
            await self.client.decr(self.key)


async def hammer(limiter, tenant: str, limits: TenantLimits, seconds: float, tasks: int, seed: int,
                 in_flight: InFlight, max_tokens: int = 200, hold_s: float = 0.02) -> dict:
    """`tasks` tasks reserve random 1..max_tokens tokens as fast as they are admitted, for `seconds`; each admitted
    reservation is held up to hold_s, then settled with every token used (no refund). Returns what was admitted."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    admitted = {"requests": 0, "tokens": 0}
    refused: Counter[str] = Counter()

    async def one(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        attempt = 0
        while loop.time() < end:
            attempt += 1
            tokens = rng.randint(1, max_tokens)
            lease = f"{os.getpid()}-{i}-{attempt}"
            d = await limiter.reserve(tenant, limits, lease, tokens)
            if d.allowed:
                admitted["requests"] += 1
                admitted["tokens"] += tokens
                await in_flight.enter()
                await asyncio.sleep(rng.uniform(0, hold_s))
                await in_flight.leave()
                await limiter.settle(tenant, limits, lease, tokens, tokens)
            else:
                refused[d.reason] += 1
                await asyncio.sleep(rng.uniform(0, 0.005))  # retry soon: keep the bucket under pressure

    await asyncio.gather(*(one(i) for i in range(tasks)))
    return {**admitted, "refused": dict(refused), "peak_in_flight": in_flight.peak}


async def _main(url: str, prefix: str, window: float) -> None:
    import redis.asyncio as aioredis

    from inferd.gateway.redis_limits import RedisLimiter

    client = aioredis.Redis.from_url(url, decode_responses=True)
    limiter = RedisLimiter(url, window=window, prefix=prefix)
    await limiter.ping()
    print(json.dumps({"ready": True}), flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        phase = json.loads(line)
        result = await hammer(limiter, phase["tenant"], TenantLimits(**phase["limits"]), phase["seconds"],
                              phase["tasks"], phase["seed"], InFlight(client, phase["in_flight_key"]))
        print(json.dumps(result), flush=True)
    await limiter.close()
    await client.aclose()


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
