"""`inferd serve --tensor-parallel 2`: each worker runs its model split over two processes (gloo here); the streams
equal one process's (exactness rule; the engine-level comparison is tests/models/test_tensor_parallel.py)."""

from __future__ import annotations

import asyncio
import os

import pytest
from cluster_util import random_prompts
from streams import assert_same_stream, request_body, run_all

pytestmark = pytest.mark.timeout(240)


def test_tensor_parallel_server_equals_one_process(cluster, reference_server):
    server = cluster("--workers", "1", "--tensor-parallel", "2", name="tp2")
    prompts = random_prompts(4, (10, 60), seed=51)
    bodies = [request_body("tiny", p, 30, None if i % 2 == 0 else 500 + i) for i, p in enumerate(prompts)]
    ours = asyncio.run(run_all(server.url, bodies))
    ref = asyncio.run(run_all(reference_server.url, bodies))
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert_same_stream(a, b, bodies[i], len(prompts[i]))
    [worker] = server.worker_pids()
    assert len(children(worker)) == 1  # the worker (rank 0) runs its rank 1 as a child process


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(p) for p in f.read().split()]
    return out
