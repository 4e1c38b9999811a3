"""The autoscaler's decision: how many workers the demand needs (docs/architecture.md, "The cluster").

Pure logic: no processes, no asyncio, no clock of its own. The caller passes the monotonic time and the wall time
with every observation and acts on `Autoscaler.desired` (starts or stops local workers, exports
inferd_desired_workers for an HPA/KEDA).

Need. One worker sustains `worker_capacity` tokens/s at the latency target and is planned at `target_utilization`
of it. The demand is the token arrival rate plus the queue's reserved tokens spread over `queue_drain_s`:

    need = ceil((arrival_tokens_per_s + queued_tokens / queue_drain_s) / (worker_capacity * target_utilization))

(a ratio within 1e-9 of a whole number counts as that number, so float noise never adds a worker). KV: when the
mean KV use is over `kv_high_water` while the need does not exceed the running workers, memory rather than compute is
short, and the target is the running workers + 1. The target is then clamped to
[max(min_workers, warm-schedule floor), max_workers].

Up at once, down after the cool-down. A target above `desired` is taken at once. Going down, `desired` becomes the
largest target of the last `scale_down_cooldown_s` seconds (each observation's target holds until the next one),
once the observations cover that long: the count drops to N only after the need stayed <= N for the whole
cool-down. So a short dip never scales down, and a higher need inside the window restarts the wait (the
stabilization window of Kubernetes' HPA). The first observation starts from max(target, running workers), so a
restarted autoscaler waits a cool-down before it stops anything.

Warm schedule. "HH:MM=N" entries, comma-separated ("07:30=4,19:00=0"). The floor at a time of day is N of the latest
entry at or before it, wrapping around midnight to the last entry of the previous day. So with a single entry the
floor holds all day, and a ramp is ended by an entry of its own (N=0: no floor beyond min_workers). The schedule is
read `warm_lead_s` seconds ahead of the wall time, so that workers started for a 07:30 ramp are loaded by 07:30.
Times are the wall-clock fields of the datetime passed in (its own time zone, or naive local time). A floor that
ends scales down like any other drop in the need: after the cool-down.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, time, timedelta

from ..config import (
    DEFAULT_KV_HIGH_WATER,
    DEFAULT_MAX_WORKERS,
    DEFAULT_MIN_WORKERS,
    DEFAULT_QUEUE_DRAIN_S,
    DEFAULT_SCALE_DOWN_COOLDOWN_S,
    DEFAULT_TARGET_UTILIZATION,
    DEFAULT_WARM_LEAD_S,
)

SECONDS_PER_DAY = 86400
_TIME_RE = re.compile(r"(\d{1,2}):(\d{2})")
_COUNT_RE = re.compile(r"[+-]?\d+")


@dataclass(frozen=True, order=True)
class WarmEntry:
    """From `at` (time of day, wall clock) until the next entry, keep at least `workers` workers."""

    at: time
    workers: int

    def __str__(self) -> str:
        return f"{self.at:%H:%M}={self.workers}"


def parse_warm_schedule(text: str) -> list[WarmEntry]:
    """`--warm-schedule`: "HH:MM=N[,HH:MM=N...]" -> entries sorted by time of day; "" -> []. ValueError on bad text."""
    if not text.strip():
        return []
    entries = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise ValueError(f"warm schedule {text!r}: empty entry (write entries as HH:MM=N, separated by commas)")
        when, sep, count = item.partition("=")
        if not sep:
            raise ValueError(f"warm schedule entry {item!r}: expected HH:MM=N, e.g. 07:30=4")
        m = _TIME_RE.fullmatch(when.strip())
        if m is None or int(m[1]) > 23 or int(m[2]) > 59:
            raise ValueError(f"warm schedule entry {item!r}: bad time {when.strip()!r} (expected HH:MM, 00:00-23:59)")
        if _COUNT_RE.fullmatch(count.strip()) is None:
            raise ValueError(f"warm schedule entry {item!r}: the worker count {count.strip()!r} is not a whole number")
        entries.append(WarmEntry(time(int(m[1]), int(m[2])), int(count)))
    return _checked_schedule(entries, f"warm schedule {text!r}")


def _checked_schedule(entries: Iterable[WarmEntry | tuple[time, int]], where: str = "warm schedule") -> list[WarmEntry]:
    out = []
    for e in entries:
        if not isinstance(e, WarmEntry):
            e = WarmEntry(*e)
        if not isinstance(e.at, time) or e.at.tzinfo is not None:
            raise ValueError(f"{where}: entry {e.at!r}={e.workers!r} needs a naive datetime.time of day")
        if isinstance(e.workers, bool) or not isinstance(e.workers, int):
            raise ValueError(f"{where}: entry {e}: the worker count must be a whole number")
        if e.workers < 0:
            raise ValueError(f"{where}: entry {e}: negative worker count")
        out.append(e)
    out.sort()
    for a, b in zip(out, out[1:]):
        if a.at == b.at:
            raise ValueError(f"{where}: {a.at:%H:%M} is given twice ({a} and {b})")
    return out


def warm_floor(schedule: list[WarmEntry], wall: datetime, lead_s: float = 0.0) -> WarmEntry | None:
    """The entry in force at the time of day `lead_s` seconds after `wall` (schedule sorted by time); None if empty."""
    if not schedule:
        return None
    ahead = (wall + timedelta(seconds=lead_s)).time()  # the wall-clock fields, without the time zone
    current = schedule[-1]  # before the first entry of the day: the last one of the previous day
    for e in schedule:
        if e.at > ahead:
            break
        current = e
    return current


def _check(name: str, value: float, low: float, high: float = math.inf, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, not {value!r}")
    if value < low or (low_open and value == low) or value > high:
        bounds = (f"> {low:g}" if low_open else f">= {low:g}") + (f" and <= {high:g}" if high != math.inf else "")
        raise ValueError(f"{name} must be {bounds}, not {value!r}")


@dataclass
class AutoscalerConfig:
    worker_capacity: float  # `--worker-capacity`: tokens/s one worker sustains at the latency target
    min_workers: int = DEFAULT_MIN_WORKERS
    max_workers: int = DEFAULT_MAX_WORKERS
    target_utilization: float = DEFAULT_TARGET_UTILIZATION  # plan workers at this share of worker_capacity
    scale_down_cooldown_s: float = DEFAULT_SCALE_DOWN_COOLDOWN_S
    queue_drain_s: float = DEFAULT_QUEUE_DRAIN_S  # drain the queue's reserved tokens within this
    kv_high_water: float = DEFAULT_KV_HIGH_WATER  # mean KV use (0..1) above which one more worker is asked for
    # entries, or (time, workers) pairs, or the `--warm-schedule` text; kept as sorted WarmEntry
    warm_schedule: list[WarmEntry] = field(default_factory=list)
    warm_lead_s: float = DEFAULT_WARM_LEAD_S  # read the schedule this many seconds ahead

    def __post_init__(self):
        if isinstance(self.warm_schedule, str):
            self.warm_schedule = parse_warm_schedule(self.warm_schedule)
        else:
            self.warm_schedule = _checked_schedule(self.warm_schedule)
        _check("worker_capacity", self.worker_capacity, 0, low_open=True)
        for name in ("min_workers", "max_workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a whole number >= 0, not {v!r}")
        if self.max_workers < max(1, self.min_workers):
            raise ValueError(f"max_workers ({self.max_workers}) must be >= 1 and >= min_workers ({self.min_workers})")
        _check("target_utilization", self.target_utilization, 0, 1, low_open=True)
        _check("scale_down_cooldown_s", self.scale_down_cooldown_s, 0)
        _check("queue_drain_s", self.queue_drain_s, 0, low_open=True)
        _check("kv_high_water", self.kv_high_water, 0, 1, low_open=True)
        _check("warm_lead_s", self.warm_lead_s, 0, SECONDS_PER_DAY)
        for e in self.warm_schedule:
            if e.workers > self.max_workers:
                raise ValueError(f"warm schedule entry {e} asks for more workers than max_workers ({self.max_workers})")


@dataclass
class Demand:
    """One observation of the load."""

    arrival_tokens_per_s: float  # tokens (prompts + expected outputs) admitted per second over a recent window
    queued_tokens: float  # reserved tokens (prompt + max_tokens) waiting in the gateway's queue
    kv_usage: float  # 0..1, mean over the workers
    current_workers: int  # workers running now

    def __post_init__(self):
        _check("arrival_tokens_per_s", self.arrival_tokens_per_s, 0)
        _check("queued_tokens", self.queued_tokens, 0)
        _check("kv_usage", self.kv_usage, 0, 1)
        if isinstance(self.current_workers, bool) or not isinstance(self.current_workers, int) \
                or self.current_workers < 0:
            raise ValueError(f"current_workers must be a whole number >= 0, not {self.current_workers!r}")


class Autoscaler:
    """Feed it `observe` every few seconds; it returns (and keeps in `desired`) the worker count to run."""

    def __init__(self, config: AutoscalerConfig):
        self.config = config
        self.desired = config.min_workers  # before the first observation
        self.reason = "no observation yet"
        self.need = 0  # the last demand's own count (before KV, floors and caps)
        self.target = 0  # the last observation's count after KV, floors and caps: desired follows it up at once
        self.floor_entry: WarmEntry | None = None  # the warm-schedule entry in force at the last observation
        self._history: deque[tuple[float, int]] = deque()  # (monotonic time, target) covering the cool-down
        self._last_now: float | None = None

    def observe(self, now_monotonic: float, wall: datetime, demand: Demand) -> int:
        c, now = self.config, now_monotonic
        if self._last_now is not None and now < self._last_now:
            raise ValueError(f"the monotonic time went back ({now} after {self._last_now})")
        per_worker = c.worker_capacity * c.target_utilization
        rate = demand.arrival_tokens_per_s + demand.queued_tokens / c.queue_drain_s
        ratio = rate / per_worker
        need = target = math.ceil(round(ratio, 9))
        demand_text = f"demand {rate:.0f} tok/s"
        if demand.queued_tokens:
            demand_text = (f"demand {demand.arrival_tokens_per_s:.0f} tok/s + {demand.queued_tokens:.0f} queued tok / "
                           f"{c.queue_drain_s:g} s = {rate:.0f} tok/s")
        parts = [f"{demand_text} / ({c.worker_capacity:g} tok/s x {c.target_utilization:g}) = {ratio:.2f} -> {need}"]
        if demand.kv_usage > c.kv_high_water and need <= demand.current_workers:
            target = demand.current_workers + 1
            parts.append(f"KV {demand.kv_usage:.0%} > {c.kv_high_water:.0%} on {demand.current_workers} workers -> "
                         f"{target}")
        self.floor_entry = warm_floor(c.warm_schedule, wall, c.warm_lead_s)
        if self.floor_entry is not None and self.floor_entry.workers > c.min_workers:
            floor = self.floor_entry.workers
            lead = f", {c.warm_lead_s:g} s ahead" if c.warm_lead_s else ""
            floor_text = f"schedule floor {floor} ({self.floor_entry}{lead})"
        else:
            floor, floor_text = c.min_workers, f"min_workers {c.min_workers}"
        if target < floor:
            target = floor
            parts.append(floor_text)
        if target > c.max_workers:
            target = c.max_workers
            parts.append(f"capped at max_workers {c.max_workers}")
        self.need, self.target = need, target

        first = self._last_now is None
        self._last_now = now
        self._history.append((now, target))
        cutoff = now - c.scale_down_cooldown_s
        while len(self._history) > 1 and self._history[1][0] <= cutoff:  # [0] holds until [1]: keep the one in force
            self._history.popleft()
        if first:
            self.desired = max(target, min(demand.current_workers, c.max_workers))
            if self.desired > target:
                parts.append(f"holding the {self.desired} running workers for the cool-down")
        elif target > self.desired:
            parts.append(f"up from {self.desired}")
            self.desired = target
        elif target < self.desired:
            peak = max(t for _, t in self._history)
            if self._history[0][0] <= cutoff and peak < self.desired:
                parts.append(f"down from {self.desired}: the need stayed <= {peak} for the "
                             f"{c.scale_down_cooldown_s:g} s cool-down")
                self.desired = peak
            else:
                since = now
                for t, n in reversed(self._history):
                    if n >= self.desired:
                        break
                    since = t
                parts.append(f"holding {self.desired}: the need is lower for {now - since:.0f} of "
                             f"{c.scale_down_cooldown_s:g} s")
        self.reason = "; ".join(parts)
        return self.desired
