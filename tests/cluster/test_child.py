"""Starting a worker process runs none of the interpreter's at-fork handlers (inferd/cluster/child.py).

The hang it prevents, made certain instead of rare: a thread holds the import lock (as one importing a module does)
and, while the event loop's thread starts a child, asks for the logging lock (as its garbage collection does when it
frees a logging handler). A start that runs the at-fork handlers (uvloop's subprocess_exec) takes the logging lock,
then waits for the import lock: both threads wait for ever. ChildProcess.start takes neither.
"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import _imp, asyncio, logging, os, sys, threading, time

import uvloop

from inferd.cluster.child import ChildProcess


async def uvloop_subprocess(argv):
    return await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE)


async def main(how):
    holding = threading.Event()

    def importer():  # in the middle of an import (the import lock held), it needs the logging lock
        _imp.acquire_lock()
        holding.set()
        time.sleep(0.5)  # meanwhile the loop's thread starts the child
        with logging._lock:
            pass
        _imp.release_lock()

    thread = threading.Thread(target=importer, daemon=True)
    thread.start()
    holding.wait()
    argv = [sys.executable, "-c", "print('READY')"]
    if how == "child":
        proc = await ChildProcess.start(argv, dict(os.environ))
    else:
        proc = await uvloop_subprocess(argv)
    line = await proc.stdout.readline()
    code = await proc.wait()
    thread.join()
    print(line.decode().strip(), code, proc.returncode, flush=True)


with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
    runner.run(main(sys.argv[1]))
"""


def run(how: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=timeout)


def test_a_worker_starts_while_another_thread_imports_and_logs():
    done = run("child", timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["READY", "0", "0"], done.stdout


def test_the_child_reports_its_exit_status_to_every_waiter():
    script = r"""
import asyncio, os, sys
from inferd.cluster.child import ChildProcess

async def main():
    proc = await ChildProcess.start([sys.executable, "-c", "import sys; sys.exit(3)"], dict(os.environ))
    assert proc.returncode is None or proc.returncode == 3
    codes = await asyncio.gather(proc.wait(), proc.wait(), asyncio.wait_for(proc.wait(), 30))
    assert await proc.stdout.read() == b""
    print(codes, proc.returncode)

asyncio.run(main())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[3, 3, 3] 3", done.stdout
