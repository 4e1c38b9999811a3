"""The worker process: one Engine behind a TCP listener, serving every authenticated client connection (gateways)
at once, each with its own requests.

Threads: the main thread accepts connections; one thread per connection runs the handshake (the challenge-response
of inferd/worker/protocol.py, by the shared secret, within WORKER_HANDSHAKE_TIMEOUT_S for the whole auth frame of at
most MAX_HANDSHAKE_FRAME_BYTES: a port scan, a TCP probe or a client without the secret is closed and touches
nothing), then opens the sealed frames (inferd/worker/sealing.py), parses them and hands requests to the EngineLoop;
the EngineLoop thread steps the engine; a heartbeat thread sends `heartbeat` to every connection every interval
whatever the engine is doing, so a long step never looks like death. Whole frames are sealed and written under a
per-connection lock, from whichever thread, so that they leave in the order of their counters. A connection that
closes aborts its own requests only.

Connections in their handshake are bounded: MAX_PENDING_HANDSHAKES in all, MAX_PENDING_HANDSHAKES_PER_ADDRESS from
one peer address. A new connection is never refused: when a bound is reached, the oldest pending handshake (of that
address, else of all) is closed instead, so idle connections, renewed as they expire, cannot lock a gateway out.
Authenticated connections are not counted there at all.

Lifecycle: prints `READY tcp://HOST:PORT` once it accepts connections. SIGTERM/SIGINT: abort what runs, send the
final outputs, close, exit 0. A client `shutdown` does the same after a grace period. If the step thread itself
fails (a bug), the worker closes and exits 1 rather than heartbeating without serving. With die_with_parent the
kernel sends SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any

import torch

from ..config import (
    DEFAULT_MODEL_VERSION,
    DEFAULT_SHUTDOWN_GRACE_S,
    MAX_HANDSHAKE_FRAME_BYTES,
    MAX_PENDING_HANDSHAKES,
    MAX_PENDING_HANDSHAKES_PER_ADDRESS,
    WORKER_HANDSHAKE_TIMEOUT_S,
    EngineConfig,
)
from ..engine.engine import Engine
from ..engine.errors import InvalidRequestError
from ..engine.protocol import EngineProtocol
from .engine_loop import EngineLoop
from .faults import FaultInjector
from .protocol import (
    ABORT,
    ADD,
    AUTH,
    CLIENT_MESSAGE_TYPES,
    DEFAULT_HEARTBEAT_INTERVAL,
    PING,
    PROTOCOL_VERSION,
    SHUTDOWN,
    ProtocolError,
    WorkerHello,
    challenge_message,
    client_proof,
    decode_message,
    encode_body,
    error_message,
    frame,
    heartbeat_message,
    new_nonce,
    parse_add,
    proof_matches,
    read_frame,
    rejected_message,
    valid_nonce,
)
from .sealing import Opener, Sealer, channel

log = logging.getLogger("inferd.worker")

ACCEPT_POLL_S = 0.2  # how often the accept loop looks at the shutdown flag
SEND_TIMEOUT_S = 10.0  # a client that stops reading for this long is dropped rather than stalling the engine
PR_SET_PDEATHSIG = 1


class Connection:
    """One client connection. send() is safe from any thread and never raises: a failed send closes it. Frames are
    sealed once the handshake set sealer and opener (before that: the challenge, in the clear)."""

    def __init__(self, sock: socket.socket, address: Any):
        self.sock = sock
        self.address = address
        self.peer = address[0] if isinstance(address, tuple) else str(address)  # the host, for per-address bounds
        self.closed = False
        self.sealer: Sealer | None = None
        self.opener: Opener | None = None
        self._lock = threading.Lock()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT_S), 0))

    def send(self, message: dict[str, Any]) -> None:
        try:
            body = encode_body(message)  # the JSON outside the lock; sealing inside it, in send order
        except (ProtocolError, ValueError) as e:
            log.error("dropping an unsendable %r message: %s", message.get("type"), e)
            return
        with self._lock:
            if self.closed:
                return
            try:
                self.sock.sendall(frame(body if self.sealer is None else self.sealer.seal(body)))
            except OSError as e:
                log.warning("send to %s failed (%s): closing the connection", self.address, e)
                self.close()

    def close(self) -> None:
        """Ends the connection without waiting for a blocked send: shutdown() wakes every thread using it."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def receive(self) -> bytes | None:
        """The next frame's body, opened (blocking; the reader thread's); None at a clean end of stream. A fatal
        ProtocolError when it does not open."""
        sealed = read_frame(self.sock)
        assert self.opener is not None  # the reader thread starts once the handshake has set it
        return None if sealed is None else self.opener.open(sealed)

    def release(self) -> None:
        """Closes the file descriptor, once no thread can be writing (called by the reader thread at its end)."""
        self.close()
        with self._lock:
            self.sock.close()


