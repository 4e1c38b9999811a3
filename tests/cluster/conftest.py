"""Cluster fixtures: `inferd serve --workers N` and `inferd gateway` processes on the tiny Llama (real engines: the
tests compare tokens), prompts, and an undisturbed reference server."""

from __future__ import annotations

import pytest
import torch

CLUSTER_ARGS = ("--max-model-len", "256", "--kv-cache-bytes", "32M", "--heartbeat-interval", "0.1")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir):
    """Starts servers for a module: cluster(*args, env=None, name=) -> Server; all killed at the module's end."""
    from servers import kill_group, start_server

    started = []

    def start(*args: str, env: dict | None = None, name: str = "cluster", command: str = "serve", echo=False):
        log = tmp_path_factory.mktemp(name) / "serve.log"
        extra = [*(CLUSTER_ARGS if command == "serve" else ()), *(["--echo"] if echo else []), *args]
        server = start_server(tiny_llama_dir, log, *extra, model_name="tiny", env=env, command=command)
        started.append(server)
        return server

    yield start
    for server in started:
        kill_group(server.proc)


@pytest.fixture(scope="module")
def reference_server(cluster):
    """One worker, never disturbed: what every request must equal."""
    return cluster("--workers", "1", name="reference")


def random_prompts(n: int, lengths: tuple[int, int], seed: int = 5, vocab: int = 1000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (int(torch.randint(*lengths, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]
