"""The autoscaler at work: every AUTOSCALE_INTERVAL_S it feeds the gateway's demand (token arrival rate, queued
tokens, KV use) to the Autoscaler (inferd/cluster/autoscaler.py), exports the answer as `inferd_desired_workers` (for
a Kubernetes HPA/KEDA), and, with local workers and --autoscale, starts or retires worker processes to match it.
Retiring drains: the least loaded worker takes no new work and exits once its streams are done."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime

from ..config import DEFAULT_AUTOSCALE_WINDOW_S
from .autoscaler import Autoscaler, AutoscalerConfig, Demand

log = logging.getLogger("inferd.cluster")

AUTOSCALE_INTERVAL_S = 1.0


def demand(state, current_workers: int, window: float) -> Demand:
    gateway, router = state.gateway, state.router
    usage = [s.kv_blocks_in_use / s.kv_num_blocks for w in router.workers
             if (s := w.latest_stats) is not None and s.kv_num_blocks and w.dead is None]
    return Demand(arrival_tokens_per_s=gateway.arrival_rate(time.perf_counter(), window),
                  queued_tokens=gateway.queue.num_tokens,
                  kv_usage=sum(usage) / len(usage) if usage else 0.0, current_workers=current_workers)


async def run_autoscaler(config: AutoscalerConfig, state, pool, grace_period: float, act: bool = True,
                         window: float = DEFAULT_AUTOSCALE_WINDOW_S) -> None:
    """act=False: compute and export only (the workers are someone else's to scale). window: seconds over which
    the token arrival rate is measured."""
    scaler = Autoscaler(config)
    state.autoscaler = scaler  # inferd_desired_workers reads scaler.desired from here on
    while True:
        await asyncio.sleep(AUTOSCALE_INTERVAL_S)
        version = state.rollout.current_version if state.rollout is not None else None
        workers = pool.of_version(version) if (pool is not None and version) else \
            (pool.workers if pool is not None else [w for w in state.router.workers if w.dead is None])
        before = scaler.desired
        desired = scaler.observe(time.monotonic(), datetime.now(), demand(state, len(workers), window))
        if desired != before:
            log.info("autoscaler: %d worker(s): %s", desired, scaler.reason)
        if not act or pool is None:
            continue
        try:
            if desired > len(workers):
                await pool.add(desired - len(workers), version or workers[0].version)
            for _ in range(len(workers) - desired):
                victim = pool.least_loaded(version)
                if victim is not None:
                    pool.retire(victim, grace_period)
        except Exception as e:  # a worker that cannot start: try again at the next tick
            log.error("autoscaler could not reach %d workers: %s", desired, e)
