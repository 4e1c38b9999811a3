"""Grammar compiles that can be abandoned: each runs in a child process, killed when it has used its budget of CPU
time (or GRAMMAR_COMPILE_WALL_FACTOR times that in wall time, starved of CPU) or when every request waiting for it was
aborted.

Why processes: xgrammar's compile is one C++ call. A thread running it cannot be stopped (an abort would leave it
burning a core, and every compile queued behind it waiting, for as long as the grammar takes: seconds for a large
unique grammar); a killed process stops at once and gives its core back. The children are forked from a
multiprocessing forkserver that has imported xgrammar (a fresh fork is ready in tens of milliseconds, not the 2 s an
import of xgrammar, torch and transformers takes), run at a lower CPU priority than the step (nice 10), and compile
with the worker's TokenizerInfo, sent to each once.

What comes back is bytes (xgrammar's own serialization of the CompiledGrammar, deserialized and checked by xgrammar),
never a pickle: a child compiles text a client chose, so nothing it sends may run code here. Compiled grammars are
cached here per (kind, text), least recently used out past GRAMMAR_CACHE_BYTES; requests asking for a grammar already
being compiled wait for that compile.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import socket
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..config import GRAMMAR_CACHE_BYTES, GRAMMAR_COMPILE_START_TIMEOUT_S, GRAMMAR_COMPILE_WALL_FACTOR
from .grammar_budget import GrammarTooSlow

log = logging.getLogger("inferd.engine")
# compiles yield the CPU to the engine's steps. Not the forkserver: its one start per worker (importing xgrammar and
# torch, ~2 s of CPU) at a low priority would leave the first constrained request waiting behind a busy engine
COMPILE_NICE = 10
MAX_ERROR_BYTES = 2048  # a compile error's message, as sent back
POLL_S = 0.05  # how often a compile's CPU time is read against its budget
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """The CPU time (user + system) a process has used, None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * _TICK_S
    except (OSError, IndexError, ValueError):
        return None


class GrammarCompileError(RuntimeError):
    """The grammar could not be compiled (an error xgrammar raised, or its process died)."""


@dataclass(eq=False)
class _Compile:
    key: tuple[str, str]
    waiters: list[Future] = field(default_factory=list)
    slot: _Slot | None = None  # the process compiling it, once started


def _child_main(conn) -> None:
    """A compile process: the TokenizerInfo first, then (kind, text) -> b"ok" + the serialized CompiledGrammar, or
    b"er" + the error, until the pipe closes."""
    try:
        os.nice(COMPILE_NICE)
    except OSError:
        pass
    _exit_with_worker(conn)
    import xgrammar

    from .structured import compile_constraint

    info = xgrammar.TokenizerInfo.deserialize_json(conn.recv_bytes().decode())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the parent caches
    conn.send_bytes(b"ready")
    while True:
        try:
            kind, text = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            out = b"ok" + compile_constraint(compiler, kind, text).serialize_json().encode()
        except Exception as e:  # noqa: BLE001 - reported to the request, the process carries on
            out = b"er" + (str(e).strip() or type(e).__name__).encode()[:MAX_ERROR_BYTES]
        conn.send_bytes(out)


def _exit_with_worker(conn) -> None:
    """Exit, mid-compile too, once the worker's end of the pipe closes (the worker died). Not the parent process:
    that is the forkserver, which lives as long as any process it forked."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))  # the pipe is a socket pair: peek without consuming

    def watch() -> None:
        while True:
            try:
                data = sock.recv(1, socket.MSG_PEEK)
            except OSError:
                data = b""
            if not data:
                os._exit(1)
            time.sleep(0.05)  # a message waits for the main thread to read it

    threading.Thread(target=watch, name="inferd-grammar-worker-watch", daemon=True).start()


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["xgrammar", __name__])
    return ctx


class _Slot:
    """One compile process and the thread that feeds it one compile at a time."""

    def __init__(self, service: GrammarCompileService, index: int):
        self.service = service
        self.proc = None
        self.conn = None
        self.job: _Compile | None = None
        self.thread = threading.Thread(target=self._run, name=f"inferd-grammar-{index}", daemon=True)
        self.thread.start()

    def kill(self) -> None:
        """Called by another thread: a signal only (the slot's thread alone waits for the process)."""
        proc = self.proc
        if proc is not None:
            proc.kill()  # the thread sees the pipe close and starts another process for the next compile

    def _start(self) -> None:
        ctx = _context()
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child_main, args=(child,), name="inferd-grammar-compile", daemon=True)
        proc.start()
        child.close()
        self.proc, self.conn = proc, parent  # from here kill() reaches it, and _stop() cleans it up
        parent.send_bytes(self.service.tokenizer_json)
        if not parent.poll(GRAMMAR_COMPILE_START_TIMEOUT_S) or parent.recv_bytes() != b"ready":
            raise GrammarCompileError("the grammar compile process did not start")

    def _stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(5)
            self.conn.close()
        self.proc = self.conn = None

    def _wait_reply(self, cpu_before: float | None, started: float) -> bool:
        """True once the process answers (or its pipe closes); False when the compile used its budget of CPU time,
        or GRAMMAR_COMPILE_WALL_FACTOR times that in wall time (a compile starved of CPU)."""
        budget = self.service.timeout_s
        while not self.conn.poll(POLL_S):
            now = cpu_seconds(self.proc.pid)
            used = now - cpu_before if now is not None and cpu_before is not None else time.monotonic() - started
            if used >= budget or time.monotonic() - started >= budget * GRAMMAR_COMPILE_WALL_FACTOR:
                return False
        return True

    def _run(self) -> None:
        service = self.service
        while True:
            job = service._next(self)
            if job is None:
                self._stop()
                return
            try:
                if self.proc is None or not self.proc.is_alive():
                    self._stop()
                    self._start()
                if not service._wanted(job):  # every waiter left while the process started
                    continue
                started = time.monotonic()
                cpu_before = cpu_seconds(self.proc.pid)
                self.conn.send_bytes(json.dumps(job.key).encode())
                if not self._wait_reply(cpu_before, started):  # past its budget: the process goes with it
                    self._stop()
                    service._done(job, error=GrammarTooSlow(
                        f"compiling the request's grammar took longer than its budget of {service.timeout_s:g} s "
                        "of CPU time (GRAMMAR_COMPILE_TIMEOUT_S, --grammar-compile-timeout): use a smaller or less "
                        "ambiguous grammar"))
                    continue
                reply = self.conn.recv_bytes(service.max_reply_bytes)
                seconds = time.monotonic() - started
            except Exception as e:  # noqa: BLE001 - killed (every waiter left), crashed or could not start
                self._stop()
                service._done(job, error=GrammarCompileError(f"the grammar compile process ended: {e!r}"))
                continue
            if reply[:2] == b"ok":
                try:
                    compiled = service.deserialize(reply[2:].decode())
                except Exception as e:  # noqa: BLE001 - a reply xgrammar does not accept
                    service._done(job, error=GrammarCompileError(f"the compiled grammar did not load: {e}"))
                    continue
                log.debug("compiled a %s grammar in %.3f s", job.key[0], seconds)
                service._done(job, result=compiled)
            else:
                service._done(job, error=GrammarCompileError(reply[2:].decode(errors="replace")))


