"""Exact limits through real servers: hammered concurrently, a tenant is admitted no more than capacity + refill rate x
elapsed time, in tokens (TPM) and in requests (RPM), counted from the 200 responses' usage. Two `inferd serve`
processes sharing one Redis enforce one limit; one process with the in-process backend does the same. The lower
bound shows the limit is what stopped the load, not something else: each tenant was refused for its own limit
(tokens, requests), and by then it had been admitted its whole initial bucket (it starts full) but for one request;
no bound depends on how fast the machine is."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from gw import bearer, make_keys

WINDOW = 3.0
TPM, RPM = 3000, 60  # tenant "tok": limited by tokens; tenant "req": by requests
pytestmark = pytest.mark.timeout(240)


async def hammer(urls: list[str], keys: dict[str, str], seconds: float, tasks: int = 32):
    """Tasks alternate servers and tenants; returns ({tenant: [admitted token counts]}, statuses, elapsed)."""
    admitted: dict[str, list[int]] = {"tok": [], "req": []}
    statuses: dict[int, int] = {}
    refused_for: dict[str, set[str]] = {"tok": set(), "req": set()}
    rng = random.Random(7)
    deadline = time.monotonic() + seconds

    async def one(i: int, client: httpx.AsyncClient) -> None:
        n = 0
        while time.monotonic() < deadline:
            tenant = "tok" if (i + n) % 2 else "req"
            max_tokens = rng.randint(10, 60) if tenant == "tok" else 1
            r = await client.post(urls[(i + n) % len(urls)] + "/v1/completions", headers=bearer(keys[tenant]),
                                  json={"prompt": [5] * 10, "max_tokens": max_tokens})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code == 200:
                admitted[tenant].append(r.json()["usage"]["total_tokens"])
            else:
                assert r.status_code == 429, r.text
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
                message = r.json()["error"]["message"]
                refused_for[tenant].add("tokens" if " on tokens " in message else
                                        "requests" if " on requests " in message else message)
                await asyncio.sleep(0.01 * rng.random())  # jitter only: the bound is on what was admitted
            n += 1

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=tasks)) as client:
        await asyncio.gather(*(one(i, client) for i in range(tasks)))
    return (admitted, refused_for), statuses, time.monotonic() - started


MAX_REQUEST_TOKENS = 10 + 60  # prompt + the largest max_tokens "tok" asks for


def check_bounds(admitted_and_refusals, statuses: dict[int, int], elapsed: float) -> None:
    admitted, refused_for = admitted_and_refusals
    token_bound = TPM + TPM / WINDOW * elapsed
    request_bound = RPM + RPM / WINDOW * elapsed
    tokens, requests = sum(admitted["tok"]), len(admitted["req"])
    assert tokens <= token_bound, (tokens, token_bound)
    assert requests <= request_bound, (requests, request_bound)
    # the limit, not the server, held the load back: each tenant was refused for its own limit only, after it had
    # been admitted its initial (full) bucket but for the last request's size
    assert refused_for == {"tok": {"tokens"}, "req": {"requests"}}, refused_for
    assert tokens >= TPM - MAX_REQUEST_TOKENS, (tokens, TPM)
    assert requests >= RPM - 1, (requests, RPM)
    assert statuses.get(429, 0) > 0


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    return path, make_keys(path, {"tok": {"tpm": TPM}, "req": {"rpm": RPM}})


def test_two_servers_sharing_redis_enforce_one_limit(serve, keys_file, redis_url):
    path, keys = keys_file
    args = ("--keys", str(path), "--redis", redis_url, "--rate-window", str(WINDOW), "--max-num-seqs", "64")
    first, second = serve.begin(*args, name="redis-a"), serve.begin(*args, name="redis-b")  # side by side
    first, second = first.ready(), second.ready()
    admitted, statuses, elapsed = asyncio.run(hammer([first.url, second.url], keys, seconds=5.0))
    check_bounds(admitted, statuses, elapsed)
    # both servers admitted work: the limit was shared, not enforced by one of them alone
    served = [s.metrics().get('inferd_gateway_admissions_total{outcome="admitted"}', 0) for s in (first, second)]
    assert min(served) > 0.2 * sum(served), served


def test_one_server_in_process_enforces_its_limit(serve, keys_file):
    path, keys = keys_file
    server = serve("--keys", str(path), "--rate-window", str(WINDOW), "--max-num-seqs", "64", name="memory")
    admitted, statuses, elapsed = asyncio.run(hammer([server.url], keys, seconds=5.0))
    check_bounds(admitted, statuses, elapsed)


def test_redis_unreachable_is_a_clear_start_up_error(tmp_path, tiny_llama_dir):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "inferd", "serve", "--port", "0", "--echo", "--model",
                          str(tiny_llama_dir), "--redis", "redis://127.0.0.1:1/0"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert "Redis" in out.stderr and "redis://127.0.0.1:1/0" in out.stderr