class WorkerServer:
    def __init__(self, engine: EngineProtocol, hello: WorkerHello, host: str = "127.0.0.1", port: int = 0,
                 heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL, faults: FaultInjector | None = None,
                 secret: bytes = b"", handshake_timeout: float = WORKER_HANDSHAKE_TIMEOUT_S):
        if not heartbeat_interval > 0:
            raise ValueError(f"heartbeat_interval must be > 0 seconds, got {heartbeat_interval}")
        self.loop = EngineLoop(engine, on_crash=self._on_engine_loop_crash, faults=faults)
        self._beat_now = threading.Event()  # wakes the heartbeat thread (a drain starts: say so at once)
        self.exit_code = 0
        self.hello = hello
        self.heartbeat_interval = heartbeat_interval
        self.listener = socket.create_server((host, port))
        self.listener.settimeout(ACCEPT_POLL_S)
        self.host, self.port = self.listener.getsockname()[:2]
        self.secret = secret
        self.handshake_timeout = handshake_timeout
        self._conns: set[Connection] = set()  # authenticated connections (heartbeats go to each)
        self._conns_lock = threading.Lock()
        self.num_refused = 0  # connections closed for failing the handshake
        # connections in their handshake now, oldest first (at most MAX_PENDING_HANDSHAKES)
        self._pending: dict[Connection, None] = {}
        self.num_evicted = 0  # pending handshakes closed to make room for a newer connection
        self._shutdown = threading.Event()
        self._heartbeat_seq = itertools.count(1)

    def serve_forever(self) -> None:
        """Serves until shutdown is requested, then waits for the engine loop to finish and closes."""
        threading.Thread(target=self._send_heartbeats, name="inferd-heartbeat", daemon=True).start()
        acceptor = threading.Thread(target=self._accept_connections, name="inferd-accept", daemon=True)
        print(f"READY tcp://{self.host}:{self.port}", flush=True)
        log.info("worker %s serving %s on %s:%d", self.hello.worker_id, self.hello.model, self.host, self.port)
        acceptor.start()
        # the engine steps on this thread, the one that built the engine: torch's OpenMP pool is this thread's. A
        # step run from a second thread (a second OpenMP team beside the idle first one) measured 23-24 ms against
        # 16-17 ms per batch-1 decode step (docs/benchmarks.md, issue 14)
        self.loop.run_here()
        self._shutdown.set()  # the loop ended (drained, or crashed): stop accepting
        acceptor.join()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            conn.close()
        log.info("worker %s stopped", self.hello.worker_id)

    def _accept_connections(self) -> None:
        while not self._shutdown.is_set():
            try:
                sock, address = self.listener.accept()
            except TimeoutError:
                continue
            self._adopt(sock, address)
        self.listener.close()

    def request_shutdown(self, grace_period: float = 0.0) -> None:
        """Drain: new requests are refused (retryable), in-flight ones get grace_period seconds, then the rest are
        handed back (retryable errors) and the worker exits. Signal-handler safe."""
        log.info("draining: running requests get %.1f s", grace_period)
        self.loop.stop(grace_period)
        self._shutdown.set()
        self._beat_now.set()

    # ---- connections ----------------------------------------------------------------------------------------
    def _adopt(self, sock: socket.socket, address: Any) -> None:
        sock.settimeout(None)
        conn = Connection(sock, address)
        with self._conns_lock:
            evicted = self._make_room(conn.peer)
            self._pending[conn] = None
        if evicted is not None:  # a flood: the oldest pending handshake makes room, never a new connection
            evicted.close()  # wakes its thread, which ends the handshake as failed
            self.num_evicted += 1
            if (self.num_evicted & (self.num_evicted - 1)) == 0:  # logged at 1, 2, 4, ...: floods no log
                log.warning("closed the oldest pending handshake (from %s) to make room for a connection from %s: "
                            "at most %d connections in their handshake, %d per address (%d closed so far)",
                            evicted.address, address, MAX_PENDING_HANDSHAKES, MAX_PENDING_HANDSHAKES_PER_ADDRESS,
                            self.num_evicted)
        threading.Thread(target=self._serve_connection, args=(conn,), name="inferd-conn-reader", daemon=True).start()

    def _make_room(self, peer: str) -> Connection | None:
        """Under _conns_lock: takes out (and returns) the pending handshake a new connection from peer replaces, if a
        bound is reached: that address's oldest when it holds its share, else the oldest of all."""
        same = [c for c in self._pending if c.peer == peer]
        if len(same) >= MAX_PENDING_HANDSHAKES_PER_ADDRESS:
            oldest = same[0]
        elif len(self._pending) >= MAX_PENDING_HANDSHAKES:
            oldest = next(iter(self._pending))
        else:
            return None
        del self._pending[oldest]
        return oldest

    def _serve_connection(self, conn: Connection) -> None:
        authenticated = False
        try:
            authenticated = self._handshake(conn)
        finally:
            with self._conns_lock:
                evicted = self._pending.pop(conn, False) is False
                authenticated = authenticated and not evicted and not conn.closed
                if authenticated:
                    self._conns.add(conn)
        if not authenticated:
            self.num_refused += 1
            conn.release()
            return
        log.info("connection from %s authenticated (%d open)", conn.address, len(self._conns))
        self._read(conn)

    def _handshake(self, conn: Connection) -> bool:
        """challenge -> auth (checked) -> hello, the first sealed frame. False (nothing sent after the challenge)
        when the client does not answer in time (the whole frame, however it trickles in), answers anything else or
        more than an auth message, or does not know the secret."""
        nonce = new_nonce()
        conn.send(challenge_message(nonce))
        message, problem = None, None  # None and no message: it closed the connection without a word
        try:
            body = read_frame(conn.sock, MAX_HANDSHAKE_FRAME_BYTES, time.monotonic() + self.handshake_timeout)
            if body is not None:
                message = decode_message(body, frozenset({AUTH}))
        except TimeoutError:
            problem = f"no auth message within {self.handshake_timeout:g} s"
        except (ProtocolError, OSError, ValueError) as e:
            problem = str(e)
        finally:
            with contextlib.suppress(OSError):
                conn.sock.settimeout(None)
        if message is not None:
            client_nonce = message.get("nonce")
            if not valid_nonce(client_nonce):
                problem = "an auth message without a valid nonce"
            elif not proof_matches(client_proof(self.secret, nonce, client_nonce), message.get("proof")):
                problem = "its proof does not match: it does not know the shared secret"
        if message is None and problem is None:  # a port scan or a TCP probe: routine, not worth a warning
            log.debug("connection from %s closed before the handshake", conn.address)
            return False
        if problem is not None:
            log.warning("connection from %s failed the handshake (%s): closed", conn.address, problem)
            return False
        assert valid_nonce(client_nonce)  # a message without one has a problem (above)
        # the hello is the first sealed frame (opening it is the worker's proof), sent before heartbeats can reach it
        conn.sealer, conn.opener = channel(self.secret, nonce, client_nonce, worker_side=True)
        conn.send(self.hello.to_wire())
        return True

    def _read(self, conn: Connection) -> None:
        try:
            while True:
                body = conn.receive()
                if body is None:
                    break
                self._handle_frame(conn, body)
        except ProtocolError as e:  # fatal: the byte stream cannot be resynchronised, or was tampered with
            log.warning("closing %s: %s", conn.address, e)
            conn.send(error_message(str(e)))
        except OSError:
            pass
        finally:
            self.loop.drop(conn)
            conn.release()
            with self._conns_lock:
                self._conns.discard(conn)

    def _handle_frame(self, conn: Connection, body: bytes) -> None:
        try:
            message = decode_message(body, CLIENT_MESSAGE_TYPES)
            kind = message["type"]
            if kind == ADD:
                self._on_add(conn, message)
            elif kind == ABORT:
                self._on_abort(conn, message)
            elif kind == PING:
                conn.send(self._heartbeat())
            elif kind == SHUTDOWN:
                self._on_shutdown(message)
        except ProtocolError as e:
            conn.send(error_message(str(e)))
        except Exception as e:  # a bug handling one message must not end the connection or the worker
            log.exception("failed to handle a message")
            conn.send(error_message(f"internal error: {e!r}"))

    def _on_add(self, conn: Connection, message: dict[str, Any]) -> None:
        try:
            request = parse_add(message)
        except InvalidRequestError as e:
            conn.send(rejected_message(message["request_id"], message.get("epoch", 0), str(e)))
            return
        lora = getattr(self.loop.engine, "lora", None)
        if request.params.lora is not None and lora is not None:
            # its adapter read into host memory here, on this connection's thread, not on the step thread
            from ..engine.lora import AdapterRef
            from ..models.lora_format import AdapterError

            try:
                lora.prepare(AdapterRef.from_params(request.params.lora))
            except (AdapterError, InvalidRequestError) as e:
                conn.send(rejected_message(request.request_id, request.epoch, f"LoRA adapter: {e}"))
                return
        self.loop.add(conn, request)

    def _on_abort(self, conn: Connection, message: dict[str, Any]) -> None:
        request_id = message.get("request_id")
        if not isinstance(request_id, str):
            raise ProtocolError("an abort message needs a string request_id")
        self.loop.abort(conn, request_id)

    def _on_shutdown(self, message: dict[str, Any]) -> None:
        grace = message.get("grace_period", 0.0)
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace < float("inf"):
            raise ProtocolError(f"grace_period must be a number of seconds >= 0, got {grace!r}")
        log.info("shutdown requested by the client (grace period %.1f s)", grace)
        self.request_shutdown(float(grace))

    # ---- heartbeats -----------------------------------------------------------------------------------------
    def _send_heartbeats(self) -> None:
        while True:
            self._beat_now.wait(self.heartbeat_interval)
            self._beat_now.clear()
            with self._conns_lock:
                conns = list(self._conns)
            if conns:
                message = self._heartbeat()
                for conn in conns:
                    conn.send(message)

    def _heartbeat(self) -> dict[str, Any]:
        stats = dataclasses.replace(self.loop.stats, step_in_progress_s=self.loop.step_seconds(),
                                    draining=self.loop.draining)
        return heartbeat_message(next(self._heartbeat_seq), time.monotonic(), stats)

    def _on_engine_loop_crash(self, error: BaseException) -> None:
        """Without its step thread the worker would heartbeat forever and serve nothing: exit instead (the
        connection closes, so the client knows at once)."""
        self.exit_code = 1
        self._shutdown.set()


