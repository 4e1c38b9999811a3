"""`inferd worker --listen` processes for gateway tests (each in its own process group, killed whole)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from cluster_util import CLUSTER_ARGS

from servers import await_ready, kill_group, spawn, start_ready


@dataclass
class RemoteWorker:
    proc: subprocess.Popen
    address: str
    worker_id: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


def _command(model: str | Path, worker_id: str, extra: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-m", "inferd", "worker", "--listen", "127.0.0.1:0", "--worker-id", worker_id,
            "--dtype", "float32", "--threads", "1", "--model", str(model), *CLUSTER_ARGS, *extra]


def start_worker(tmp_path: Path, model: str | Path, worker_id: str, *extra: str,
                 env: dict[str, str] | None = None) -> RemoteWorker:
    log_path = tmp_path / f"{worker_id}.log"
    proc, address = start_ready(_command(model, worker_id, extra), log_path, "READY tcp://", env)
    return RemoteWorker(proc, address, worker_id, log_path)


def start_workers(tmp_path: Path, model: str | Path, worker_ids: list[str], *extra: str,
                  env: dict[str, str] | None = None) -> list[RemoteWorker]:
    """start_worker for each id, the processes started side by side (a start is seconds of imports and loading on
    one core; the machine has two). All are killed if one never gets ready."""
    procs = {worker_id: spawn(_command(model, worker_id, extra), tmp_path / f"{worker_id}.log", env)
             for worker_id in worker_ids}
    try:
        return [RemoteWorker(proc, await_ready(proc, tmp_path / f"{worker_id}.log", "READY tcp://")[1], worker_id,
                             tmp_path / f"{worker_id}.log") for worker_id, proc in procs.items()]
    except BaseException:
        for proc in procs.values():
            kill_group(proc)
        raise
