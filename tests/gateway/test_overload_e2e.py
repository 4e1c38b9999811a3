"""The overload contract: offered load far above capacity for ~8 s. Every response is 200, 429 or 503; every 429 and
503 but request_too_large carries Retry-After; the line never exceeds its bounds; every request that got a 200
completes (all its tokens, or for a stream whose headers went out while it waited, an in-band queue error)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from gw import bearer, make_keys

from servers import sse_data

MAX_QUEUE_REQUESTS, MAX_QUEUE_TOKENS = 8, 1500
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def overloaded(serve, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    keys = make_keys(path, {"heavy": {}, "capped": {"rpm": 30}, "small": {"tpm": 60}, "vip": {"tier": "interactive"},
                            "bulk": {"tier": "batch"}})
    server = serve("--keys", str(path), "--rate-window", "5", "--max-num-seqs", "1", "--worker-queue-depth", "0",
                   "--max-queue-requests", str(MAX_QUEUE_REQUESTS), "--max-queue-tokens", str(MAX_QUEUE_TOKENS),
                   "--queue-timeout", "1.5", "--sse-keepalive", "0.3", name="overload")
    return server, keys


async def one_request(client: httpx.AsyncClient, server, keys, rng: random.Random) -> dict:
    tenant = rng.choice(["heavy", "heavy", "capped", "small", "vip", "bulk"])
    max_tokens = rng.randint(100, 200) if tenant != "small" else rng.choice([5, 100])
    stream = rng.random() < 0.4
    body = {"prompt": [9] * rng.randint(5, 30), "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with client.stream("POST", server.url + "/v1/completions", headers=bearer(keys[tenant]), json=body) as r:
        raw = [line async for line in r.aiter_lines() if line]
    return {"tenant": tenant, "status": r.status_code, "headers": r.headers, "stream": stream,
            "max_tokens": max_tokens, "lines": raw}


def check(result: dict) -> str:
    """Checks one response against the contract; returns its outcome."""
    status, headers, lines = result["status"], result["headers"], result["lines"]
    assert status in (200, 429, 503), (status, lines)
    if status != 200:
        error = json.loads("".join(lines))["error"]
        too_large = error["code"] == "request_too_large"
        assert too_large or int(headers["Retry-After"]) >= 1, error
        assert (status, error["code"]) in {(429, "rate_limit_exceeded"), (429, "request_too_large"),
                                           (429, "queue_share_exceeded"), (503, "overloaded"),
                                           (503, "queue_timeout")}, error
        return error["code"]
    if not result["stream"]:
        body = json.loads("".join(lines))
        assert body["usage"]["completion_tokens"] == result["max_tokens"]  # echo: every token, to max_tokens
        assert body["choices"][0]["finish_reason"] == "length"
        return "ok"
    events = sse_data(lines)
    assert events[-1] == "[DONE]", lines[-3:]
    events = events[:-1]
    if "error" in events[-1]:  # headers went out while it waited: it never reached a worker
        assert events[-1]["error"]["code"] in ("queue_timeout", "overloaded"), events[-1]
        assert all("error" in e for e in events)
        return "stream_" + events[-1]["error"]["code"]
    assert events[-1]["usage"]["completion_tokens"] == result["max_tokens"]
    return "ok"


def test_far_above_capacity_every_answer_keeps_the_contract(overloaded):
    server, keys = overloaded

    async def drive(seconds: float, clients: int = 64):
        rng = random.Random(11)
        results = []
        deadline = time.monotonic() + seconds

        async def loop(client):
            while time.monotonic() < deadline:
                results.append(await one_request(client, server, keys, rng))

        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=clients)) as client:
            await asyncio.gather(*(loop(client) for _ in range(clients)))
        return results

    results = asyncio.run(drive(8.0))
    outcomes: dict[str, int] = {}
    for result in results:
        outcome = check(result)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print("OUTCOMES", outcomes)
    # the load really was far above capacity, and both kinds of refusal happened, each for its own cause (counts,
    # not rates: how many requests fit in 8 s depends on the machine)
    assert outcomes.get("ok", 0) >= 1, outcomes
    assert outcomes.get("overloaded", 0) + outcomes.get("queue_timeout", 0) >= 1, outcomes
    assert outcomes.get("rate_limit_exceeded", 0) >= 1 and outcomes.get("request_too_large", 0) >= 1, outcomes
    m = server.metrics()
    assert 0 < m["inferd_queue_requests_high_water"] <= MAX_QUEUE_REQUESTS
    assert 0 < m["inferd_queue_tokens_high_water"] <= MAX_QUEUE_TOKENS
    # nothing is left behind: the line is empty, every bound request was released
    m = server.wait_metrics(lambda m: sum(v for k, v in m.items() if k.startswith("inferd_queue_requests{")) == 0
                            and m["inferd_queue_tokens"] == 0)
    assert m['inferd_num_requests_running{model="tiny"}'] == 0 or server.wait_metrics(
        lambda m: m['inferd_num_requests_running{model="tiny"}'] == 0)