# ---- the process ----------------------------------------------------------------------------------------------
def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel for SIGTERM when the parent exits (Linux only). Note: the kernel watches the parent *thread*
    that forked us, so a supervisor must spawn workers from a thread that lives as long as it does."""
    if not sys.platform.startswith("linux"):
        log.warning("--die-with-parent is only supported on Linux; ignored")
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def model_name(config: EngineConfig) -> str:
    from ..models.loader import default_model_path

    path = os.path.normpath(config.model or default_model_path())
    name = os.path.basename(path)
    return name[:-5] if name.endswith(".gguf") else name


def build_hello(engine: EngineProtocol, config: EngineConfig, worker_id: str, heartbeat_interval: float,
                version: str = DEFAULT_MODEL_VERSION, peaks=None) -> WorkerHello:
    info = engine.info()
    return WorkerHello(protocol_version=PROTOCOL_VERSION, worker_id=worker_id, pid=os.getpid(),
                       model=info.served_name or model_name(config), max_model_len=info.max_model_len,
                       vocab_size=info.vocab_size, eos_token_ids=sorted(info.eos_token_ids),
                       kv_num_blocks=info.kv_num_blocks, kv_block_size=info.kv_block_size,
                       max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                       heartbeat_interval=heartbeat_interval, version=version,
                       peak_bandwidth=peaks.bandwidth if peaks else 0.0, peak_flops=peaks.flops if peaks else 0.0,
                       task=info.task, embedding_dim=info.embedding_dim)


@contextlib.contextmanager
def loading_progress(name: str):
    """A progress bar on stderr while the weights load; yields the progress(done, total) callback."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn(f"loading {name}"), BarColumn(), MofNCompleteColumn(), TextColumn("tensors"),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task("load", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield progress


