"""`inferd plan`: how many workers a day of traffic needs, at what latency and cost (the simulator: sim.py).

Traffic is a CSV, one of two kinds, told apart by its header:
- per-hour rates: `hour,requests_per_s,prompt_tokens,output_tokens` (hour 0-23; lengths per request in that hour);
  arrivals within an hour are Poisson (seeded) or, with `--arrivals uniform`, evenly spaced;
- a trace: `t,prompt_tokens,output_tokens` (t: seconds since midnight).
Either may have a `tier` column (interactive, standard, batch; absent or empty: standard): a per-hour CSV then has a
row per hour and tier, a trace a tier per request. The SLO's targets may be a tier's own (`interactive:ttft_p99=1s`);
an hour meets the SLO when each tier's requests meet theirs.

Answers:
1. per hour, the fewest workers whose requests meet the SLO in that hour (each hour simulated alone, from an empty
   fleet of N ready workers: N = 1, 2, ... up to --max-workers);
2. a day against three fleets: a fixed fleet (`--workers`, default the largest hourly need), our autoscaler (its own
   code, `Autoscaler.observe`, fed every AUTOSCALE_INTERVAL_S of simulated time with the demand the server computes;
   new workers serve after --worker-start), and the hourly minimum (an oracle fleet that changes on the hour);
   each with its SLO attainment (hours that meet it, and the share of requests within each target), worker-hours
   and cost;
3. worker-hours the autoscaler saves against the fixed fleet, and the morning ramp's latency with and without the
   warm schedule (when one is given).
"""

from __future__ import annotations

import csv
import math
import random
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import DEFAULT_AUTOSCALE_WINDOW_S, DEFAULT_TIER, TIERS
from .sim import DEFAULT_TIER_RANK, Req, Simulation, StepModel, WorkerConfig

if TYPE_CHECKING:
    from ..cluster.autoscaler import AutoscalerConfig

