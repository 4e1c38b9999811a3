"""Rollouts: a new model version started beside the old one, given a canary share of new requests, then promoted
or rolled back on its measured TTFT, TPOT and error rate compared with the old version's over the same period.

States: idle -> canary -> promoted | rolled_back (then idle again for the next rollout). `promote` and `abort` are
also manual. Promotion starts new-version workers up to the old version's count, sends every new request to the
new version and retires the old workers: they take no new work, their in-flight streams finish on the version they
started on (a stream still running at the end of the grace period moves to another worker of its version, or ends
with a `shutdown` error event when there is none), and they exit when empty. A rollback retires the canary workers
the same way.

Automatic decision, once the canary has finished `min_requests` requests: roll back when its error rate is more
than `max_error_rate_increase` above the old version's, or its median TTFT or TPOT is more than `max_latency_ratio`
times the old version's; else promote (when `auto_promote`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from ..config import (
    DEFAULT_CANARY_PERCENT,
    DEFAULT_MODEL_VERSION,
    DEFAULT_ROLLOUT_MAX_ERROR_RATE_INCREASE,
    DEFAULT_ROLLOUT_MAX_LATENCY_RATIO,
    DEFAULT_ROLLOUT_MIN_REQUESTS,
    DEFAULT_ROLLOUT_MIN_SECONDS,
    ROLLOUT_MAX_LATENCY_SAMPLES,
)

log = logging.getLogger("inferd.cluster")

STATES = ("idle", "canary", "promoted", "rolled_back")
CHECK_INTERVAL_S = 0.25  # how often the controller looks at the canary's figures
MIN_BASELINE_REQUESTS = 5  # old-version requests (in the rollout's period) needed to compare latencies


class RolloutError(Exception):
    """A rollout command that cannot be carried out now (409) or is malformed (400)."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


@dataclass
class RolloutTargets:
    min_requests: int = DEFAULT_ROLLOUT_MIN_REQUESTS
    min_seconds: float = DEFAULT_ROLLOUT_MIN_SECONDS
    max_error_rate_increase: float = DEFAULT_ROLLOUT_MAX_ERROR_RATE_INCREASE
    max_latency_ratio: float = DEFAULT_ROLLOUT_MAX_LATENCY_RATIO
    auto_promote: bool = True


@dataclass
class VersionFigures:
    """What finished on one version since the rollout started."""
    requests: int = 0
    errors: int = 0  # server-side failures only (see observe)
    # the most recent samples: memory stays bounded however long a canary runs
    ttft: deque = field(default_factory=lambda: deque(maxlen=ROLLOUT_MAX_LATENCY_SAMPLES))
    tpot: deque = field(default_factory=lambda: deque(maxlen=ROLLOUT_MAX_LATENCY_SAMPLES))

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def summary(self) -> dict:
        return {"requests": self.requests, "errors": self.errors, "error_rate": round(self.error_rate, 4),
                "ttft_p50_s": _median(self.ttft), "tpot_p50_s": _median(self.tpot)}


def _median(values) -> float | None:
    return round(statistics.median(values), 6) if values else None


