"""Fault injection for tests: the INFERD_FAULT environment variable makes a worker crash, hang or fail at a chosen
engine step, so that failure tests are deterministic. Unset (the default), nothing here runs.

    INFERD_FAULT="action=crash,phase=decode,step=5"   [,worker=worker-1] [,version=v2] [,times=1] [,ms=20] [,seed=7]

- action: crash (SIGKILL itself: the process vanishes mid-step), hang (SIGSTOP itself: alive, silent; SIGCONT
  resumes it), fail (the step raises: the requests in it fail, the worker carries on), slow (the step takes `ms`
  milliseconds longer: a tiny model then streams at a big one's pace, so a test can act while streams run).
- phase: prefill (a step in which some request still has prompt tokens to compute), decode (every other step), or
  any. step: the N-th step of that phase (1-based) in this process.
- worker / version: act only in the worker with this id / serving this model version (others ignore the setting).
- times: how many steps act, from the N-th on (default 1; 0 = every one). A crashed or hung worker acts once.
- seed: act only in steps that run a request sampled with this seed (a test marks its victim with it): `step`
  counts those steps (phase is ignored), and on a model engine the fault strikes once the step has scheduled its
  batch (fail: the step's own requests fail, the others carry on). On the echo engine: before a step while such a
  request runs.

The local supervisor passes the setting to a worker's first start only, so a restarted worker runs clean.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

log = logging.getLogger("inferd.worker")

ENV = "INFERD_FAULT"
ACTIONS = ("crash", "hang", "fail", "slow")
PHASES = ("prefill", "decode", "any")


class InjectedFault(RuntimeError):
    """The engine step failure that action=fail raises."""


@dataclass
class FaultSpec:
    action: str
    phase: str = "any"
    step: int = 1
    worker: str | None = None
    version: str | None = None
    times: int = 1
    ms: float = 0.0
    seed: int | None = None

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        fields: dict[str, str] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or not value:
                raise ValueError(f"{ENV}: expected key=value, got {part!r}")
            fields[key] = value
        unknown = set(fields) - {"action", "phase", "step", "worker", "version", "times", "ms", "seed"}
        if unknown:
            raise ValueError(f"{ENV}: unknown key(s) {', '.join(sorted(unknown))}")
        if fields.get("action") not in ACTIONS:
            raise ValueError(f"{ENV}: action must be one of {', '.join(ACTIONS)}, got {fields.get('action')!r}")
        if fields.get("phase", "any") not in PHASES:
            raise ValueError(f"{ENV}: phase must be one of {', '.join(PHASES)}, got {fields['phase']!r}")
        try:
            step, times, ms = int(fields.get("step", 1)), int(fields.get("times", 1)), float(fields.get("ms", 0))
            seed = int(fields["seed"]) if "seed" in fields else None
        except ValueError:
            raise ValueError(f"{ENV}: step, times and seed must be integers, ms a number") from None
        if step < 1 or times < 0 or not 0 <= ms < 60_000:
            raise ValueError(f"{ENV}: step must be >= 1, times >= 0, ms in [0, 60000)")
        return cls(fields["action"], fields.get("phase", "any"), step, fields.get("worker"), fields.get("version"),
                   times, ms, seed)


class FaultInjector:
    """Called by the engine loop before every step; acts when the spec's step of its phase comes."""

    def __init__(self, spec: FaultSpec):
        self.spec = spec
        self.counts = {"prefill": 0, "decode": 0, "any": 0}
        self.fired = 0
        self._watching = False  # seed: the engine calls _scheduled in each step

    @classmethod
    def from_env(cls, worker_id: str, version: str) -> FaultInjector | None:
        text = os.environ.get(ENV)
        if not text:
            return None
        spec = FaultSpec.parse(text)
        if (spec.worker is not None and spec.worker != worker_id) or \
                (spec.version is not None and spec.version != version):
            return None
        log.warning("fault injection armed in worker %s: %s", worker_id, text)
        return cls(spec)

    def before_step(self, engine) -> None:
        if self.spec.seed is not None:
            self._before_step_of_seed(engine)
            return
        phase = step_phase(engine)
        self.counts[phase] += 1
        self.counts["any"] += 1
        self._count_and_act(self.counts[self.spec.phase], self.spec.phase)

    def _before_step_of_seed(self, engine) -> None:
        """Counts, from inside each step, the steps that run a request sampled with the spec's seed: the engine
        calls back once it knows the step's requests (EngineProtocol.on_schedule; the echo engine: those running
        when its step starts)."""
        if not self._watching:
            engine.on_schedule(self._scheduled)
            self._watching = True

    def _scheduled(self, seeds: list[int | None]) -> None:
        if self.spec.seed in seeds:  # the batch is scheduled: the fault strikes inside the step
            self.counts["any"] += 1
            self._count_and_act(self.counts["any"], f"seed {self.spec.seed}")

    def _count_and_act(self, n: int, where: str) -> None:
        spec = self.spec
        if n < spec.step or (spec.times and self.fired >= spec.times):
            return
        self.fired += 1
        if spec.action == "slow":
            time.sleep(spec.ms / 1000)
            return
        log.warning("injected fault: %s at %s step %d", spec.action, where, n)
        if spec.action == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.action == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raise InjectedFault(f"injected fault at {where} step {n}")


def step_phase(engine) -> str:
    """prefill when some request still has prompt tokens to compute before its next token, else decode."""
    for request in engine.requests.values():
        computed = getattr(request, "num_computed_tokens", None)
        if computed is None:  # the echo engine: a request's first step is its prefill
            if request.num_output_tokens == 0:
                return "prefill"
        elif len(request.token_ids) - computed > 1:
            return "prefill"
    return "decode"
