"""Helpers of the cluster tests (imported by module name: test modules are not packages here)."""

from __future__ import annotations

import time

import httpx
import torch

CLUSTER_ARGS = ("--max-model-len", "256", "--kv-cache-bytes", "32M", "--heartbeat-interval", "0.1")


def random_prompts(n: int, lengths: tuple[int, int], seed: int = 5, vocab: int = 1000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (int(torch.randint(*lengths, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def versions(server) -> dict:
    """/v1/models' versions: model version -> usable workers."""
    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["versions"]


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not true within {timeout} s"
        time.sleep(0.05)