@dataclasses.dataclass
class WorkerRunOptions:
    """How `inferd worker` runs, besides its engine configuration."""
    host: str = "127.0.0.1"
    port: int = 0
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    worker_id: str | None = None  # default: HOSTNAME-PID
    parent_pid: int | None = None  # the parent at start-up: die when it dies
    version: str = DEFAULT_MODEL_VERSION
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE_S  # SIGTERM: running requests get this long, then move
    threads: int | None = None  # torch intra-op threads (None: torch's default, every core)
    register: str | None = None  # a Redis URL: announce this worker there (gateway --redis discovers it)
    advertise: str | None = None  # HOST:PORT gateways should connect to (default: the listening address)
    peak_bandwidth: float | None = None  # bytes/s; None: calibrated once per device (cached)
    peak_flops: float | None = None  # FLOP/s
    secret: str = ""  # shared with the gateways (the handshake); empty: loopback only


def run_worker(config: EngineConfig, opts: WorkerRunOptions) -> int:
    """The `inferd worker` process."""
    start_worker_process(opts)
    try:
        with loading_progress(model_name(config)) as progress:
            engine = Engine.from_config(dataclasses.replace(config, detokenize=False), progress)  # sends token ids
    except ValueError as e:  # a configuration the model cannot take (e.g. --tensor-parallel that does not divide it)
        log.error("cannot start the engine: %s", e)
        return 2
    try:
        return serve_engine(engine, config, opts)
    finally:
        engine.close()  # tensor parallel: the other ranks exit


