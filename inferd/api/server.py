"""`inferd serve`: the API process. Binds the socket first (port 0 = a free one), starts uvicorn at once (so that
/health answers and /ready says why it is not ready yet), starts and supervises the worker process that runs the
model, loads the tokenizer meanwhile, and prints `READY http://HOST:PORT` when a request would be served.

SIGTERM/SIGINT: uvicorn stops taking connections and finishes open responses; then the worker is shut down.
A worker that cannot start at all (bad model path, ...) ends the server with exit code 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass

from ..config import DEFAULT_HEARTBEAT_TIMEOUT, MAX_REQUEST_BODY_BYTES

log = logging.getLogger("inferd.api")


@dataclass
class ServeOptions:
    host: str
    port: int
    model_path: str  # resolved: a HF folder or a .gguf file
    served_model_name: str
    worker_args: list[str]  # passed to `inferd worker`
    api_key: str | None = None
    max_body_bytes: int = MAX_REQUEST_BODY_BYTES
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    shutdown_grace: float = 5.0
    log_level: str = "info"


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def run_server(opts: ServeOptions) -> int:
    logging.basicConfig(level=getattr(logging, opts.log_level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        sock = bind_socket(opts.host, opts.port)
    except OSError as e:
        print(f"error: cannot listen on {opts.host}:{opts.port}: {e}", file=sys.stderr)
        return 1
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:  # uvloop is optional: asyncio's own loop works, slower
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_serve(opts, sock))


async def _serve(opts: ServeOptions, sock: socket.socket) -> int:
    import uvicorn

    from ..cluster.supervisor import LocalWorker
    from ..gateway.router import Router
    from ..telemetry.metrics import Metrics
    from .app import ServerState, build_app

    router = Router()
    metrics = Metrics(opts.served_model_name, router.latest_stats)
    state = ServerState(router, metrics, opts.served_model_name, opts.api_key, opts.max_body_bytes)
    app = build_app(state)

    def hook_metrics(client) -> None:
        client.on_step = lambda seconds, _n: metrics.step_time.observe(seconds)

    worker = LocalWorker(opts.worker_args, router, heartbeat_timeout=opts.heartbeat_timeout, on_attach=hook_metrics)
    config = uvicorn.Config(app, log_level="warning", access_log=False, http="httptools", lifespan="off",
                            timeout_graceful_shutdown=opts.shutdown_grace)
    server = _server_class()(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    host, port = sock.getsockname()[:2]
    starting = asyncio.gather(worker.start(), _load_serving(state, opts))
    await asyncio.wait({starting, serving}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # stopped by a signal while loading
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await worker.stop()
        return 0
    if starting.exception() is not None:
        error = starting.exception()
        print(f"error: the server could not start: {error}", file=sys.stderr)
        server.should_exit = True
        await serving
        await worker.stop()
        return 1
    supervision = asyncio.create_task(worker.supervise())
    shown = f"[{host}]" if ":" in host else host
    print(f"READY http://{shown}:{port}", flush=True)
    log.info("serving %s on http://%s:%d (API key %s)", opts.served_model_name, shown, port,
             "required" if opts.api_key else "not required")
    await serving  # until SIGTERM/SIGINT
    supervision.cancel()
    await worker.stop(grace_period=0.0)
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, with signals handled on the event loop and not re-raised after the shutdown (uvicorn
        re-raises them, which would kill this process before it stops its worker)."""

        @contextlib.contextmanager
        def capture_signals(self):
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._on_signal, sig)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

        def _on_signal(self, sig: int) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: do not wait for open streams
            self.should_exit = True

    return Server


async def _load_serving(state, opts: ServeOptions) -> None:
    from ..models.tokenizer import load_tokenizer
    from .serving import OpenAIServing

    tokenizer = await asyncio.to_thread(load_tokenizer, opts.model_path)
    state.serving = OpenAIServing(state.router, tokenizer, opts.served_model_name, state.metrics)


def default_served_name(model_path: str) -> str:
    name = os.path.basename(os.path.normpath(model_path))
    return name[:-5] if name.endswith(".gguf") else name
