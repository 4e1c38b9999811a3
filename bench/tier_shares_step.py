"""What the capacity shares cost the step: `Scheduler.schedule()` alone (no model), `--tier-shares` default against
`strict`, in one run:

    .venv/bin/python bench/tier_shares_step.py [--seats 64] [--waiting 64] [--steps 3000]

Three tiers backlogged (each keeps `--waiting` requests waiting), every seat taken, requests of 8 prompt and 32
output tokens; the time per schedule() call (median of 5 runs of --steps steps), and its ratio to strict's. A
decode step of the default model takes 15-60 ms on a 2-core CPU (docs/benchmarks.md): that is the scale it adds to."""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferd.engine import KVCacheManager, Request, SamplingParams  # noqa: E402
from inferd.engine.request import FinishReason, RequestStatus  # noqa: E402
from inferd.engine.scheduler import Scheduler  # noqa: E402
from inferd.engine.tier_shares import TierShares  # noqa: E402


def run(mode: str, seats: int, waiting: int, steps: int) -> float:
    """Seconds per schedule() call over `steps` steps."""
    kv = KVCacheManager(num_blocks=64 * seats, block_size=16, enable_prefix_caching=False)
    sched = Scheduler(kv, seats, max(256, seats), TierShares.parse(mode))
    ids = itertools.count()
    open_: list[list[Request]] = [[], [], []]

    def top_up() -> None:
        for t in range(3):
            open_[t] = [r for r in open_[t] if r.status != RequestStatus.FINISHED]
            while len(open_[t]) < waiting + seats:
                i = next(ids)
                r = Request(f"r{i}", [i % 500 + 3] * 8, SamplingParams(max_tokens=32, priority=t, ignore_eos=True),
                            arrival_seq=i)
                sched.add(r)
                open_[t].append(r)

    top_up()
    spent = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        spent += time.perf_counter() - t0
        samplers = [s.request for s in out.scheduled if s.samples]
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_tokens
        for r in samplers:
            r.token_ids.append(5)
            if r.num_output_tokens >= r.params.max_tokens:
                sched.finish(r, FinishReason.LENGTH)
        top_up()
    return spent / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seats", type=int, default=64)
    ap.add_argument("--waiting", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args()
    results = {}
    for mode in ("strict", "interactive=70,standard=25,batch=5"):
        results[mode] = statistics.median(run(mode, args.seats, args.waiting, args.steps) for _ in range(5))
    strict = results["strict"]
    for mode, t in results.items():
        print(f"{mode:40s} {t * 1e6:8.1f} us per schedule()  ({t / strict:.2f}x strict)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
