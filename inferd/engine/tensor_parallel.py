"""Tensor parallelism's processes: one model split over N processes (devices) with torch.distributed. The shard
of each rank (its config, weights and row-parallel all-reduces) is model code, in inferd/models/parallel.py.

Owns: starting ranks 1..N-1 as child processes of the engine's process (rank 0), their process group, the channel
that hands them each step, and the loop they run (`python -m inferd.engine.tensor_parallel SPEC`). The scheduler
and the KV cache manager live on rank 0 alone, and the other ranks follow its block ids.

Rank 0 runs the whole Engine. Every step it writes the step's rows (tokens, first position, block table per
sequence: a few KB of int64) to each child's stdin, then runs the step itself; a child reads them, runs the same
forward (joining the all-reduces) and drops the result. Steps travel over a pipe, not a collective, because a child
waits for the next step as long as the engine idles (a collective would time out) and because end-of-file on the
pipe means the engine closed or its process died: either way the child exits. A child also exits when its parent
process is gone (it checks every PARENT_POLL_S), even in the middle of a step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from array import array
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import (
    DEFAULT_KV_CACHE_BYTES,
    TENSOR_PARALLEL_TIMEOUT_S,
    WORKER_START_TIMEOUT_S,
    EngineConfig,
    resolve_dtype,
    resolve_kv_dtype,
)
from ..models.parallel import build_shard, check_tensor_parallel
from ..models.step_row import StepRow
from .runner import ModelRunner, kv_bytes_per_block

PARENT_POLL_S = 0.2  # a child notices this fast that its parent died
CLOSE_TIMEOUT_S = 10.0  # close(): a child that has not exited this long after its pipe closed is killed
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- devices and the process group --------------------------------------------------------------------------------
def rank_device(device: str, rank: int) -> torch.device:
    """cuda (or cuda:K): rank r takes cuda:K+r; a CPU is shared by all ranks."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.device("cuda", (dev.index or 0) + rank)
    return dev


def new_process_group(store: dist.Store, rank: int, size: int, device: torch.device) -> dist.ProcessGroup:
    """The group the all-reduces run in: NCCL between GPUs, gloo on CPU. A group object of its own, not
    torch.distributed's global default group, so that one process can hold several engines (tests)."""
    timeout = timedelta(seconds=TENSOR_PARALLEL_TIMEOUT_S)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


# ---- the step channel: rank 0 -> ranks 1..N-1 --------------------------------------------------------------------
def encode_step(rows: list[StepRow]) -> bytes:
    """[count, then per sequence: start, n, n_blocks, n token ids, n_blocks block ids] as int64; count excludes
    itself."""
    msg = array("q", [0])
    for tokens, start, blocks, *_ in rows:  # one KV cache group under tensor parallelism (kv_groups.py)
        msg.extend((start, len(tokens), len(blocks)))
        msg.extend(tokens)
        msg.extend(blocks)
    msg[0] = len(msg) - 1
    return msg.tobytes()


def decode_step(values: list[int]) -> list[StepRow]:
    rows, i = [], 0
    while i < len(values):
        start, n, nb = values[i:i + 3]
        i += 3
        rows.append(StepRow(values[i:i + n], start, values[i + n:i + n + nb], False))
        i += n + nb
    return rows


def read_step(stream) -> list[StepRow] | None:
    """The next step from a binary stream; None at end of file (the engine closed, or its process died)."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    count = array("q", head)[0]
    body = stream.read(8 * count)
    if len(body) < 8 * count:
        return None
    return decode_step(array("q", body).tolist())


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# ---- rank 0 -----------------------------------------------------------------------------------------------------
class TensorParallelGroup:
    """Rank 0's side: the child processes of ranks 1..N-1, the process group, the pipes each step goes through."""

    def __init__(self, world_size: int, device: torch.device, store: dist.TCPStore,
                 procs: list[subprocess.Popen], restore_threads: int | None):
        self.world_size = world_size
        self.device = device
        self.store = store  # rank 0 serves the rendezvous store: it must live as long as the group
        self.procs = procs
        self.group: dist.ProcessGroup | None = None
        self._restore_threads = restore_threads
        self.closed = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @classmethod
    def start(cls, path: str, config: EngineConfig, dtype: torch.dtype, num_blocks: int) -> TensorParallelGroup:
        """Starts ranks 1..N-1 (they load their shards in the background) and joins the process group with them."""
        tp = config.tensor_parallel
        device = rank_device(config.device, 0)
        restore, threads = None, 0
        if device.type == "cpu":  # the ranks share the cores: N processes of all-cores threads would thrash
            restore = torch.get_num_threads()
            threads = max(1, restore // tp)
            torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", 0, tp, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=WORKER_START_TIMEOUT_S))
        spec = {"path": path, "config": dataclasses.asdict(config), "dtype": str(dtype).removeprefix("torch."),
                "num_blocks": num_blocks, "port": store.port, "parent_pid": os.getpid(), "threads": threads}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_REPO_ROOT, os.environ.get("PYTHONPATH")]))}
        group = cls(tp, device, store, [], restore)
        try:
            for rank in range(1, tp):
                # stdout to /dev/null: rank 0's stdout may be a protocol (a worker's READY line); errors go to stderr
                group.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "inferd.engine.tensor_parallel", json.dumps({**spec, "rank": rank})],
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env))
            group._wait_for("alive", WORKER_START_TIMEOUT_S)  # so that a child that failed to start is not waited on
            group.group = new_process_group(store, 0, tp, device)
        except BaseException:
            group.close()
            raise
        return group

    def _wait_for(self, key: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        keys = [f"{key}{rank}" for rank in range(1, self.world_size)]
        while not self.store.check(keys):
            for rank, proc in enumerate(self.procs, 1):
                if proc.poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} exited with code {proc.returncode} while starting"
                                       " (its error is on stderr)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks did not report {key!r} within {timeout:.0f} s")
            time.sleep(0.01)

    def wait_ready(self) -> None:
        """Blocks until every child has loaded its shard and allocated its KV cache."""
        self._wait_for("ready", WORKER_START_TIMEOUT_S)

    def send_step(self, rows: list[StepRow]) -> None:
        if self.closed:
            raise RuntimeError("the tensor-parallel group is closed")
        data = encode_step(rows)
        for rank, proc in enumerate(self.procs, 1):
            try:
                _write_all(proc.stdin.fileno(), data)
            except OSError:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone (exit code {proc.poll()})") from None

    def close(self) -> None:
        """Ends the children (end of file on their pipes) and waits for them; idempotent."""
        if self.closed:
            return
        self.closed = True
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._restore_threads is not None:
            torch.set_num_threads(self._restore_threads)


