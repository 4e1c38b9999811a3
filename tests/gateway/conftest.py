"""Gateway fixtures: `inferd serve` processes, mostly on the echo worker (the gateway is what is tested, the model
does not matter)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def serve(tmp_path_factory, tiny_llama_dir):
    """Starts servers for a module: serve(*args, echo=True, env=None) -> Server; all killed at the module's end.
    env: added to the server's environment (INFERD_FAULT reaches its workers). serve.begin(same arguments) ->
    Starting: the process starts now, .ready() waits for it (servers a test needs start side by side)."""
    from servers import begin_server, kill_group

    started = []

    def begin(*args: str, echo: bool = True, name: str = "gw", env: dict[str, str] | None = None):
        log = tmp_path_factory.mktemp(name) / "serve.log"
        extra = ["--max-model-len", "256", "--heartbeat-interval", "0.1", *(["--echo"] if echo else []), *args]
        starting = begin_server(tiny_llama_dir, log, *extra, model_name="tiny", env=env)
        started.append(starting.proc)
        return starting

    def start(*args: str, **kwargs):
        return begin(*args, **kwargs).ready()

    start.begin = begin
    yield start
    for proc in started:
        kill_group(proc)


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server of this test's own (never the session's `redis_url`), to kill and restart on the same port:
    .url, .port, .start(), .stop() (SIGKILL), .pause() / .resume() (SIGSTOP / SIGCONT: alive but silent)."""
    import os
    import signal

    from servers import free_port, kill_redis, start_redis

    class Redis:
        port = free_port()
        url = f"redis://127.0.0.1:{port}/0"
        proc = None

        def start(self):
            self.proc = start_redis(tmp_path, self.port)

        def stop(self):
            kill_redis(self.proc)

        def pause(self):
            os.killpg(self.proc.pid, signal.SIGSTOP)

        def resume(self):
            os.killpg(self.proc.pid, signal.SIGCONT)

    r = Redis()
    r.start()
    yield r
    if r.proc.poll() is None:
        r.resume()
        r.stop()
