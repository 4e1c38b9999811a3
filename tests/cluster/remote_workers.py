"""`inferd worker --listen` processes for gateway tests (each in its own process group, killed whole)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from cluster_util import CLUSTER_ARGS

from servers import start_ready


@dataclass
class RemoteWorker:
    proc: subprocess.Popen
    address: str
    worker_id: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


def start_worker(tmp_path: Path, model: str | Path, worker_id: str, *extra: str,
                 env: dict[str, str] | None = None) -> RemoteWorker:
    log_path = tmp_path / f"{worker_id}.log"
    command = [sys.executable, "-m", "inferd", "worker", "--listen", "127.0.0.1:0", "--worker-id", worker_id,
               "--dtype", "float32", "--threads", "1", "--model", str(model), *CLUSTER_ARGS,
               *extra]
    proc, address = start_ready(command, log_path, "READY tcp://", env)
    return RemoteWorker(proc, address, worker_id, log_path)
