"""The time budget of a request's grammar work in the shared step: mask fills and token accepts run on a small pool of
threads (xgrammar releases the GIL in both), and the step waits for each request's work no longer than its budget.

Why: a matcher's cost per token depends on the grammar, and an ambiguous one of a few dozen characters
(root ::= x*, x ::= "a" | "aa" | x x) grows ~n^3 with the output: 0.1 s per token after ~100 tokens, 0.6 s after 175.
Inside the step that time is every other request's latency too. So:
- mask fills start before the forward pass and run beside it (on a GPU host, or with cores to spare, they cost the
  step nothing); accepts run after sampling, all requests' at once;
- each request's work of a step is timed where it runs, in CPU time of its thread (GrammarWork says why); past its
  budget per sampled row the step stops waiting for it: the request ends with GrammarTooSlow and its thread finishes
  the call alone (a C++ call cannot be interrupted; the request's matcher is never touched again);
- the seconds a request spent are summed, and past its whole budget it ends the same way (a grammar just under the
  step budget would otherwise tax its neighbours for as long as it runs);
- a job that has not started when its budget is over (every thread busy with abandoned calls) is not held against
  its request: it runs on the step's own thread, timed like the others.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GRAMMAR_TOO_SLOW = "grammar_too_slow"  # the error code clients see (a 400)


class GrammarTooSlow(RuntimeError):
    """A request's grammar spent its time budget (a mask, an accept or its compile)."""
    code = GRAMMAR_TOO_SLOW


@dataclass(eq=False)
class Job:
    owner: Any  # whose budget it spends (a Request)
    fn: Callable[[], Any]
    budget_s: float  # of CPU time
    future: concurrent.futures.Future | None = None
    clock: int | None = None  # the CPU-time clock of the thread running it, once started
    cpu_start: float = 0.0
    result: Any = None
    seconds: float = 0.0  # the CPU time it took (so far, for one abandoned)
    too_slow: bool = False

    def _run(self) -> Any:
        clock = time.pthread_getcpuclockid(threading.get_ident())
        self.cpu_start = time.clock_gettime(clock)
        self.clock = clock  # last: wait() reads cpu_start once it sees the clock
        out = self.fn()
        self.seconds = time.clock_gettime(clock) - self.cpu_start
        return out

    def cpu_used(self) -> float:
        return time.clock_gettime(self.clock) - self.cpu_start


class GrammarWork:
    """Runs Jobs on `threads` threads; wait() returns once every job finished or used more CPU time than its budget.

    CPU time, not wall time: beside the forward pass (and other jobs, on few cores) a call waits for a core and for
    the GIL, and that is not its grammar's cost; an honest mask must not be failed because the machine is busy. A
    grammar past its budget of CPU has held the step at most that long plus what the machine's load added."""

    def __init__(self, threads: int):
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="inferd-grammar-mask")

    def start(self, jobs: list[Job]) -> float:
        """Submits the jobs; returns the time they were submitted (wait's reference for jobs not started)."""
        for job in jobs:
            job.future = self._pool.submit(job._run)
        return time.monotonic()

    def wait(self, jobs: list[Job], submitted: float) -> None:
        """Until each job is done (job.result, job.seconds) or too slow (job.too_slow: it used its budget of CPU
        time; it is left to finish alone, its request never touches it again). A job that no thread started within
        its budget (every thread busy with abandoned calls) runs here, timed like the others."""
        pending = [j for j in jobs if not j.future.done()]
        while pending:
            now = time.monotonic()
            # the soonest any job could be over its budget: a thread uses at most one second of CPU per second
            wake = min(now + max(j.budget_s - j.cpu_used(), 0.0) if j.clock is not None else submitted + j.budget_s
                       for j in pending)
            if wake > now:
                concurrent.futures.wait([j.future for j in pending], timeout=wake - now,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
            now = time.monotonic()
            still = []
            for j in pending:
                if j.future.done():
                    continue
                if j.clock is None and now >= submitted + j.budget_s and j.future.cancel():
                    j.future = _done_future(j._run())  # every thread is busy: not this request's fault
                elif j.clock is not None and j.cpu_used() >= j.budget_s:
                    j.too_slow = True
                    j.seconds = j.cpu_used()
                else:
                    still.append(j)
            pending = still
        for j in jobs:
            if not j.too_slow:
                j.result = j.future.result()  # an exception of the job's own (a bug) is raised here: the step fails

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _done_future(result: Any) -> concurrent.futures.Future:
    f: concurrent.futures.Future = concurrent.futures.Future()
    f.set_result(result)
    return f
