"""The live dashboard: `/dashboard` (a page with no build step and no CDN: plain JS drawing SVG) and
`/dashboard/data` (the JSON it polls).

Every number the page shows comes from the API process's Prometheus registry, the one `/metrics` renders:
`current` holds each sample under the name `/metrics` prints for it (`inferd_queue_requests{tier="batch"}`), read in
the same collect pass. What `/metrics` cannot say by itself (rates, percentiles over the last minutes, the charts)
is computed here from a history of samples the process takes every DASHBOARD_SAMPLE_S: a percentile over a window is
Prometheus' `histogram_quantile` over the growth of the histogram's buckets in that window (the first sample is taken
before the server accepts a request, so while the server is younger than the window that growth is the whole
histogram). The history keeps, for the longest window, each sample's summary: the few figures the page derives from,
parsed once when the sample is taken.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import hashlib
import math
import re
import time
from collections import deque
from importlib import resources

from ..config import (
    DASHBOARD_RATE_S,
    DASHBOARD_SAMPLE_S,
    DASHBOARD_TREND_S,
    DASHBOARD_WINDOWS_S,
    DEFAULT_DASHBOARD_WINDOW_S,
    TIERS,
)

LATENCIES = {"ttft": "inferd_time_to_first_token_seconds", "tpot": "inferd_time_per_output_token_seconds",
             "e2e": "inferd_e2e_request_latency_seconds"}
QUANTILES = (0.5, 0.9, 0.99)
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


def _summary(sample: dict[str, float]) -> dict:
    """What the page derives from one sample, parsed once (the history keeps these, not the samples)."""
    out = {"prompt": 0.0, "generation": 0.0, "desired": 0.0, "attached": 0.0, "admissions": {}, "tenant_tokens": {},
           "queue": {}, "tier_generated": {}, "running": 0.0, "kv": [], "buckets": {short: [] for short in LATENCIES}}
    families = {f"{family}_bucket": short for short, family in LATENCIES.items()}
    for key, value in sample.items():
        name, _, labels = key.partition("{")
        if name == "inferd_prompt_tokens_total":
            out["prompt"] = value
        elif name == "inferd_generation_tokens_total":
            out["generation"] = value
        elif name == "inferd_desired_workers":
            out["desired"] = value
        elif name == "inferd_workers_attached":
            out["attached"] = value
        elif name == "inferd_gateway_admissions_total":
            out["admissions"][_label(labels, "outcome")] = value
        elif name == "inferd_tenant_tokens_total":
            out["tenant_tokens"][_label(labels, "tenant")] = value
        elif name == "inferd_queue_requests":
            out["queue"][_label(labels, "tier")] = value
        elif name == "inferd_tier_generated_tokens_total":
            out["tier_generated"][_label(labels, "tier")] = value
        elif name == "inferd_worker_requests_running":
            out["running"] += value
        elif name == "inferd_worker_kv_usage":
            out["kv"].append(value)
        elif name in families:
            out["buckets"][families[name]].append((float(_label(labels, "le")), value))
    for buckets in out["buckets"].values():
        buckets.sort()
    out["kv"] = sum(out["kv"]) / len(out["kv"]) if out["kv"] else 0.0
    return out


def _label(labels: str, name: str) -> str:
    """A label's value from the inside of {...} as sample_key writes it (escapes undone)."""
    marker = f'{name}="'
    i = labels.find(marker)
    if i > 0 and labels[i - 1] != ",":  # e.g. "le" inside another label's name
        i = labels.find("," + marker) + 1
    i += len(marker)
    out, j = [], i
    while labels[j] != '"':
        if labels[j] == "\\":
            j += 1
            out.append({"n": "\n"}.get(labels[j], labels[j]))
        else:
            out.append(labels[j])
        j += 1
    return "".join(out)