def load_tensor_parallel(path: str, config: EngineConfig, dtype: torch.dtype, progress=None):
    """Rank 0's (model shard, full ModelConfig, tokenizer, TensorParallelGroup); ranks 1..N-1 run in children.
    ValueError before anything starts when config.tensor_parallel does not divide the model."""
    from ..models.loader import load_model_config, load_state_dict
    from ..models.tokenizer import load_tokenizer

    model_config = load_model_config(path)
    tp = config.tensor_parallel
    check_tensor_parallel(model_config, tp)
    kv_dtype = resolve_kv_dtype(config.kv_dtype, dtype)
    # a rank's pool: --kv-cache-bytes, else the default (not yet sized from the card under tensor parallelism)
    block_bytes = kv_bytes_per_block(model_config, config.block_size, kv_dtype, tp)
    num_blocks = (config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // block_bytes
    group = TensorParallelGroup.start(path, config, dtype, num_blocks)
    try:
        state = load_state_dict(path, model_config, dtype, progress)
        model = build_shard(model_config, state, dtype, config.device, config.max_model_len, tp, 0, group.group)
        del state
        tokenizer = load_tokenizer(path)
        group.wait_ready()
    except BaseException:
        group.close()
        raise
    return model, model_config, tokenizer, group


# ---- ranks 1..N-1 -----------------------------------------------------------------------------------------------
def _exit_orphaned(parent_pid: int) -> None:
    os.write(2, f"inferd tensor-parallel rank (pid {os.getpid()}): the engine's process {parent_pid} is gone; "
                "exiting\n".encode())
    os._exit(1)


def _exit_when_parent_dies(parent_pid: int) -> None:
    """A child waits on its pipe, which ends when the parent dies, unless some other process inherited the pipe;
    and in the middle of a step it may wait on an all-reduce. So poll the parent too (the kernel's PR_SET_PDEATHSIG
    would fire when the *thread* that started us exits, which need not be the engine's)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        _exit_orphaned(parent_pid)

    threading.Thread(target=watch, name="inferd-tp-parent-watch", daemon=True).start()


def _parent_gone(parent_pid: int, within: float) -> bool:
    """A dying parent's sockets close (failing our all-reduce) a moment before we are re-parented: wait a little."""
    deadline = time.monotonic() + within
    while os.getppid() == parent_pid:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def run_rank(spec: dict) -> int:
    """A child rank: join the group, load this rank's shard, then run every step rank 0 sends until end of file."""
    import signal

    from .. import kernels
    from ..models.loader import load_model_config, load_state_dict
    from ..models.quantize import quantize_model

    _exit_when_parent_dies(spec["parent_pid"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    rank, config = spec["rank"], EngineConfig(**spec["config"])
    tp, dtype = config.tensor_parallel, resolve_dtype(spec["dtype"])
    device = rank_device(config.device, rank)
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    store = dist.TCPStore("127.0.0.1", spec["port"], tp, is_master=False,
                          timeout=timedelta(seconds=WORKER_START_TIMEOUT_S))
    store.set(f"alive{rank}", "1")
    group = new_process_group(store, rank, tp, device)
    model_config = load_model_config(spec["path"])
    state = load_state_dict(spec["path"], model_config, dtype)
    model = build_shard(model_config, state, dtype, device, config.max_model_len, tp, rank, group)
    del state
    quantize_model(model, config.quantize)  # this rank's shard: per-output-channel scales of its own rows
    kv_dtype = resolve_kv_dtype(config.kv_dtype, dtype)
    model.ops = kernels.select(device, dtype, kv_dtype, config.kernels)  # as rank 0's engine selects
    runner = ModelRunner(model, model_config, spec["num_blocks"], config.block_size, dtype, device, tp,
                         kv_dtype=kv_dtype)
    store.set(f"ready{rank}", "1")
    with open(0, "rb", closefd=False) as steps:
        while (rows := read_step(steps)) is not None:
            try:
                runner.forward(rows)  # only rank 0 samples
            except Exception:
                if _parent_gone(spec["parent_pid"], within=1.0):  # the all-reduce failed because rank 0 died
                    _exit_orphaned(spec["parent_pid"])
                raise
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m inferd.engine.tensor_parallel SPEC_JSON (started by the engine, not by hand)",
              file=sys.stderr)
        return 2
    return run_rank(json.loads(argv[0]))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # nothing left to clean up: skip the interpreter's teardown (~1 s with torch loaded)
