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
from dataclasses import dataclass, field
from pathlib import Path

from ..config import (
    BATCH_RETENTION_S,
    BATCH_STORAGE_PER_TENANT,
    DEFAULT_AUTOSCALE_WINDOW_S,
    DEFAULT_BATCH_CONCURRENCY,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_HTTP_BODY_TIMEOUT_S,
    DEFAULT_HTTP_IDLE_PER_ADDRESS,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_MAX_QUEUE_REQUESTS,
    DEFAULT_MAX_QUEUE_TOKENS,
    DEFAULT_QUEUE_TIMEOUT_S,
    DEFAULT_RATE_WINDOW_S,
    DEFAULT_REPLAY_TIMEOUT_S,
    DEFAULT_SSE_KEEPALIVE_S,
    DEFAULT_SSE_WRITE_TIMEOUT_S,
    DEFAULT_TENANT_QUEUE_SHARE,
    DEFAULT_TIER_SHARES,
    DEFAULT_WORKER_QUEUE_DEPTH,
    HTTP_KEEP_ALIVE_S,
    KEYS_POLL_S,
    MAX_REQUEST_BODY_BYTES,
    NEW_CONNECTION_IDLE_TIMEOUT_S,
    REDIS_LEASE_S,
)

log = logging.getLogger("inferd.api")


