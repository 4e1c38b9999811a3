"""Cluster fixtures: `inferd serve --workers N` and `inferd gateway` processes on the tiny Llama (real engines: the
tests compare tokens), prompts, and an undisturbed reference server."""

from __future__ import annotations

import pytest
from cluster_util import CLUSTER_ARGS


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir):
    """Starts servers for a module: cluster(*args, env=None, name=) -> Server; all killed at the module's end.
    cluster.begin(same arguments) -> Starting: the process starts now, .ready() waits for it (two servers a test
    needs start side by side)."""
    from servers import begin_server, kill_group

    started = []

    def begin(*args: str, env: dict | None = None, name: str = "cluster", command: str = "serve", echo=False):
        log = tmp_path_factory.mktemp(name) / "serve.log"
        extra = [*(CLUSTER_ARGS if command == "serve" else ()), *(["--echo"] if echo else []), *args]
        starting = begin_server(tiny_llama_dir, log, *extra, model_name="tiny", env=env, command=command)
        started.append(starting.proc)
        return starting

    def start(*args: str, **kwargs):
        return begin(*args, **kwargs).ready()

    start.begin = begin
    yield start
    for proc in started:
        kill_group(proc)


@pytest.fixture(scope="session")
def reference_server(tmp_path_factory, tiny_llama_dir):
    """One worker, never disturbed: what every request must equal. One for the session (it was one per module: three
    modules use it, and a server start costs seconds): nothing a test does to it changes what it answers, and no test
    stops it."""
    from servers import kill_group, start_server

    server = start_server(tiny_llama_dir, tmp_path_factory.mktemp("reference") / "serve.log", *CLUSTER_ARGS,
                          "--workers", "1", model_name="tiny")
    yield server
    kill_group(server.proc)

