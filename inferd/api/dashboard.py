"""The live dashboard: `/dashboard` (a page with no build step and no CDN: plain JS drawing SVG) and
`/dashboard/data` (the JSON it polls).

Every number the page shows comes from the API process's Prometheus registry, the one `/metrics` renders:
`current` holds each sample under the name `/metrics` prints for it (`inferd_queue_requests{tier="batch"}`), read in
the same collect pass. What `/metrics` cannot say by itself (rates, percentiles over the last minutes, the charts)
is computed here from a history of samples the process takes every DASHBOARD_SAMPLE_S: a percentile over a window is
Prometheus' `histogram_quantile` over the growth of the histogram's buckets in that window (the first sample is taken
before the server accepts a request, so while the server is younger than the window that growth is the whole
histogram). The history keeps only the families the page derives from, for the longest window.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from importlib import resources

from ..config import (DASHBOARD_RATE_S, DASHBOARD_SAMPLE_S, DASHBOARD_TREND_S, DASHBOARD_WINDOWS_S,
                      DEFAULT_DASHBOARD_WINDOW_S, TIERS)

LATENCIES = {"ttft": "inferd_time_to_first_token_seconds", "tpot": "inferd_time_per_output_token_seconds",
             "e2e": "inferd_e2e_request_latency_seconds"}
QUANTILES = (0.5, 0.9, 0.99)
# the families whose history the page needs (rates, percentiles over a window, charts)
_HISTORY = ("inferd_prompt_tokens_total", "inferd_generation_tokens_total", "inferd_gateway_admissions_total",
            "inferd_tenant_tokens_total", "inferd_queue_requests", "inferd_queue_tier_tokens",
            "inferd_worker_requests_running", "inferd_worker_kv_usage", "inferd_desired_workers",
            "inferd_workers_attached", *(f"{name}_bucket" for name in LATENCIES.values()))


def sample_key(name: str, labels: dict[str, str]) -> str:
    """The sample's name as `/metrics` writes it (prometheus_client's text format): name{label="value",...}, the
    labels sorted by name."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def read_registry(registry) -> dict[str, float]:
    """Every sample of the registry, as `/metrics` would print it at this moment."""
    out = {}
    for family in registry.collect():
        for s in family.samples:
            out[sample_key(s.name, s.labels)] = s.value
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: buckets are (upper bound, cumulative count), sorted, ending with +Inf. The
    rank q*count falls in a bucket; the answer interpolates linearly inside it (from 0 for the first bucket). In the
    +Inf bucket it is the largest finite bound. None when there are no observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def _buckets(sample: dict[str, float], family: str, base: dict[str, float] | None = None
             ) -> list[tuple[float, float]]:
    prefix = f'{family}_bucket{{le="'
    out = []
    for key, value in sample.items():
        if key.startswith(prefix):
            bound = float(key[len(prefix):-2])
            out.append((bound, value - (base.get(key, 0.0) if base is not None else 0.0)))
    return sorted(out)


def _labelled(sample: dict[str, float], family: str, label: str) -> dict[str, float]:
    """{label value: sample value} of a family with one label (or the label named, first of several)."""
    prefix = f'{family}{{{label}="'
    out = {}
    for key, value in sample.items():
        if key.startswith(prefix):
            out[key[len(prefix):key.index('"', len(prefix))]] = value
    return out