class RolloutController:
    def __init__(self, state, pool, targets: RolloutTargets | None, grace_period: float):
        """state: the server's ServerState (gateway, metrics); pool: its WorkerPool."""
        self.state = state
        self.pool = pool
        self.targets = targets or RolloutTargets()
        self.grace_period = grace_period
        self.status = "idle"
        self.current_version: str | None = None
        self.old_version: str | None = None
        self.new_version: str | None = None
        self.model_path: str | None = None
        self.canary_percent = 0.0
        self.reason = ""
        self.started_at: float | None = None  # time.monotonic() of the canary's start (a promotion waits min_seconds)
        self.figures: dict[str, VersionFigures] = {}
        self._paths: dict[str, str] = {}  # version -> model path (workers of a version load that)
        self._task: asyncio.Task | None = None
        self._busy = asyncio.Lock()
        base_args = pool.args_for
        pool.args_for = self._args_for  # a version's workers load the version's model
        self._base_args = base_args
        self._current_version()
        self._set_metric()

    # ---- commands (the admin API) ---------------------------------------------------------------------------
    async def start(self, model: str | None, version: str, path: str, canary_percent: float | None) -> dict:
        async with self._busy:
            if self.status == "canary":
                raise RolloutError(f"a rollout to {self.new_version} is in progress: promote or abort it first")
            current = self._current_version()
            if model is not None and model != self.state.model_name:
                raise RolloutError(f"this server serves {self.state.model_name!r}, not {model!r}", 404)
            if not version or version == current:
                raise RolloutError(f"the new version must differ from the current one ({current!r})", 400)
            if not os.path.exists(path):
                raise RolloutError(f"model path {path} does not exist", 400)
            share = DEFAULT_CANARY_PERCENT if canary_percent is None else canary_percent
            if not 0 < share <= 100:
                raise RolloutError(f"canary must be a percentage in (0, 100], got {share}", 400)
            self._paths[version] = path
            self.old_version, self.new_version, self.model_path = current, version, path
            self.canary_percent = share
            self.figures = {current: VersionFigures(), version: VersionFigures()}
            self.reason = "starting the canary workers"
            self.status = "canary"
            self.started_at = time.monotonic()
            self._set_metric()
            try:
                await self.pool.add(1, version)
            except Exception as e:
                self.status, self.reason = "rolled_back", f"the new version's worker did not start: {e}"
                self._set_metric()
                raise RolloutError(self.reason, 400) from None
            self.state.gateway.version_shares = {current: 1 - share / 100, version: share / 100}
            self.reason = f"canary: {share:g}% of new requests go to {version}"
            log.info("rollout: %s -> %s, %s", current, version, self.reason)
            self._task = asyncio.create_task(self._watch())
            return self.describe()

    async def promote(self, reason: str = "promoted by the operator") -> dict:
        async with self._busy:
            self._require_canary()
            await self._promote(reason)
            return self.describe()

    async def abort(self, reason: str = "aborted by the operator") -> dict:
        async with self._busy:
            self._require_canary()
            self._roll_back(reason)
            return self.describe()

    def describe(self) -> dict:
        return {"state": self.status, "old_version": self.old_version, "new_version": self.new_version,
                "canary_percent": self.canary_percent, "reason": self.reason,
                "shares": self.state.gateway.version_shares,
                "workers": {v: len(self.pool.of_version(v)) for v in self.pool.versions()},
                "figures": {v: f.summary() for v, f in self.figures.items()}, "targets": vars(self.targets)}

    # ---- what finished --------------------------------------------------------------------------------------
    def observe(self, version: str | None, ttft: float | None, tpot: float | None, error: bool) -> None:
        """A request finished on `version` (called by the API for every generation request that was dispatched).
        error: it failed on the server's side (the engine failed it, its worker died, a bug); a client's invalid
        request or disconnect is not the version's error."""
        figures = self.figures.get(version) if self.status == "canary" else None
        if figures is None:
            return
        figures.requests += 1
        figures.errors += error
        if ttft is not None:
            figures.ttft.append(ttft)
        if tpot is not None:
            figures.tpot.append(tpot)

    # ---- internals ------------------------------------------------------------------------------------------
    def _args_for(self, version: str) -> list[str]:
        args = list(self._base_args(version))
        path = self._paths.get(version)
        if path is not None and "--model" in args:
            args[args.index("--model") + 1] = path
        return args

    def _current_version(self) -> str:
        """The version the service runs outside a canary: the pool's first version, then each promoted one."""
        if self.current_version is None:
            versions = self.pool.versions()
            self.current_version = versions[0] if versions else DEFAULT_MODEL_VERSION
        return self.current_version

    def _require_canary(self) -> None:
        if self.status != "canary":
            raise RolloutError(f"no rollout in progress (state: {self.status})")

    async def _watch(self) -> None:
        while self.status == "canary":
            await asyncio.sleep(CHECK_INTERVAL_S)
            verdict = self.verdict()
            if verdict is None:
                continue
            async with self._busy:
                if self.status != "canary":
                    return
                ok, why = verdict
                if not ok:
                    self._roll_back(f"automatic rollback: {why}")
                elif self.targets.auto_promote:
                    await self._promote(f"automatic promotion: {why}")

    def verdict(self) -> tuple[bool, str] | None:
        """None until the canary finished min_requests; then (promote?, why)."""
        new, old = self.figures[self.new_version], self.figures[self.old_version]
        if new.requests < self.targets.min_requests:
            return None
        t = self.targets
        ran_long_enough = self.started_at is not None and time.monotonic() - self.started_at >= t.min_seconds
        if new.error_rate > old.error_rate + t.max_error_rate_increase:
            return False, (f"{self.new_version} error rate {new.error_rate:.1%} vs {old.error_rate:.1%} on "
                           f"{self.old_version} (allowed increase {t.max_error_rate_increase:.1%})")
        if old.requests >= MIN_BASELINE_REQUESTS:
            for name, a, b in (("TTFT", new.ttft, old.ttft), ("TPOT", new.tpot, old.tpot)):
                if a and b and statistics.median(a) > t.max_latency_ratio * statistics.median(b):
                    return False, (f"{self.new_version} median {name} {statistics.median(a) * 1000:.1f} ms vs "
                                   f"{statistics.median(b) * 1000:.1f} ms on {self.old_version} (allowed ratio "
                                   f"{t.max_latency_ratio:g})")
        if not ran_long_enough:  # good so far, but a promotion needs min_seconds of it
            return None
        return True, (f"{new.requests} requests on {self.new_version}, error rate {new.error_rate:.1%} "
                      f"(old {old.error_rate:.1%}), latencies within {t.max_latency_ratio:g}x")

    async def _promote(self, reason: str) -> None:
        old, new = self.old_version, self.new_version
        missing = len(self.pool.of_version(old)) - len(self.pool.of_version(new))
        if missing > 0:
            await self.pool.add(missing, new)
        self.state.gateway.version_shares = {new: 1.0}
        for worker in self.pool.of_version(old):
            self.pool.retire(worker, self.grace_period)
        self.status, self.reason = "promoted", reason
        self.current_version = new
        self._set_metric()
        log.info("rollout: %s", reason)

    def _roll_back(self, reason: str) -> None:
        old, new = self.old_version, self.new_version
        self.state.gateway.version_shares = {old: 1.0}
        for worker in self.pool.of_version(new):
            self.pool.retire(worker, self.grace_period)
        self.status, self.reason = "rolled_back", reason
        self._set_metric()
        log.warning("rollout: %s", reason)

    def _set_metric(self) -> None:
        gauge = self.state.metrics.rollout_state
        for s in STATES:
            gauge.labels(s).set(1 if s == self.status else 0)
