"""`inferd plan`'s flags: the day's traffic, the SLO, the measured worker, the fleets to compare (the autoscaler's
own flags among them). The plan itself: inferd/planner/report.py."""

from __future__ import annotations

import argparse

from ..config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_TARGET_UTILIZATION,
    DEFAULT_TIER_SHARES,
    DEFAULT_WORKER_QUEUE_DEPTH,
)
from .common_args import add_autoscaler_arguments

DEFAULT_WORKER_START_S = 30.0  # a GPU worker loading its model; `inferd serve` on the CPU default model: ~5 s


def register(sub) -> None:
    pl = sub.add_parser("plan", help="capacity planner: workers needed per hour for a day of traffic, SLO "
                        "attainment and cost of a fixed fleet, the autoscaler and the hourly minimum (simulated)")
    add_plan_arguments(pl)
    pl.set_defaults(func=cmd_plan)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from ..planner.sim import WorkerConfig

    p.add_argument("--traffic", required=True, metavar="DAY.csv", help="per-hour rates (hour,requests_per_s,"
                   "prompt_tokens,output_tokens) or a trace (t,prompt_tokens,output_tokens; t in s since midnight), "
                   "each with an optional tier column (default standard)")
    p.add_argument("--slo", required=True, metavar="TARGETS", help='e.g. "ttft_p99=2s,tpot_p50=50ms" (metrics: '
                   "ttft, tpot, e2e), a target may be a tier's own: interactive:ttft_p99=500ms; an hour meets the "
                   "SLO when each tier's requests meet their targets")
    p.add_argument("--tier-shares", default=DEFAULT_TIER_SHARES, metavar="SHARES",
                   help=f"the tiers' capacity shares the servers run with (default {DEFAULT_TIER_SHARES}), or "
                   "strict (strict priority)")
    p.add_argument("--profile", required=True, metavar="PROFILE.json", help="`inferd profile`'s measured step times")
    p.add_argument("--cost-per-worker-hour", type=float, default=1.0, metavar="PRICE")
    p.add_argument("--workers", type=int, default=None, help="the fixed fleet (default: the largest hourly need)")
    p.add_argument("--arrivals", choices=["poisson", "uniform"], default="poisson",
                   help="arrivals within an hour of a per-hour CSV (default poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="plan", metavar="DIR", help="plan.md, plan.json and the PNG plots go here")
    w = p.add_argument_group("one worker (the engine's and gateway's settings of the same names)")
    w.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    w.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    w.add_argument("--worker-queue-depth", type=int, default=DEFAULT_WORKER_QUEUE_DEPTH)
    w.add_argument("--kv-tokens", type=int, default=WorkerConfig.kv_tokens,
                   help="tokens the KV cache holds (default: the default model's pool, 2912 blocks of 16)")
    a = p.add_argument_group("the autoscaler (inferd serve's flags of the same names)")
    add_autoscaler_arguments(a, "tokens/s one worker sustains within the SLO; default: what the simulator finds at "
                             "the day's mean lengths (printed: use it for inferd serve --worker-capacity)")
    a.add_argument("--target-utilization", type=float, default=DEFAULT_TARGET_UTILIZATION)
    a.add_argument("--worker-start", type=float, default=DEFAULT_WORKER_START_S, metavar="SECONDS",
                   help=f"a new worker serves this long after it is started (default {DEFAULT_WORKER_START_S:g})")


def cmd_plan(args: argparse.Namespace) -> int:
    from ..planner.report import cmd_plan as run

    return run(args)
