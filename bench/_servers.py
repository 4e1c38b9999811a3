"""`inferd serve` processes for the bench scripts: started in their own process group, ready at their READY line,
killed whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

READY_TIMEOUT_S = 600.0


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


def start_server(model: str | None, extra: list[str], name: str, env: dict | None = None) -> Server:
    """`inferd serve --port 0` (fp32, the default model unless `model`) with extra options."""
    log_path = os.path.join(tempfile.gettempdir(), f"inferd-bench-{name}-{os.getpid()}.log")
    command = [sys.executable, "-m", "inferd", "serve", "--port", "0", "--dtype", "float32", *extra]
    if model:
        command += ["--model", model]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    deadline = time.monotonic() + READY_TIMEOUT_S
    line = b""
    while not line.startswith(b"READY "):
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); log: {log_path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server was not ready in {READY_TIMEOUT_S} s; log: {log_path}")
    return Server(proc, line.decode().split()[1], log_path)