def _grown(now: list[tuple[float, float]], before: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """A histogram's buckets' growth between two samples (the bounds are the same: a histogram's are fixed)."""
    if len(before) != len(now):
        return now
    return [(bound, count - old) for (bound, count), (_, old) in zip(now, before)]


class Dashboard:
    """The history of samples and the page's JSON. `sample()` once at start (before any request), then `run()`."""

    def __init__(self, state, sample_s: float = DASHBOARD_SAMPLE_S, clock=time.monotonic):
        self.state = state
        self.sample_s = sample_s
        self.clock = clock
        self.started = clock()
        self.history: deque[tuple[float, dict]] = deque(maxlen=int(max(DASHBOARD_WINDOWS_S) / sample_s) + 2)

    def sample(self) -> None:
        self.history.append((self.clock(), _summary(read_registry(self.state.metrics.registry))))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.sample_s)
            self.sample()

    def _base(self, t: float, times: list[float]) -> tuple[float, dict]:
        """The latest sample taken at or before t (the oldest one when none is that old)."""
        return self.history[max(0, bisect.bisect_right(times, t) - 1)]

    def view(self, window_s: float = DEFAULT_DASHBOARD_WINDOW_S, tenants: bool = True) -> dict:
        """tenants=False: without any per-tenant figure (as /metrics without a key)."""
        state = self.state
        t = self.clock()
        current = read_registry(state.metrics.registry)
        now = _summary(current)
        if not tenants:
            current = {k: v for k, v in current.items() if 'tenant="' not in k}
        times = [e[0] for e in self.history]
        base_t, base = self._base(t - window_s, times)
        rate_t, rate_base = self._base(t - DASHBOARD_RATE_S, times)
        span = max(t - rate_t, 1e-9)
        limiter = getattr(state.gateway, "limiter", None)
        quota_window = float(getattr(limiter, "window", 60.0))
        _, quota_base = self._base(t - quota_window, times)
        latency = {}
        for short in LATENCIES:
            grown = _grown(now["buckets"][short], base["buckets"][short])
            latency[short] = {"count": grown[-1][1] if grown else 0.0,
                              **{f"p{round(q * 100)}": histogram_quantile(q, grown) for q in QUANTILES}}
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
            "rates": {"prompt_tokens_per_s": (now["prompt"] - rate_base["prompt"]) / span,
                      "generation_tokens_per_s": (now["generation"] - rate_base["generation"]) / span},
            "latency": latency,
            "admissions_in_window": {k: v - base["admissions"].get(k, 0.0) for k, v in now["admissions"].items()},
            # tokens generated for each tier within the window, and each tier's part of them (what --tier-shares
            # divides when every tier is backlogged)
            "tier_tokens_in_window": (tier_tokens := {tier: now["tier_generated"].get(tier, 0.0)
                                                      - base["tier_generated"].get(tier, 0.0) for tier in TIERS}),
            "tier_token_share_in_window": {tier: n / sum(tier_tokens.values()) if sum(tier_tokens.values()) else None
                                           for tier, n in tier_tokens.items()},
            "quota_window_s": quota_window,
            # tokens charged to each tenant within its quota's window (--rate-window), to set against its tpm
            "tenant_tokens_in_quota_window": {k: v - quota_base["tenant_tokens"].get(k, 0.0)
                                              for k, v in now["tenant_tokens"].items()} if tenants else {},
            "tenants_visible": tenants,
            "series": self._series(t, window_s, now, times),
            "autoscaler": None if autoscaler is None else {
                "desired": autoscaler.desired, "need": autoscaler.need, "target": autoscaler.target,
                "reason": autoscaler.reason, "min_workers": autoscaler.config.min_workers,
                "max_workers": autoscaler.config.max_workers},
            "rollout": None if rollout is None else _rollout(rollout),
        }

    def _series(self, t: float, window_s: float, now: dict, times: list[float]) -> dict:
        points = [e for e in self.history if e[0] >= t - window_s] + [(t, now)]
        out: dict = {"t": [], "prompt_tokens_per_s": [], "generation_tokens_per_s": [], "running": [], "kv_usage": [],
                     "desired_workers": [], "attached_workers": [], "queue": {tier: [] for tier in TIERS},
                     "tier_tokens_per_s": {tier: [] for tier in TIERS},
                     "ttft_p50": [], "ttft_p99": [], "tpot_p50": [], "tpot_p99": []}
        previous = None
        for when, sample in points:
            out["t"].append(when - t)
            prev_t, prev = previous if previous is not None else self._base(when - self.sample_s, times)
            dt = when - prev_t
            for key, field in (("prompt_tokens_per_s", "prompt"), ("generation_tokens_per_s", "generation")):
                out[key].append((sample[field] - prev[field]) / dt if dt > 0 else 0.0)
            out["running"].append(sample["running"])
            out["kv_usage"].append(sample["kv"])
            out["desired_workers"].append(sample["desired"])
            out["attached_workers"].append(sample["attached"])
            for tier in TIERS:
                out["queue"][tier].append(sample["queue"].get(tier, 0.0))
                grown = sample["tier_generated"].get(tier, 0.0) - prev["tier_generated"].get(tier, 0.0)
                out["tier_tokens_per_s"][tier].append(grown / dt if dt > 0 else 0.0)
            _, trailing = self._base(when - DASHBOARD_TREND_S, times)
            for short in ("ttft", "tpot"):
                grown = _grown(sample["buckets"][short], trailing["buckets"][short])
                out[f"{short}_p50"].append(histogram_quantile(0.5, grown))
                out[f"{short}_p99"].append(histogram_quantile(0.99, grown))
            previous = (when, sample)
        return out


def _rollout(rollout) -> dict:
    return {"state": rollout.status, "old_version": rollout.old_version, "new_version": rollout.new_version,
            "current_version": rollout.current_version, "canary_percent": rollout.canary_percent,
            "reason": rollout.reason}


def page_html() -> str:
    return resources.files("inferd.api").joinpath("dashboard.html").read_text()


def page_policy(html: str) -> str:
    """The page's Content-Security-Policy: it reads only this server, loads nothing, runs only its own script and
    style (by their hashes, not 'unsafe-inline': an injected <script> would not run) and cannot be framed."""
    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)

    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; connect-src 'self'; "
            "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
