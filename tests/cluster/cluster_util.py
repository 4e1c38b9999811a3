"""Helpers of the cluster tests (imported by module name: test modules are not packages here)."""

from __future__ import annotations

import torch

CLUSTER_ARGS = ("--max-model-len", "256", "--kv-cache-bytes", "32M", "--heartbeat-interval", "0.1")


def random_prompts(n: int, lengths: tuple[int, int], seed: int = 5, vocab: int = 1000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (int(torch.randint(*lengths, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]
