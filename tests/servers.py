"""Processes for the tests: `inferd serve` servers (and the helpers the worker tests share), each in its own
process group (killed whole at teardown, worker included), ready once it printed its READY line."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

READY_TIMEOUT_S = 180.0  # model load on a busy 2-core machine; normally ~5-10 s
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    model: str
    api_key: str | None
    log_path: Path
    args: list[str] = field(default_factory=list)
    metrics_key: str | None = None  # sent by metrics(): per-tenant series need it on a server with API keys

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_pids(self) -> list[int]:
        """The server's child processes (its worker)."""
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                return [int(p) for p in f.read().split()]
        except FileNotFoundError:
            return []

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        """/metrics as {'name{labels}': value} (headers: e.g. the metrics key's)."""
        if headers is None and self.metrics_key is not None:
            headers = {"Authorization": f"Bearer {self.metrics_key}"}
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_metrics(self, predicate, timeout: float = 30.0) -> dict[str, float]:
        """Polls /metrics until predicate(metrics) holds; AssertionError with the last metrics after timeout."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if predicate(m):
                return m
            assert time.monotonic() < deadline, f"metrics never matched within {timeout} s: {m}"
            time.sleep(0.05)


def spawn(command: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A process in its own process group (kill_group kills it whole), stdout piped (its READY line), stderr to
    log_path, the suite's environment plus env."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, bufsize=0, env={**ENV, **(env or {})},
                                start_new_session=True)


def start_ready(command: list[str], log_path: Path, prefix: str, env: dict[str, str] | None = None,
                timeout: float = READY_TIMEOUT_S) -> tuple[subprocess.Popen, str]:
    """spawn(), then its first stdout line, which must start with prefix: (the process, the rest of that line).
    The process is killed when it never says so."""
    return await_ready(spawn(command, log_path, env), log_path, prefix, timeout)


def await_ready(proc: subprocess.Popen, log_path: Path, prefix: str,
                timeout: float = READY_TIMEOUT_S) -> tuple[subprocess.Popen, str]:
    """start_ready's second half, for a process spawned earlier (its start overlapping other work)."""
    try:
        line = read_line(proc, timeout, log_path)
        assert line.startswith(prefix), line
    except BaseException:
        kill_group(proc)
        raise
    return proc, line.removeprefix(prefix)


def read_line(proc: subprocess.Popen, timeout: float, log_path: Path) -> str:
    """The first stdout line of proc, without ever blocking past timeout."""
    deadline = time.monotonic() + timeout
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while b"\n" not in data:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no line from pid {proc.pid} in {timeout} s; log:\n{log_path.read_text()}")
            if sel.select(remaining):
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    raise RuntimeError(f"pid {proc.pid} exited ({proc.wait()}) before its first line; log:\n"
                                       f"{log_path.read_text()}")
                data += chunk
    return data.split(b"\n", 1)[0].decode()


def start_server(model: str | Path | None, log_path: Path, *extra: str, api_key: str | None = None,
                 model_name: str = "test-model", env: dict[str, str] | None = None,
                 command: str = "serve") -> Server:
    """command: serve (with its own workers) or gateway (remote workers: give --worker in extra). env: added to
    the server's environment (e.g. INFERD_FAULT, which its workers inherit)."""
    return begin_server(model, log_path, *extra, api_key=api_key, model_name=model_name, env=env,
                        command=command).ready()


@dataclass
class Starting:
    """A server whose process is starting (begin_server); ready() waits for its READY line."""
    proc: subprocess.Popen
    log_path: Path
    model: str
    api_key: str | None
    args: list[str]
    metrics_key: str | None

    def ready(self) -> Server:
        _, address = await_ready(self.proc, self.log_path, "READY http://")
        return Server(self.proc, "http://" + address, self.model, self.api_key, self.log_path, self.args,
                      self.metrics_key)