class GrammarCompileService:
    """submit(kind, text) -> a Future of the CompiledGrammar (GrammarTooSlow past timeout_s, GrammarCompileError when
    it cannot compile); cancel(future) when its request leaves. At most `processes` compiles run at once."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int], processes: int, timeout_s: float,
                 cache_bytes: int = GRAMMAR_CACHE_BYTES):
        import xgrammar

        if processes < 1 or not timeout_s > 0:
            raise ValueError(f"need at least one compile process and a timeout > 0, got {processes} and {timeout_s}")
        self._xgr = xgrammar
        self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
        self.tokenizer_json = self.tokenizer_info.serialize_json().encode()
        self.timeout_s = timeout_s
        self.cache_bytes = cache_bytes
        self.max_reply_bytes = max(cache_bytes, 16 << 20)  # a grammar larger than the whole cache is refused
        self._lock = threading.Condition()
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._cached_bytes = 0
        self._compiling: dict[tuple[str, str], _Compile] = {}  # queued or running, by key
        self._queue: deque[_Compile] = deque()
        self._of: dict[int, _Compile] = {}  # id(waiter future) -> its compile
        self._closed = False
        self._slots = [_Slot(self, i) for i in range(processes)]

    def deserialize(self, text: str):
        return self._xgr.CompiledGrammar.deserialize_json(text, self.tokenizer_info)

    # ---- the engine's side -----------------------------------------------------------------------------------
    def submit(self, kind: str, text: str) -> Future:
        key = (kind, text)
        future: Future = Future()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                future.set_result(compiled)
                return future
            job = self._compiling.get(key)
            if job is None:
                job = self._compiling[key] = _Compile(key)
                self._queue.append(job)
                self._lock.notify()
            job.waiters.append(future)
            self._of[id(future)] = job
        return future

    def cancel(self, future: Future) -> None:
        """Its request left: the future is cancelled, and a compile nobody else waits for is dropped (killed with
        its process if it is running)."""
        with self._lock:
            job = self._of.pop(id(future), None)
            future.cancel()
            if job is None:
                return
            job.waiters = [f for f in job.waiters if f is not future]
            if job.waiters:
                return
            del self._compiling[job.key]
            if job.slot is None:
                self._queue.remove(job)
            else:
                job.slot.kill()

    def busy(self) -> int:
        """Compiles queued or running."""
        with self._lock:
            return len(self._compiling)

    def pids(self) -> list[int]:
        """The compile processes alive now."""
        return [s.proc.pid for s in self._slots if s.proc is not None and s.proc.is_alive()]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            for job in self._compiling.values():
                for f in job.waiters:
                    f.cancel()
            self._compiling.clear()
            self._queue.clear()
        for slot in self._slots:
            slot.kill()

    # ---- the slots' side -------------------------------------------------------------------------------------
    def _next(self, slot: _Slot) -> _Compile | None:
        with self._lock:
            slot.job = None
            while not self._queue and not self._closed:
                self._lock.wait()
            if self._closed:
                return None
            job = self._queue.popleft()
            job.slot = slot
            slot.job = job
            return job

    def _wanted(self, job: _Compile) -> bool:
        with self._lock:
            return self._compiling.get(job.key) is job

    def _done(self, job: _Compile, result=None, error: BaseException | None = None) -> None:
        with self._lock:
            if self._compiling.get(job.key) is job:
                del self._compiling[job.key]
            if result is not None:
                self._remember(job.key, result)
            for f in job.waiters:  # none left when every request was aborted
                self._of.pop(id(f), None)
                if not f.done():
                    f.set_result(result) if error is None else f.set_exception(error)
            job.waiters = []

    def _remember(self, key: tuple[str, str], compiled) -> None:
        size = int(compiled.memory_size_bytes)
        if size > self.cache_bytes:
            return
        self._cache[key] = compiled
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= int(old.memory_size_bytes)
