"""Worker processes for the tests: `python -m inferd worker` on the tiny Llama, each in its own process group (killed
whole at teardown), ready once it printed its READY line."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from servers import kill_group, process_gone, read_line, spawn

READY_TIMEOUT_S = 120.0  # model load on a busy 2-core machine; normally ~5 s


# an intermediate parent: starts the worker command in argv, prints "WORKER_PID READY tcp://HOST:PORT", waits
PARENT_CODE = ("import subprocess, sys\n"
               "w = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE)\n"
               "print(w.pid, w.stdout.readline().decode().strip(), flush=True)\n"
               "w.wait()\n")


@dataclass
class WorkerProcess:
    proc: subprocess.Popen  # the worker, or its intermediate parent
    pid: int  # the worker's
    host: str
    port: int
    log_path: Path  # the worker's stderr

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def is_gone(self) -> bool:
        return process_gone(self.pid)

    def wait_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.is_gone():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True


def worker_command(model_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "inferd", "worker", "--model", str(model_dir), "--port", "0", "--dtype", "float32",
            "--kv-cache-bytes", "64M", *extra]




def parse_ready(line: str) -> tuple[str, int]:
    assert line.startswith("READY tcp://"), line
    host, port = line.removeprefix("READY tcp://").rsplit(":", 1)
    return host, int(port)


def start_process(command: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return spawn(command, log_path, env)






@pytest.fixture
def spawn_worker(tiny_llama_dir, tmp_path):
    """A factory of worker processes, all killed (whole process group) at the end of the test."""
    procs: list[subprocess.Popen] = []

    def spawn(*extra: str, via_parent: bool = False, model: str | Path | None = None,
              env: dict[str, str] | None = None) -> WorkerProcess:
        """via_parent: the worker is the child of an intermediate `python -c` (whose proc is returned).
        model: another model than the tiny Llama. env: added to the worker's environment (INFERD_FAULT)."""
        log_path = tmp_path / f"worker-{len(procs)}.log"
        command = worker_command(model or tiny_llama_dir, *extra)
        proc = start_process([sys.executable, "-c", PARENT_CODE, *command] if via_parent else command, log_path,
                             env)
        procs.append(proc)
        line = read_line(proc, READY_TIMEOUT_S, log_path)
        pid, line = line.split(" ", 1) if via_parent else (proc.pid, line)
        return WorkerProcess(proc, int(pid), *parse_ready(line), log_path)

    yield spawn
    for proc in procs:
        kill_group(proc)


@pytest.fixture(scope="module")
def worker(tiny_llama_dir, tmp_path_factory):
    """One worker shared by the module's tests, with frequent heartbeats (0.1 s) so that waiting on stats is fast."""
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    proc = start_process(worker_command(tiny_llama_dir, "--heartbeat-interval", "0.1", "--die-with-parent"),
                         log_path)
    try:
        yield WorkerProcess(proc, proc.pid, *parse_ready(read_line(proc, READY_TIMEOUT_S, log_path)), log_path)
    finally:
        kill_group(proc)
