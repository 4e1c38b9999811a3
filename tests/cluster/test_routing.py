"""Routing with 2 workers: requests that share a long system prompt land on the worker that holds it (the workers'
prefix-cache hit counters and the router's affinity counters report it); with no shared prefix the load splits
evenly. /v1/models lists versions, /ready and /metrics cover every worker."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from cluster_util import random_prompts

pytestmark = pytest.mark.timeout(240)

SLOW = {"INFERD_FAULT": "action=slow,ms=20,times=0"}  # requests stay in flight while the others are routed


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=40), timeout=120) as client:
        return await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in bodies))


@pytest.fixture(scope="module")
def two_workers(cluster):
    return cluster("--workers", "2", "--threads", "1", env=SLOW, name="routing")


def test_a_shared_system_prompt_goes_where_it_is_cached(two_workers):
    server = two_workers
    system = random_prompts(1, (128, 129), seed=31)[0]  # 8 full KV blocks
    tails = random_prompts(10, (5, 20), seed=32)
    first = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": system + tails[0], "max_tokens": 2})
    holder = first.headers["x-inferd-worker"]
    before = server.metrics()
    responses = asyncio.run(post_all(server.url, [{"model": "tiny", "prompt": system + t, "max_tokens": 2}
                                                  for t in tails[1:]]))
    assert [r.status_code for r in responses] == [200] * 9
    assert {r.headers["x-inferd-worker"] for r in responses} == {holder}
    # every later request found the whole system prompt cached (its own usage says so: exact, whatever came before)
    assert [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses] == [128] * 9
    # the router's counter is the gateway's own: exact at once
    after = server.metrics()
    assert after["inferd_router_prefix_affinity_hits_total"] - before["inferd_router_prefix_affinity_hits_total"] \
        == 9
    # the worker's hit counter arrives with its heartbeats (`before` may predate some: never ahead), so wait for the
    # one that carries all 9 requests' hits
    hit = f'inferd_worker_prefix_cache_hit_tokens_total{{worker="{holder}"}}'
    server.wait_metrics(lambda m: m.get(hit, 0) - before.get(hit, 0) >= 9 * 128)


def test_without_a_shared_prefix_the_load_splits_evenly(two_workers):
    server = two_workers
    prompts = random_prompts(16, (20, 40), seed=33)
    responses = asyncio.run(post_all(server.url, [{"model": "tiny", "prompt": p, "max_tokens": 20}
                                                  for p in prompts]))
    assert [r.status_code for r in responses] == [200] * 16
    placed = [r.headers["x-inferd-worker"] for r in responses]
    assert sorted(placed.count(w) for w in set(placed)) == [8, 8], placed


def test_models_ready_and_metrics_cover_every_worker(two_workers):
    server = two_workers
    # its own traffic on both workers (it does not rely on the tests before it): two concurrent requests split (each
    # is in flight for 16+ slowed steps: the second is routed while the first still counts as the load of its worker)
    responses = asyncio.run(post_all(server.url, [{"model": "tiny", "prompt": p, "max_tokens": 16}
                                                  for p in random_prompts(2, (20, 40), seed=34)]))
    assert {r.headers["x-inferd-worker"] for r in responses} == {"worker-0", "worker-1"}
    card = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    assert card["versions"] == {"v1": 2}
    assert httpx.get(server.url + "/ready", timeout=10).status_code == 200
    m = server.metrics()
    assert m['inferd_worker_up{version="v1",worker="worker-0"}'] == 1.0
    assert m['inferd_worker_up{version="v1",worker="worker-1"}'] == 1.0
    # every engine step's roofline accounting (the requests above ran steps on both workers)
    assert m["inferd_engine_bytes_read_total"] > 0 and m["inferd_engine_flops_total"] > 0
    steps = m["inferd_step_bandwidth_utilization_count"]
    assert steps > 0 and m["inferd_step_flops_utilization_count"] == steps
    assert 0 < m["inferd_step_bandwidth_utilization_sum"] / steps < 2  # a mean MBU; over 1 = a wrong peak
