"""ChildProcess: a child process for asyncio, started without the interpreter's fork hooks.

uvloop's subprocess_exec runs CPython's at-fork handlers (PyOS_BeforeFork) in the loop's thread: logging's handler
takes the logging lock, then the interpreter takes the import lock. A thread that is importing a module holds the
import lock, and if its garbage collection frees a logging handler, it waits for the logging lock: both threads
then wait for ever. That hung `inferd serve` before its READY line in about one start in three on a loaded
machine (the tokenizer importing transformers on its thread while the workers were being started).
`subprocess.Popen` without a preexec_fn runs no at-fork handler (it vforks and execs at once), so it is used here,
and the loop watches the child through a pidfd (Linux 5.3+) and reads its stdout through a pipe transport.

Popen runs on the calling thread, the event loop's: it takes milliseconds, and a child started with
--die-with-parent (PR_SET_PDEATHSIG) dies with the thread that started it, so that thread must live as long as the
server (an executor's thread would not).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading


class ChildProcess:
    """What the supervisor uses of asyncio's Process: pid, returncode, stdout (a StreamReader), wait()."""

    def __init__(self, popen: subprocess.Popen, stdout: asyncio.StreamReader, exited: asyncio.Future):
        self._popen = popen
        self.pid = popen.pid
        self.stdout = stdout
        self._exited = exited

    @classmethod
    async def start(cls, argv: list[str], env: dict[str, str]) -> ChildProcess:
        """argv started with stdin from /dev/null, stdout piped (read through .stdout) and stderr inherited."""
        loop = asyncio.get_running_loop()
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env)
        exited: asyncio.Future = loop.create_future()
        try:
            reader = asyncio.StreamReader()
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), popen.stdout)
            _watch_exit(loop, popen, exited)
        except BaseException:
            popen.kill()
            popen.wait()
            raise
        return cls(popen, reader, exited)

    @property
    def returncode(self) -> int | None:
        """The exit status once the child has exited (negative: the signal that killed it), else None."""
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        """Waits until the child has exited (any number of callers at once); its exit status."""
        return await asyncio.shield(self._exited)


def _watch_exit(loop: asyncio.AbstractEventLoop, popen: subprocess.Popen, exited: asyncio.Future) -> None:
    """Resolves exited with popen's exit status when it exits: a pidfd watched by the loop, else (no pidfd) a thread
    that waits for it."""

    def reap() -> None:
        if not exited.done():
            exited.set_result(popen.wait())  # the child has exited: this returns at once

    try:
        pidfd = os.pidfd_open(popen.pid)
    except (AttributeError, OSError):  # no pidfd (an old kernel): a thread of its own, for the child's lifetime
        threading.Thread(target=lambda: (popen.wait(), loop.call_soon_threadsafe(reap)), daemon=True,
                         name=f"inferd-wait-{popen.pid}").start()
        return

    def readable() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        reap()

    loop.add_reader(pidfd, readable)