class Dashboard:
    """The history of samples and the page's JSON. `sample()` once at start (before any request), then `run()`."""

    def __init__(self, state, sample_s: float = DASHBOARD_SAMPLE_S, clock=time.monotonic):
        self.state = state
        self.sample_s = sample_s
        self.clock = clock
        self.started = clock()
        self.history: deque[tuple[float, dict[str, float]]] = deque(
            maxlen=int(max(DASHBOARD_WINDOWS_S) / sample_s) + 2)

    def sample(self) -> None:
        now = read_registry(self.state.metrics.registry)
        self.history.append((self.clock(), {k: v for k, v in now.items() if k.startswith(_HISTORY)}))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.sample_s)
            self.sample()

    def _base(self, t: float) -> tuple[float, dict[str, float]]:
        """The latest sample taken at or before t (the oldest one when none is that old)."""
        chosen = self.history[0]
        for entry in self.history:
            if entry[0] > t:
                break
            chosen = entry
        return chosen

    def view(self, window_s: float = DEFAULT_DASHBOARD_WINDOW_S) -> dict:
        state = self.state
        t = self.clock()
        current = read_registry(state.metrics.registry)
        base_t, base = self._base(t - window_s)
        rate_t, rate_base = self._base(t - DASHBOARD_RATE_S)
        span = max(t - rate_t, 1e-9)
        latency = {}
        for short, family in LATENCIES.items():
            grown = _buckets(current, family, base)
            latency[short] = {"count": grown[-1][1] if grown else 0.0,
                              **{f"p{round(q * 100)}": histogram_quantile(q, grown) for q in QUANTILES}}
        limiter = getattr(state.gateway, "limiter", None)
        quota_window = float(getattr(limiter, "window", 60.0))
        _, quota_base = self._base(t - quota_window)
        admissions = _labelled(current, "inferd_gateway_admissions_total", "outcome")
        admissions_base = _labelled(base, "inferd_gateway_admissions_total", "outcome")
        autoscaler = state.autoscaler
        rollout = state.rollout
        return {
            "model": state.model_name,
            "uptime_s": t - self.started,
            "window_s": window_s,
            "window_covered_s": t - base_t,  # less than window_s while the server is younger than the window
            "windows_s": list(DASHBOARD_WINDOWS_S),
            "sample_s": self.sample_s,
            "rate_s": DASHBOARD_RATE_S,
            "tiers": list(TIERS),
            "current": current,
            "rates": {
                "prompt_tokens_per_s": (current.get("inferd_prompt_tokens_total", 0.0)
                                        - rate_base.get("inferd_prompt_tokens_total", 0.0)) / span,
                "generation_tokens_per_s": (current.get("inferd_generation_tokens_total", 0.0)
                                            - rate_base.get("inferd_generation_tokens_total", 0.0)) / span},
            "latency": latency,
            "admissions_in_window": {k: v - admissions_base.get(k, 0.0) for k, v in admissions.items()},
            "quota_window_s": quota_window,
            # tokens charged to each tenant within its quota's window (--rate-window), to set against its tpm
            "tenant_tokens_in_quota_window": _tenant_usage(current, quota_base),
            "series": self._series(t, window_s, current),
            "autoscaler": None if autoscaler is None else {
                "desired": autoscaler.desired, "need": autoscaler.need, "target": autoscaler.target,
                "reason": autoscaler.reason, "min_workers": autoscaler.config.min_workers,
                "max_workers": autoscaler.config.max_workers},
            "rollout": None if rollout is None else _rollout(rollout),
        }

    def _series(self, t: float, window_s: float, current: dict[str, float]) -> dict:
        points = [e for e in self.history if e[0] >= t - window_s] + [(t, current)]
        out: dict = {"t": [], "prompt_tokens_per_s": [], "generation_tokens_per_s": [], "running": [], "kv_usage": [],
                     "desired_workers": [], "attached_workers": [], "queue": {tier: [] for tier in TIERS},
                     "ttft_p50": [], "ttft_p99": [], "tpot_p50": [], "tpot_p99": []}
        previous = None
        for when, sample in points:
            out["t"].append(when - t)
            if previous is None:
                prev_t, prev = self._base(when - self.sample_s)
            else:
                prev_t, prev = previous
            dt = when - prev_t
            for key, name in (("prompt_tokens_per_s", "inferd_prompt_tokens_total"),
                              ("generation_tokens_per_s", "inferd_generation_tokens_total")):
                out[key].append((sample.get(name, 0.0) - prev.get(name, 0.0)) / dt if dt > 0 else 0.0)
            out["running"].append(sum(_labelled(sample, "inferd_worker_requests_running", "worker").values()))
            kv = list(_labelled(sample, "inferd_worker_kv_usage", "worker").values())
            out["kv_usage"].append(sum(kv) / len(kv) if kv else 0.0)
            out["desired_workers"].append(sample.get("inferd_desired_workers", 0.0))
            out["attached_workers"].append(sample.get("inferd_workers_attached", 0.0))
            queue = _labelled(sample, "inferd_queue_requests", "tier")
            for tier in TIERS:
                out["queue"][tier].append(queue.get(tier, 0.0))
            _, trailing = self._base(when - DASHBOARD_TREND_S)
            for short in ("ttft", "tpot"):
                grown = _buckets(sample, LATENCIES[short], trailing)
                out[f"{short}_p50"].append(histogram_quantile(0.5, grown))
                out[f"{short}_p99"].append(histogram_quantile(0.99, grown))
            previous = (when, sample)
        return out


def _tenant_usage(current: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """Tokens charged to each tenant's quota since `base`."""
    now = _labelled(current, "inferd_tenant_tokens_total", "tenant")
    before = _labelled(base, "inferd_tenant_tokens_total", "tenant")
    return {tenant: value - before.get(tenant, 0.0) for tenant, value in now.items()}


def _rollout(rollout) -> dict:
    return {"state": rollout.status, "old_version": rollout.old_version, "new_version": rollout.new_version,
            "current_version": rollout.current_version, "canary_percent": rollout.canary_percent,
            "reason": rollout.reason}


def page_html() -> str:
    return resources.files("inferd.api").joinpath("dashboard.html").read_text()
