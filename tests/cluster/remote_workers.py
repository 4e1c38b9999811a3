"""`inferd worker --listen` processes for gateway tests (each in its own process group, killed whole)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from servers import ENV, READY_TIMEOUT_S, kill_group, read_line

from cluster_util import CLUSTER_ARGS


@dataclass
class RemoteWorker:
    proc: subprocess.Popen
    address: str
    worker_id: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


def start_worker(tmp_path: Path, model: str | Path, worker_id: str, *extra: str) -> RemoteWorker:
    log_path = tmp_path / f"{worker_id}.log"
    command = [sys.executable, "-m", "inferd", "worker", "--listen", "127.0.0.1:0", "--worker-id", worker_id,
               "--dtype", "float32", "--threads", "1", "--model", str(model), *CLUSTER_ARGS,
               *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, bufsize=0, env=ENV,
                                start_new_session=True)
    try:
        line = read_line(proc, READY_TIMEOUT_S, log_path)
    except BaseException:
        kill_group(proc)
        raise
    assert line.startswith("READY tcp://"), line
    return RemoteWorker(proc, line.removeprefix("READY tcp://"), worker_id, log_path)