def begin_server(model: str | Path | None, log_path: Path, *extra: str, api_key: str | None = None,
                 model_name: str = "test-model", env: dict[str, str] | None = None,
                 command: str = "serve") -> Starting:
    """start_server in two halves: the process starts now, .ready() waits for it (a server start is seconds of
    imports and loading: the test can do its own work meanwhile). The caller kills .proc (kill_group) whatever
    happens."""
    args = ["--port", "0", "--served-model-name", model_name, *extra]
    if command == "serve":
        args = ["--dtype", "float32", *args]
    if model is not None:
        args += ["--model", str(model)]
    if api_key:
        args += ["--api-key", api_key]
    # what metrics() sends: per-tenant series need the metrics key on a server with API keys
    metrics_key = args[args.index("--metrics-key") + 1] if "--metrics-key" in args else None
    proc = spawn([sys.executable, "-m", "inferd", command, *args], log_path, env)
    return Starting(proc, log_path, model_name, api_key, args, metrics_key)


def process_gone(pid: int) -> bool:
    """True once pid no longer runs: gone, or a zombie its (new) parent has not reaped yet."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the group id is the leader's pid
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    if proc.stdout is not None:
        proc.stdout.close()


def sse_data(body: bytes | str | list[str]) -> list:
    """The data of each event of an SSE body (or of its lines), in order, through the load generator's parser
    (inferd/bench/loadgen.py, tested on its own): JSON objects parsed, "[DONE]" kept as the string; keep-alive
    comments skipped. The one SSE reader of the suite's checks (iter_sse/aiter_sse: the same, as events arrive)."""
    from inferd.bench.loadgen import SSEParser

    if isinstance(body, list):  # lines without their blank separators (aiter_lines, empty ones dropped)
        body = "\n\n".join(body) + "\n\n"
    parser = SSEParser()
    events = parser.feed(body.encode() if isinstance(body, str) else body) + parser.close()
    return [_sse_event(e) for e in events]


def iter_sse(response: httpx.Response):
    """The events of a streaming httpx response (`with client.stream(...) as response`) as they arrive, each as
    sse_data gives it."""
    from inferd.bench.loadgen import SSEParser

    parser = SSEParser()
    for chunk in response.iter_bytes():
        yield from map(_sse_event, parser.feed(chunk))
    yield from map(_sse_event, parser.close())


async def aiter_sse(response: httpx.Response):
    """iter_sse for an httpx.AsyncClient's streaming response."""
    from inferd.bench.loadgen import SSEParser

    parser = SSEParser()
    async for chunk in response.aiter_bytes():
        for event in parser.feed(chunk):
            yield _sse_event(event)
    for event in parser.close():
        yield _sse_event(event)


def _sse_event(data: str):
    import json

    return data if data == "[DONE]" else json.loads(data)


# ---- Redis (the shared rate limiter) ---------------------------------------------------------------------------
REDIS_START_TIMEOUT_S = 20.0


def free_port() -> int:
    import socket

    with socket.socket() as s:  # a free port; the short race until a server binds it is accepted in tests
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(folder: Path, port: int, password: str | None = None):
    """A real `redis-server` on a loopback port, without persistence, in its own process group (kill_redis kills it
    whole), ready (it answers PING). The Makefile installs Debian's redis-server where it is missing. password:
    requirepass (what deploy/k8s runs)."""
    import shutil
    import socket
    import subprocess
    import time

    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not on PATH (`make setup` installs it: apt-get install redis-server)")
    log = folder / f"redis-{port}.log"
    with open(log, "wb") as out:  # a file, not a pipe: a full pipe nobody reads would block the server
        auth = ["--requirepass", password] if password else []
        proc = subprocess.Popen([exe, "--port", str(port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1",
                                 "--dir", str(folder), *auth], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + REDIS_START_TIMEOUT_S
    while True:  # ready when it answers PING (a raw RESP exchange: no client needed here)
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}: {log.read_text(errors='replace')}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as c:
                if password:  # RESP: the password as a bulk string (any bytes)
                    c.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(password.encode()), password.encode()))
                    if not c.recv(64).startswith(b"+OK"):
                        raise OSError("not ready")
                c.sendall(b"PING\r\n")
                if c.recv(64).startswith(b"+PONG"):
                    return proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            kill_redis(proc)
            raise RuntimeError(f"redis-server on port {port} did not answer PING within {REDIS_START_TIMEOUT_S} s")
        time.sleep(0.02)


def kill_redis(proc) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)