@dataclass
class EmbeddingModelSpec:
    """An embedding model served beside the generation model (--embedding-model)."""
    path: str  # its folder or .gguf (the tokenizer is loaded from it)
    name: str  # the served name (what `model` gives, what its workers announce)
    worker_args: list[str] | None  # `inferd worker` options of its local worker (serve); None: remote (gateway)


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
    keys_path: str | None = None
    redis_url: str | None = None
    redis_lease_s: float = REDIS_LEASE_S  # a concurrency slot's lease in Redis (renewed while its request runs)
    rate_window: float = DEFAULT_RATE_WINDOW_S
    queue_timeout: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_QUEUE_TIMEOUT_S))
    max_queue_requests: int = DEFAULT_MAX_QUEUE_REQUESTS
    max_queue_tokens: int = DEFAULT_MAX_QUEUE_TOKENS
    fairness: str = "vtc"
    tier_shares: str = DEFAULT_TIER_SHARES  # the gateway's (serve: its workers' too)
    worker_queue_depth: int = DEFAULT_WORKER_QUEUE_DEPTH
    sse_keepalive: float = DEFAULT_SSE_KEEPALIVE_S
    sse_write_timeout: float = DEFAULT_SSE_WRITE_TIMEOUT_S
    tenant_queue_share: float = DEFAULT_TENANT_QUEUE_SHARE
    limit_concurrency: int = DEFAULT_LIMIT_CONCURRENCY
    http_head_timeout: float = NEW_CONNECTION_IDLE_TIMEOUT_S
    http_body_timeout: float = DEFAULT_HTTP_BODY_TIMEOUT_S
    http_idle_per_address: int = DEFAULT_HTTP_IDLE_PER_ADDRESS
    http_keep_alive: float = HTTP_KEEP_ALIVE_S
    worker_secret: str = ""  # shared with the workers (their handshake)
    metrics_key: str | None = None  # /metrics needs it when set
    workers: int = 1  # local worker processes (serve)
    remote_workers: list[str] = field(default_factory=list)  # HOST:PORT of remote workers (gateway)
    registry_url: str | None = None  # Redis where workers register (gateway --redis)
    worker_allow: tuple | None = None  # networks a registered worker's address must be in (None: the default list)
    replay_timeout: float = DEFAULT_REPLAY_TIMEOUT_S
    tool_call_parser: str | None = None  # config.TOOL_CALL_PARSERS; None: from the chat template (api/tools.py)
    reasoning_parser: str | None = None  # config.REASONING_PARSERS; None: no reasoning split off (api/reasoning.py)
    allow_grammar: bool = True  # False (--no-grammar): the `grammar` kind of structured outputs is refused
    disable_any_whitespace: bool = False  # True: JSON constraints compile compact (--disable-any-whitespace)
    state_dir: str | None = None  # the Batch API's SQLite and files; None: the Batch API is off
    batch_concurrency: int = DEFAULT_BATCH_CONCURRENCY  # the most batch lines in flight at once
    batch_storage_per_tenant: int | None = BATCH_STORAGE_PER_TENANT  # bytes of Batch API files a tenant keeps
    batch_retention: float | None = BATCH_RETENTION_S  # seconds a finished batch and its output are kept
    embedding_models: list[EmbeddingModelSpec] = field(default_factory=list)  # embedding models served beside
    embedding_workers: list[str] = field(default_factory=list)  # HOST:PORT of the (one) embedding model's workers
    admin_key: str | None = None  # the admin API (/admin/...): rollouts
    autoscale: object | None = None  # an AutoscalerConfig: compute (and export) the desired workers
    autoscale_local: bool = False  # and start/stop local workers to match
    autoscale_window: float = DEFAULT_AUTOSCALE_WINDOW_S
    rollout: object | None = None  # RolloutTargets for rollouts
    lora: object | None = None  # LoraOptions (api/lora_catalog.py) where --enable-lora; None: no adapters

    @property
    def remote(self) -> bool:
        return bool(self.remote_workers or self.registry_url)


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

    from ..gateway.admission import Gateway, GatewayOptions
    from ..gateway.router import Router
    from ..gateway.tenants import KeyStore
    from ..telemetry.metrics import Metrics
    from .app import build_app
    from .http_limits import protocol_class
    from .state import ServerState

    router = Router()
    metrics = Metrics(opts.served_model_name, router.latest_stats, lambda: list(router.workers),
                      lambda: (router.affinity_hits, router.affinity_queries))
    try:
        limiter = await _limiter(opts)
        keys = KeyStore.load(opts.keys_path, missing_ok=False) if opts.keys_path else None
    except Exception as e:  # Redis unreachable, a keys file that does not parse
        print(f"error: {e}", file=sys.stderr)
        return 1
    # without a keys file every request is one tenant's: a per-tenant share of the queue would only shrink it
    share = opts.tenant_queue_share if keys is not None else 1.0
    gateway = Gateway(router, limiter, GatewayOptions(opts.max_queue_requests, opts.max_queue_tokens,
                                                      opts.queue_timeout, opts.fairness, opts.worker_queue_depth,
                                                      tenant_queue_share=share, tier_shares=opts.tier_shares),
                      metrics)
    gateway.failover.timeout = opts.replay_timeout
    state = ServerState(router, metrics, opts.served_model_name, opts.api_key, opts.max_body_bytes, gateway=gateway,
                        keys=keys, sse_keepalive_s=opts.sse_keepalive, admin_key=opts.admin_key,
                        sse_write_timeout=opts.sse_write_timeout, metrics_key=opts.metrics_key)
    # without an autoscaler, the workers there are are the workers wanted (an HPA reading 0 would scale to nothing)
    metrics.desired_workers.set_function(lambda: state.autoscaler.desired if state.autoscaler is not None
                                         else sum(1 for w in router.workers if w.dead is None))
    metrics.watch_tenants(lambda: state.keys.tenants if state.keys is not None else {})
    app = build_app(state)  # takes the dashboard's first sample
    sampling = asyncio.create_task(state.dashboard.run())
    if opts.keys_path:
        watching = asyncio.create_task(_watch_keys(state, opts.keys_path))
    else:  # SIGHUP's default action would kill the server: there is nothing to reload, say so
        watching = None
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGHUP, lambda: log.warning("SIGHUP: no --keys file to reload; ignored"))

    def hook_metrics(client) -> None:
        client.on_step = lambda seconds, _n, m: metrics.observe_step(
            client.hello, seconds, m.get("bytes", 0), m.get("flops", 0), m.get("draft_tokens", 0),
            m.get("accepted_tokens", 0))

    backend = _backend(opts, router, hook_metrics)
    embeds = [_EmbeddingBackend(spec, opts, limiter) for spec in opts.embedding_models]
    metrics.embedding_passes.set_function(lambda: sum(
        w.latest_stats.num_steps for e in embeds for w in e.router.workers if w.latest_stats is not None))
    # our own drain does the graceful part; uvicorn then only flushes what is left
    # the connection cap is the protocol's (inferd/api/http_limits.py): probes pass it, idle connections make room
    http = protocol_class(opts.http_head_timeout, limit=opts.limit_concurrency, keep_alive=opts.http_keep_alive,
                          body_timeout=opts.http_body_timeout, idle_per_address=opts.http_idle_per_address)
    config = uvicorn.Config(app, log_level="warning", access_log=False, http=http, lifespan="off",
                            timeout_graceful_shutdown=FINAL_FLUSH_S, timeout_keep_alive=HTTP_KEEP_ALIVE_S,
                            limit_concurrency=None)
    server = _server_class()(config)
    stop_requested = asyncio.Event()
    server.on_first_signal = stop_requested.set
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    host, port = sock.getsockname()[:2]
    starting = asyncio.gather(backend.start(), _load_serving(state, opts),
                              *(e.start(state) for e in embeds))
    await asyncio.wait({starting, serving, asyncio.ensure_future(stop_requested.wait())},
                       return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # stopped by a signal while loading
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        server.should_exit = True
        sampling.cancel()
        await serving
        await backend.stop(0.0)
        await _stop_all(embeds)
        return 0
    if starting.exception() is not None:
        error = starting.exception()
        print(f"error: the server could not start: {error}", file=sys.stderr)
        server.should_exit = True
        sampling.cancel()
        await serving
        await backend.stop(0.0)
        await _stop_all(embeds)
        return 1
    extras = _start_cluster_services(opts, state, backend)
    batch_lock = await _start_batches(state, opts)
    shown = f"[{host}]" if ":" in host else host
    print(f"READY http://{shown}:{port}", flush=True)
    if state.authenticates:
        log.info("serving %s on http://%s:%d (API keys required: %s)", opts.served_model_name, shown, port,
                 f"{len(keys.keys)} in {opts.keys_path}" if keys is not None else "--api-key")
    else:
        log.warning("serving %s on http://%s:%d WITHOUT API keys: every request is accepted (allowed only because "
                    "%s is a loopback address; give --keys FILE to require keys)", opts.served_model_name, shown, port,
                    opts.host)
    await asyncio.wait({serving, asyncio.ensure_future(stop_requested.wait())}, return_when=asyncio.FIRST_COMPLETED)
    for task in extras:
        task.cancel()
    if not serving.done():
        await _drain(state, backend, opts.shutdown_grace)
        server.should_exit = True
        await serving
    sampling.cancel()
    if watching is not None:
        watching.cancel()
    if state.batch_runner is not None:
        await state.batch_runner.stop()
        state.batches.close()
    if batch_lock is not None:
        batch_lock.close()
    await limiter.close()
    await backend.stop(0.0)
    await _stop_all(embeds)
    return 0


class _EmbeddingBackend:
    """One embedding model's workers (local: `inferd worker --task embed` started here; remote: given or found in
    the registry, announcing this model), their router and their queue (the same limiter: the same
    tenants' quotas)."""

    def __init__(self, spec: EmbeddingModelSpec, opts: ServeOptions, limiter):
        from ..gateway.admission import Gateway, GatewayOptions
        from ..gateway.router import Router

        self.spec = spec
        self.order = [s.name for s in opts.embedding_models]  # as given: the first is the default model
        self.router = Router()
        self.gateway = Gateway(self.router, limiter, GatewayOptions(
            opts.max_queue_requests, opts.max_queue_tokens, opts.queue_timeout, opts.fairness,
            opts.worker_queue_depth, tenant_queue_share=opts.tenant_queue_share if opts.keys_path else 1.0,
            tier_shares=opts.tier_shares), None)
        self.gateway.failover.timeout = opts.replay_timeout
        if spec.worker_args is not None:
            from ..cluster.pool import WorkerPool

            self.pool = WorkerPool(self.router, lambda version: spec.worker_args, opts.heartbeat_timeout, None,
                                   secret=opts.worker_secret, name_prefix="embed")
            self.remote = None
        else:
            from ..cluster.remote import RemoteWorkers

            self.pool = None
            self.remote = RemoteWorkers(self.router, opts.embedding_workers, opts.registry_url,
                                        opts.heartbeat_timeout, None, secret=opts.worker_secret.encode(),
                                        model=spec.name, task="embed", **_allow(opts))

    async def start(self, state) -> None:
        from ..models.embedding_models import embedding_tokenizer
        from .embeddings import EmbeddingModel

        encode = await asyncio.to_thread(embedding_tokenizer, self.spec.path)
        if self.pool is not None:
            await self.pool.add(1)
        else:
            await self.remote.start()
        models = {**state.embeddings, self.spec.name: EmbeddingModel(self.router, self.gateway, encode,
                                                                     self.spec.name, state.metrics)}
        # in the order given, whichever model's worker was ready first (the first is what `model` omitted means)
        state.embeddings = {name: models[name] for name in self.order if name in models}

    async def stop(self) -> None:
        self.gateway.close()
        if self.pool is not None:
            await self.pool.stop_all(0.0)
        else:
            await self.remote.stop()


async def _stop_all(embeds: list[_EmbeddingBackend]) -> None:
    await asyncio.gather(*(e.stop() for e in embeds), return_exceptions=True)


async def _start_batches(state, opts: ServeOptions):
    """The Batch API on opts.state_dir, owned by this server alone (an exclusive lock on the folder: a second
    server pointed at it runs without the Batch API rather than run the same batches twice), the folder 0700 and
    its files 0600. Returns the lock's file, to close at exit."""
    if not opts.state_dir:
        return None
    import fcntl

    from .batch_lines import start_batches
    from .batches import private_dir

    private_dir(Path(opts.state_dir))
    lock = os.fdopen(os.open(os.path.join(opts.state_dir, "lock"), os.O_WRONLY | os.O_CREAT, 0o600), "w")
    os.fchmod(lock.fileno(), 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        log.warning("the Batch API is off: another server holds the state dir %s", opts.state_dir)
        return None
    await start_batches(state, opts.state_dir, opts.batch_concurrency, opts.batch_storage_per_tenant,
                        opts.batch_retention)
    log.info("Batch API: state in %s", opts.state_dir)
    return lock


FINAL_FLUSH_S = 2.0  # after the drain: seconds uvicorn gives responses to write their last bytes


async def _drain(state, backend, grace: float) -> None:
    """SIGTERM: new requests get 503 with Retry-After, waiting ones leave the queue with the same, running streams
    get `grace` seconds to finish; then the workers stop and hand back what still runs, which ends with an error
    event `shutdown` (there is no other worker of this server to move it to)."""
    gateway = state.gateway
    loop = asyncio.get_running_loop()
    started = loop.time()
    log.info("shutting down: %d request(s) in flight get up to %.1f s", gateway.num_in_flight, grace)
    state.draining = True
    gateway.close()
    while gateway.num_in_flight and loop.time() - started < grace:
        await asyncio.sleep(DRAIN_POLL_S)
    left, done_s = gateway.num_in_flight, loop.time() - started
    await backend.stop(0.0)
    log.info("drained: requests done in %.2f s (%d cut at the end of the grace period), workers stopped %.2f s "
             "later", done_s, left, loop.time() - started - done_s)


DRAIN_POLL_S = 0.05


def _allow(opts: ServeOptions) -> dict:
    """RemoteWorkers' allow list: --worker-allow, else its default."""
    return {} if opts.worker_allow is None else {"allow": opts.worker_allow}


def _backend(opts: ServeOptions, router, on_attach):
    if opts.remote:
        from ..cluster.remote import RemoteWorkers

        # workers must serve the model whose tokenizer this gateway loads (named as `inferd worker` names it)
        return RemoteBackend(RemoteWorkers(router, opts.remote_workers, opts.registry_url, opts.heartbeat_timeout,
                                           on_attach, secret=opts.worker_secret.encode(),
                                           model=default_served_name(opts.model_path), task="generate",
                                           known_models={spec.name for spec in opts.embedding_models},
                                           **_allow(opts)))
    from ..cluster.pool import WorkerPool

    return LocalBackend(WorkerPool(router, lambda version: opts.worker_args, opts.heartbeat_timeout, on_attach,
                                   secret=opts.worker_secret), opts.workers)


class LocalBackend:
    """`inferd serve`: worker processes started and supervised here."""

    def __init__(self, pool, count: int):
        self.pool = pool
        self.count = count

    async def start(self) -> None:
        await self.pool.add(self.count)

    async def stop(self, grace: float) -> None:
        await self.pool.stop_all(grace)


class RemoteBackend:
    """`inferd gateway`: workers that run elsewhere (and are not stopped with the gateway)."""

    def __init__(self, remote):
        self.pool = None
        self.remote = remote

    async def start(self) -> None:
        await self.remote.start()

    async def stop(self, grace: float) -> None:
        await self.remote.stop()


def _start_cluster_services(opts: ServeOptions, state, backend) -> list[asyncio.Task]:
    """The rollout controller (local workers only) and the autoscaler (where --worker-capacity is given)."""
    tasks = []
    if backend.pool is not None:
        from ..cluster.rollout import RolloutController

        state.rollout = RolloutController(state, backend.pool, opts.rollout, opts.shutdown_grace)
    if opts.autoscale is not None:
        from ..cluster.scaling import run_autoscaler

        tasks.append(asyncio.create_task(run_autoscaler(opts.autoscale, state, backend.pool, opts.shutdown_grace,
                                                        act=opts.autoscale_local and backend.pool is not None,
                                                        window=opts.autoscale_window)))
    return tasks


async def _limiter(opts: ServeOptions):
    from ..gateway.limits import InProcessLimiter

    if opts.redis_url is None:
        return InProcessLimiter(opts.rate_window)
    from ..gateway.redis_limits import RedisLimiter

    limiter = RedisLimiter(opts.redis_url, opts.rate_window, lease_s=opts.redis_lease_s)
    try:
        await limiter.ping()
    except Exception as e:
        await limiter.close()
        raise RuntimeError(f"cannot use Redis for the rate limits: {e}") from None  # e names the URL, redacted
    return limiter


async def _watch_keys(state, path: str) -> None:
    """Reloads the keys file on SIGHUP and whenever it changes (polled): a revoked key stops working without a
    restart. A file that does not parse is reported and the previous keys stay in force."""
    from ..gateway.tenants import KeyStore, file_signature

    loop = asyncio.get_running_loop()
    hup = asyncio.Event()
    loop.add_signal_handler(signal.SIGHUP, hup.set)
    seen = file_signature(path)
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(hup.wait(), KEYS_POLL_S)
            signature = file_signature(path)
            if not hup.is_set() and signature == seen:
                continue
            hup.clear()
            seen = signature
            if signature is None:  # removed (or being replaced): never an empty key set by accident
                log.error("keys file %s is missing: not reloaded, the previous keys stay in force", path)
                continue
            try:
                state.keys = await asyncio.to_thread(KeyStore.load, path, False)  # missing: keep the old
            except (ValueError, OSError) as e:
                log.error("keys file not reloaded, the previous keys stay in force: %s", e)
                continue
            log.info("keys reloaded from %s: %d tenants, %d keys", path, len(state.keys.tenants),
                     len(state.keys.keys))
    finally:
        loop.remove_signal_handler(signal.SIGHUP)


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

        on_first_signal = None  # our drain: the server keeps answering (503 for new requests) while it runs

        def _on_signal(self, sig: int) -> None:
            if self.on_first_signal is not None and not self._signalled:
                self._signalled = True
                self.on_first_signal()
                return
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: do not wait for open streams
            self.should_exit = True

        _signalled = False

    return Server


async def _load_serving(state, opts: ServeOptions) -> None:
    from ..models.tokenizer import load_tokenizer
    from .serving import OpenAIServing

    tokenizer = await asyncio.to_thread(load_tokenizer, opts.model_path)
    # on a thread: harmony's vocabulary may be written and loaded here (api/harmony.py: a second or so)
    state.serving = await asyncio.to_thread(OpenAIServing, state.router, tokenizer, opts.served_model_name,
                                            state.metrics, tool_call_parser=opts.tool_call_parser,
                                            allow_grammar=opts.allow_grammar, reasoning_parser=opts.reasoning_parser,
                                            disable_any_whitespace=opts.disable_any_whitespace)
    state.serving.embedding_models = {spec.name for spec in opts.embedding_models}
    if opts.lora is not None:
        await _load_adapters(state, opts)


async def _load_adapters(state, opts: ServeOptions) -> None:
    """The LoRA catalog, with the adapters of --lora-modules (a bad one stops the start, naming why)."""
    from ..models.loader import load_model_config
    from ..models.lora_format import AdapterError
    from .lora_catalog import LoraCatalog

    config = await asyncio.to_thread(load_model_config, opts.model_path)
    catalog = LoraCatalog(config, opts.lora, {opts.served_model_name, *(s.name for s in opts.embedding_models)})
    for name, path in opts.lora.modules:
        try:
            await catalog.load(name, path)
        except AdapterError as e:
            raise SystemExit(f"error: --lora-modules {name}={path}: {e} ({e.code})") from None
    state.lora = state.serving.lora = catalog
    state.metrics.lora_loaded.set(len(catalog.adapters()))


def default_served_name(model_path: str) -> str:
    name = os.path.basename(os.path.normpath(model_path))
    return name[:-5] if name.endswith(".gguf") else name