def run_embed_worker(config: EngineConfig, opts: WorkerRunOptions, max_wait_s: float, max_batch_tokens: int,
                     pooling: str = "auto", normalize: str = "auto") -> int:
    """`inferd worker --task embed`: an embedding model (inferd/engine/embedding.py) behind the same protocol."""
    from ..engine.embedding import EmbedEngine

    start_worker_process(opts)
    try:
        engine = EmbedEngine.from_config(config, max_wait_s, max_batch_tokens, pooling, normalize)
    except ValueError as e:
        log.error("cannot start the embedding worker: %s", e)
        return 2
    log.info("embedding worker: %s (%d dimensions, %s pooling%s, context %d)", engine.embedder.folder,
             engine.embedder.dim, engine.embedder.pooling.mode,
             ", normalized" if engine.embedder.pooling.normalize else "", engine.max_model_len)
    return serve_engine(engine, config, opts)


def start_worker_process(opts: WorkerRunOptions) -> None:
    """What every worker process does first (the model's, the embedding model's, the echo one): logging, the
    parent watch, torch's thread count."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    if opts.parent_pid is not None:
        die_with_parent(opts.parent_pid)
    if opts.threads is not None:
        import torch

        torch.set_num_threads(opts.threads)


def serve_engine(engine: EngineProtocol, config: EngineConfig, opts: WorkerRunOptions) -> int:
    """Serves a built engine (the model's or the echo one) until shutdown; returns the exit code."""
    worker_id = opts.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    device_peaks = None
    if isinstance(engine, Engine):  # the echo engine reads no weights: nothing to compare with a peak
        from ..telemetry.roofline import peaks

        device_peaks = peaks(torch.device(config.device), engine.dtype, opts.peak_bandwidth, opts.peak_flops)
        log.info("device peaks (%s): %.1f GB/s, %.1f GFLOP/s in %s; ridge point %.1f FLOP/byte", device_peaks.source,
                 device_peaks.bandwidth / 1e9, device_peaks.flops / 1e9, engine.dtype, device_peaks.ridge)
    hello = build_hello(engine, config, worker_id, opts.heartbeat_interval, opts.version, device_peaks)
    faults = FaultInjector.from_env(worker_id, opts.version)
    server = WorkerServer(engine, hello, opts.host, opts.port, opts.heartbeat_interval, faults=faults,
                          secret=opts.secret.encode())
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: server.request_shutdown(opts.shutdown_grace))
    registration = None
    if opts.register:
        from .registry import Registration

        registration = Registration(opts.register, hello, opts.advertise or _advertised(server.host, server.port),
                                    opts.heartbeat_interval)
        registration.start()
    try:
        server.serve_forever()
    finally:
        if registration is not None:
            registration.stop()
    return server.exit_code


def _advertised(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