HOUR = 3600.0
_SLO_RE = re.compile(r"(ttft|tpot|e2e)_p(\d{1,2}(?:\.\d+)?)$")
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h)?$")
_UNIT_S = {"ms": 0.001, None: 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


# ---- inputs ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    metric: str  # ttft | tpot | e2e
    percentile: float  # 0-100
    seconds: float
    tier: str | None = None  # a tier's own target; None: every tier's

    @property
    def key(self) -> str:
        """What it measures: ttft_p99."""
        return f"{self.metric}_p{self.percentile:g}"

    def __str__(self) -> str:
        return f"{self.tier + ':' if self.tier else ''}{self.key}={format_seconds(self.seconds)}"


def parse_slo(text: str) -> list[Target]:
    """"ttft_p99=2s,interactive:tpot_p50=50ms" -> targets; ValueError naming what is wrong."""
    targets = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        tier, colon, name = name.strip().rpartition(":")
        tier = tier.strip().lower() if colon else None
        if tier is not None and tier not in TIERS:
            raise ValueError(f"SLO entry {item!r}: the tier {tier!r} is not one of {', '.join(TIERS)}")
        m = _SLO_RE.match(name.strip())
        if not sep or m is None:
            raise ValueError(f"SLO entry {item!r}: expected [TIER:]METRIC_pNN=DURATION with METRIC ttft, tpot or e2e "
                             "(e.g. ttft_p99=2s, interactive:ttft_p99=500ms)")
        d = _DURATION_RE.match(value.strip())
        if d is None:
            raise ValueError(f"SLO entry {item!r}: the duration {value.strip()!r} is not like 2s, 50ms, 5m or 1h")
        seconds = float(d[1]) * _UNIT_S[d[2]]
        percentile = float(m[2])
        if not 0 < percentile < 100 or seconds <= 0:
            raise ValueError(f"SLO entry {item!r}: the percentile must be in (0, 100) and the duration > 0")
        targets.append(Target(m[1], percentile, seconds, tier))
    if not targets:
        raise ValueError("the SLO is empty: give targets such as ttft_p99=2s,tpot_p50=50ms")
    return targets


def tier_targets(targets: list[Target]) -> list[list[Target]]:
    """Per tier rank, the targets its requests must meet: its own, and the unprefixed ones it has none of the same
    metric and percentile for (a tier's own target replaces the one for every tier)."""
    out = []
    for tier in TIERS:
        own = [t for t in targets if t.tier == tier]
        keys = {t.key for t in own}
        out.append([t for t in targets if t.tier is None and t.key not in keys] + own)
    return out


@dataclass
class Hour:
    hour: int
    requests_per_s: float
    prompt_tokens: int
    output_tokens: int
    tier: int = DEFAULT_TIER_RANK  # rank in config.TIERS


@dataclass
class Traffic:
    hours: list[Hour] | None = None  # per-hour rates (one row per hour and tier)
    trace: list[tuple] | None = None  # (t, prompt, output[, tier rank])

    def requests(self, seed: int, uniform: bool = False, hours: range = range(24)) -> list[Req]:
        """The day's requests, sorted by arrival (only those in `hours`, at their time of day)."""
        if self.trace is not None:
            return [Req(t, p, o, tier=rest[0] if rest else DEFAULT_TIER_RANK)
                    for t, p, o, *rest in self.trace if int(t // HOUR) in hours]
        rng = random.Random(seed)
        out = []
        for h in self.hours:
            if h.hour not in hours or h.requests_per_s <= 0:
                continue
            start = h.hour * HOUR
            if uniform:
                n = round(h.requests_per_s * HOUR)
                out += [Req(start + i / h.requests_per_s, h.prompt_tokens, h.output_tokens, tier=h.tier)
                        for i in range(n)]
            else:
                t = start + rng.expovariate(h.requests_per_s)
                while t < start + HOUR:
                    out.append(Req(t, h.prompt_tokens, h.output_tokens, tier=h.tier))
                    t += rng.expovariate(h.requests_per_s)
        out.sort(key=lambda r: r.t)  # an hour's tiers interleave (stable: one tier's day keeps its order)
        return out

    def tiers(self) -> list[str]:
        """The tiers that have traffic, most important first."""
        ranks = {h.tier for h in self.hours if h.requests_per_s > 0} if self.hours is not None else \
            {row[3] if len(row) > 3 else DEFAULT_TIER_RANK for row in self.trace}
        return [TIERS[t] for t in sorted(ranks)]

    def hourly(self) -> list[tuple[int, float, float]]:
        """(hour, requests/s, tokens/s (prompt + output)) for each hour 0-23, all tiers together."""
        if self.hours is not None:
            rates, tokens = [0.0] * 24, [0.0] * 24
            for h in self.hours:
                rates[h.hour] += h.requests_per_s
                tokens[h.hour] += h.requests_per_s * (h.prompt_tokens + h.output_tokens)
            return [(i, rates[i], tokens[i]) for i in range(24)]
        counts, tokens = [0] * 24, [0.0] * 24
        for t, p, o, *_ in self.trace:
            h = int(t // HOUR)
            if 0 <= h < 24:
                counts[h] += 1
                tokens[h] += p + o
        return [(i, counts[i] / HOUR, tokens[i] / HOUR) for i in range(24)]


def read_traffic(path: str | Path) -> Traffic:
    """A per-hour or trace CSV (by its header); ValueError with the line that is wrong."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        header = set(reader.fieldnames or ())  # a header without rows is a day without traffic
    hourly = {"hour", "requests_per_s", "prompt_tokens", "output_tokens"}
    trace = {"t", "prompt_tokens", "output_tokens"}
    try:
        if hourly <= header:
            hours, seen = [], {}
            for i, r in enumerate(rows, start=2):
                h = Hour(int(r["hour"]), float(r["requests_per_s"]), int(r["prompt_tokens"]),
                         int(r["output_tokens"]), row_tier(r, i))
                if not 0 <= h.hour < 24 or h.requests_per_s < 0 or h.prompt_tokens < 1 or h.output_tokens < 1:
                    raise ValueError(f"line {i}: hour 0-23, requests_per_s >= 0 and lengths >= 1 ({r})")
                if (h.hour, h.tier) in seen:
                    raise ValueError(f"line {i}: hour {h.hour} of tier {TIERS[h.tier]} appears twice (also line "
                                     f"{seen[(h.hour, h.tier)]})")
                seen[(h.hour, h.tier)] = i
                hours.append(h)
            return Traffic(hours=sorted(hours, key=lambda h: (h.hour, h.tier)))
        if trace <= header:
            out = []
            for i, r in enumerate(rows, start=2):
                t, p, o = float(r["t"]), int(r["prompt_tokens"]), int(r["output_tokens"])
                if not 0 <= t < 24 * HOUR or p < 1 or o < 1:
                    raise ValueError(f"line {i}: t in [0, 86400) and lengths >= 1 ({r})")
                out.append((t, p, o, row_tier(r, i)))
            return Traffic(trace=sorted(out))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: a row lacks a field ({e})") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    raise ValueError(f"{path}: the header must be hour,requests_per_s,prompt_tokens,output_tokens (per-hour rates) "
                     f"or t,prompt_tokens,output_tokens (a trace), each with an optional tier column; it is "
                     f"{sorted(header)}")


def row_tier(row: dict, line: int) -> int:
    """The rank of a CSV row's tier (no column or an empty cell: the default tier); ValueError naming the line."""
    name = (row.get("tier") or "").strip().lower() or DEFAULT_TIER
    if name not in TIERS:
        raise ValueError(f"line {line}: the tier {row.get('tier')!r} is not one of {', '.join(TIERS)}")
    return TIERS.index(name)


# ---- measuring ---------------------------------------------------------------------------------------------------
def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (the value at rank ceil(p/100 * n)); None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


DESCRIBED = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50", "e2e_p99")  # a tier's figures in the report


def figures(reqs: list[Req], targets: list[Target], describe: bool = False) -> dict:
    """Over the requests served: each target's percentile and the share within it (`within_METRIC`, the last target
    of that metric), over all tiers; `tiers`: the same per tier with traffic, against that tier's targets (with
    `describe`, also the DESCRIBED percentiles). `met`: every tier meets its targets. `refused`: those the engine
    refused (larger than the KV cache: no number of workers serves them)."""
    served = [r for r in reqs if not r.refused]
    out = {"requests": len(served), "refused": len(reqs) - len(served), "met": True}
    within: dict[str, list[int]] = {}  # metric -> [requests within their tier's target, requests measured]
    tiers = {}
    for rank, own in enumerate(tier_targets(targets)):
        reqs = [r for r in served if r.tier == rank]
        if not reqs:
            continue
        f = {"requests": len(reqs), "met": True}
        counted = {}
        for tg in own:
            values = [v for v in (getattr(r, tg.metric) for r in reqs) if v is not None]
            value = percentile(values, tg.percentile)
            f[tg.key] = value
            f["met"] = f["met"] and (value is None or value <= tg.seconds + 1e-9)
            counted[tg.metric] = (sum(v <= tg.seconds + 1e-9 for v in values), len(values))
            f[f"within_{tg.metric}"] = counted[tg.metric][0] / len(values) if values else 1.0
        for metric, (n, of) in counted.items():
            total = within.setdefault(metric, [0, 0])
            total[0] += n
            total[1] += of
        if describe:
            for key in DESCRIBED:
                if key not in f:
                    metric, p = key.split("_p")
                    f[key] = percentile([v for v in (getattr(r, metric) for r in reqs) if v is not None], float(p))
        tiers[TIERS[rank]] = f
        out["met"] = out["met"] and f["met"]
    for tg in targets:
        if tg.key not in out:
            out[tg.key] = percentile([v for v in (getattr(r, tg.metric) for r in served) if v is not None],
                                     tg.percentile)
    for metric in dict.fromkeys(tg.metric for tg in targets):
        n, of = within.get(metric, (0, 0))
        out[f"within_{metric}"] = n / of if of else 1.0
    out["tiers"] = tiers
    return out


def by_hour(reqs: list[Req]) -> list[list[Req]]:
    hours = [[] for _ in range(24)]
    for r in reqs:
        hours[min(23, int(r.t // HOUR))].append(r)
    return hours


# ---- the answers -------------------------------------------------------------------------------------------------
def hourly_need(model: StepModel, config: WorkerConfig, traffic: Traffic, targets: list[Target], seed: int,
                uniform: bool, max_workers: int) -> list[int | None]:
    """Per hour, the fewest ready workers whose requests of that hour (simulated alone) meet the SLO; 0 for an hour
    without requests a worker can serve (none, or all larger than the KV cache); None when even max_workers do not."""
    out = []
    for h in range(24):
        reqs = traffic.requests(seed + h, uniform, hours=range(h, h + 1))
        if not any(r.fits(config.kv_tokens) for r in reqs):
            out.append(0)
            continue
        need = None
        for n in range(1, max_workers + 1):
            fresh = [Req(r.t, r.prompt, r.output, tier=r.tier) for r in reqs]
            Simulation(model, config, fresh, workers=n).run()
            if figures(fresh, targets)["met"]:
                need = n
                break
        out.append(need)
    return out


@dataclass
class FleetRun:
    name: str
    requests: list[Req]
    worker_hours: float
    fleet_log: list[tuple[float, int]]
    decisions: list = field(default_factory=list)  # autoscaler: (t, wall, Demand, desired)


def run_fixed(model, config, reqs, workers: int) -> FleetRun:
    sim = Simulation(model, config, reqs, workers=workers)
    sim.run()
    end = max(24 * HOUR, max((r.done for r in reqs if not r.refused), default=0.0))
    return FleetRun(f"fixed {workers}", reqs, sim.worker_seconds(end) / HOUR, sim.fleet_log)


def run_hourly_minimum(model, config, reqs, need: list[int | None], min_workers: int, max_workers: int) -> FleetRun:
    counts = [max(min_workers, n if n is not None else max_workers) for n in need]
    schedule = [(h * HOUR, counts[h]) for h in range(1, 24)]
    sim = Simulation(model, config, reqs, workers=counts[0], schedule=schedule)
    sim.run()
    end = max(24 * HOUR, max((r.done for r in reqs if not r.refused), default=0.0))
    return FleetRun("hourly minimum", reqs, sim.worker_seconds(end) / HOUR, sim.fleet_log)


def run_autoscaler(model, config, reqs, autoscaler: AutoscalerConfig, start_delay_s: float, day: datetime,
                   window_s: float = DEFAULT_AUTOSCALE_WINDOW_S, name: str = "autoscaler",
                   until: float = 24 * HOUR) -> FleetRun:
    """The autoscaler's own code on simulated time: every AUTOSCALE_INTERVAL_S it gets the demand the server would
    measure (tokens of the requests that arrived in the last `window_s` per second, reserved tokens waiting in the
    line, mean KV use of ready workers) and the fleet follows its answer (new workers serve after start_delay_s;
    retired ones finish what they hold)."""
    # here, not at the top: every `inferd` command builds plan's parser, and the autoscaler's loop imports asyncio
    from ..cluster.autoscaler import Autoscaler, Demand
    from ..cluster.scaling import AUTOSCALE_INTERVAL_S

    scaler = Autoscaler(autoscaler)
    decisions = []
    state = {"i": 0, "j": 0, "tokens": 0.0}  # arrivals counted into the window: [j, i)

    def tick(sim: Simulation) -> None:
        now = sim.now
        while state["i"] < len(reqs) and reqs[state["i"]].t <= now:
            state["tokens"] += reqs[state["i"]].prompt + reqs[state["i"]].output
            state["i"] += 1
        while state["j"] < state["i"] and reqs[state["j"]].t < now - window_s:
            state["tokens"] -= reqs[state["j"]].prompt + reqs[state["j"]].output
            state["j"] += 1
        ready = [w for w in sim.workers if w.stopped is None and w.ready <= now]
        kv = sum(w.kv_at(now) / config.kv_tokens for w in ready) / len(ready) if ready else 0.0
        queued = sum(r.prompt + r.output for r in sim.queued())
        live = len(sim.live)
        demand = Demand(arrival_tokens_per_s=max(0.0, state["tokens"]) / window_s, queued_tokens=queued,
                        kv_usage=min(1.0, kv), current_workers=live)
        wall = day + timedelta(seconds=now)
        desired = scaler.observe(now, wall, demand)
        decisions.append((now, wall, demand, desired))
        if desired != live:
            sim.set_fleet(desired)

    first = max(autoscaler.min_workers, 1)
    sim = Simulation(model, config, reqs, workers=first, start_delay_s=start_delay_s, on_tick=tick,
                     tick_s=AUTOSCALE_INTERVAL_S)
    sim.run(until=until)
    end = max(until, max((r.done for r in reqs if not r.refused), default=0.0))
    return FleetRun(name, reqs, sim.worker_seconds(end) / HOUR, sim.fleet_log, decisions)


def worker_capacity(model: StepModel, config: WorkerConfig, targets: list[Target], prompt: int, output: int,
                    seed: int, seconds: float = 600.0, mix: list[float] | None = None) -> float:
    """Tokens/s (prompt + output) one worker sustains within the SLO, for requests of these lengths (their tiers
    drawn from `mix`, the share of requests per tier rank; default: all of the default tier): the largest Poisson
    rate (bisection, 10 halvings) at which `seconds` of traffic meet the SLO. What --worker-capacity should be."""
    mix = mix or [float(t == DEFAULT_TIER_RANK) for t in range(len(TIERS))]
    if not any(tier_targets(targets)[t] for t, share in enumerate(mix) if share > 0):
        raise ValueError("the SLO sets no target for the tiers of the traffic: no rate would miss it")
    if prompt + output > config.kv_tokens:
        raise ValueError(f"requests of {prompt} + {output} tokens are larger than the KV cache ({config.kv_tokens} "
                         "tokens): no rate of them meets the SLO")

    def meets(rate: float) -> bool:
        rng = random.Random(seed)
        draw = random.Random(seed + 1)  # the tiers (apart: the arrivals stay those of a one-tier day)
        reqs, t = [], rng.expovariate(rate)
        while t < seconds:
            reqs.append(Req(t, prompt, output, tier=draw.choices(range(len(TIERS)), mix)[0]))
            t += rng.expovariate(rate)
        if not reqs:
            return True
        Simulation(model, config, reqs, workers=1).run()
        return figures(reqs, targets)["met"]

    lo, hi = 0.0, 1.0
    while meets(hi) and hi < 1e4:
        lo, hi = hi, hi * 2
    for _ in range(10):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo * (prompt + output)


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.2f}s"
