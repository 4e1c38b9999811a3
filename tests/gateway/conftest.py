"""Gateway fixtures: `inferd serve` processes, mostly on the echo worker (the gateway is what is tested, the model
does not matter)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def serve(tmp_path_factory, tiny_llama_dir):
    """Starts servers for a module: serve(*args, echo=True) -> Server; all killed at the module's end."""
    from servers import kill_group, start_server

    started = []

    def start(*args: str, echo: bool = True, name: str = "gw"):
        log = tmp_path_factory.mktemp(name) / "serve.log"
        extra = ["--max-model-len", "256", "--heartbeat-interval", "0.1", *(["--echo"] if echo else []), *args]
        server = start_server(tiny_llama_dir, log, *extra, model_name="tiny")
        started.append(server)
        return server

    yield start
    for server in started:
        kill_group(server.proc)
