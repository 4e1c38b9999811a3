"""The capacity planner against a real run: one `inferd serve` worker (the default model unless --model), `inferd
bench` at each of --rates, and the planner's simulation of the very same arrivals (bench's own seeded workload and
Poisson offsets) on a profile of this machine. Prints predicted vs measured TTFT p50/p99 and output tokens/s; per
rate also the worker's steps and busy time, real and simulated, the TTFT percentiles side by side, and the server's
own TTFT mean (receipt to first token) and receipt-to-dispatch mean, to tell where a gap is.

    .venv/bin/python -m inferd profile --out /tmp/prof        # the worker model: step times of this machine
    .venv/bin/python bench/plan_validate.py --profile /tmp/prof/profile.json --rates 0.5,1.5

    # the worker on one core, the API process and the load generator on the other (a 2-core host):
    OMP_NUM_THREADS=1 .venv/bin/python -m inferd profile --out /tmp/prof1
    .venv/bin/python bench/plan_validate.py --profile /tmp/prof1/profile.json --server-args "--threads 1"

Not a test (timing on a shared machine); the figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from inferd.bench.loadgen import BenchConfig, arrival_offsets, generate_workload
from inferd.planner.sim import Req, Simulation, StepModel, WorkerConfig


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "inferd", "serve", "--port", "0", *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    for line in proc.stdout:
        m = re.match(r"READY (http://\S+)", line)
        if m:
            return proc, m[1]
    raise RuntimeError("the server did not start")


def kv_tokens(url: str, block_size: int = 16) -> int:
    """The worker's KV pool in tokens (from its first heartbeat on)."""
    for _ in range(600):
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line.startswith("inferd_kv_blocks_total"):
                return int(float(line.rsplit(" ", 1)[1])) * block_size
        time.sleep(0.1)
    raise RuntimeError("no inferd_kv_blocks_total in /metrics")


def predict(model: StepModel, config: WorkerConfig, bench: BenchConfig) -> dict:
    rng = random.Random(bench.seed)  # what loadgen.run_benchmark draws, in the same order
    specs = generate_workload(bench, rng)
    offsets = arrival_offsets(len(specs), bench.request_rate, rng)
    reqs = [Req(t, len(s.prompt), s.output_len) for t, s in zip(offsets, specs)]
    sim = Simulation(model, config, reqs, workers=1)
    sim.run()
    duration = max(r.done for r in reqs) - min(r.t for r in reqs)
    return {"ttfts": [r.ttft for r in reqs], "output_tokens": sum(r.output for r in reqs), "duration": duration,
            "span": max(r.t for r in reqs) - min(r.t for r in reqs) or 1.0,
            "steps": sim.workers[0].steps, "busy_s": sim.workers[0].busy_s}


COUNTERS = ("inferd_engine_steps_total", "inferd_engine_busy_seconds_total",
            # the server's own view of TTFT (receipt of the request to its first token) and of its part in it
            # (receipt to dispatch to the worker: parsing, validation, tokenization): sums and counts
            "inferd_time_to_first_token_seconds_sum", "inferd_time_to_first_token_seconds_count",
            "inferd_server_dispatch_seconds_sum", "inferd_server_dispatch_seconds_count")


def counters(url: str) -> dict[str, float]:
    """The COUNTERS (summed over label sets) as the server has them now."""
    values = dict.fromkeys(COUNTERS, 0.0)
    for line in httpx.get(url + "/metrics").text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values


def mean_of(before: dict, after: dict, histogram: str) -> float:
    n = after[histogram + "_count"] - before[histogram + "_count"]
    return (after[histogram + "_sum"] - before[histogram + "_sum"]) / n if n else float("nan")


def figures(ttfts: list[float], output_tokens: int, duration: float) -> dict:
    return {"ttft_p50": float(np.percentile(ttfts, 50)), "ttft_p99": float(np.percentile(ttfts, 99)),
            "output_tok_s": output_tokens / duration}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--rates", default="0.5,1.5")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--server-args", default="", help='more `inferd serve` flags, e.g. "--threads 1" (profile with '
                    "OMP_NUM_THREADS=1 then: the worker's step times are the profile's, with a core left to the API "
                    "process and the load generator)")
    args = ap.parse_args()

    model = StepModel.load(args.profile)
    proc, url = start_server((["--model", args.model] if args.model else []) + shlex.split(args.server_args))
    rows = []
    try:
        config = WorkerConfig(kv_tokens=kv_tokens(url))
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            # a seed per rate: the same prompts again would be served from the prefix cache
            seed = args.seed + i
            bench = BenchConfig(url=url, num_prompts=args.num_prompts, input_len=args.input_len,
                                output_len=args.output_len, request_rate=rate, seed=seed)
            before = counters(url)
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                subprocess.run([sys.executable, "-m", "inferd", "bench", "--url", url, "--request-rate", str(rate),
                                "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                                "--output-len", str(args.output_len), "--seed", str(seed),
                                "--output-json", f.name], check=True, stdout=subprocess.DEVNULL)
                real = json.loads(Path(f.name).read_text())
            assert not any(real["errors"]), real["errors"]
            time.sleep(1.0)  # the last heartbeat
            after = counters(url)
            measured = figures(real["ttfts"], sum(real["output_lens"]), real["duration"])
            sim = predict(model, config, bench)
            predicted = figures(sim["ttfts"], sim["output_tokens"], sim["duration"])
            rows.append((rate, measured, predicted))
            steps = after["inferd_engine_steps_total"] - before["inferd_engine_steps_total"]
            busy = after["inferd_engine_busy_seconds_total"] - before["inferd_engine_busy_seconds_total"]
            print(f"rate {rate:g}: steps {steps:.0f} real (warm-up included) vs {sim['steps']} simulated; busy "
                  f"{busy:.1f} s vs {sim['busy_s']:.1f} s; arrivals as drawn {len(sim['ttfts']) / sim['span']:.2f} "
                  f"req/s", flush=True)
            ms = {q: float(np.percentile(real["ttfts"], q)) * 1000 for q in (10, 50, 90, 95, 99)}
            ps = {q: float(np.percentile(sim["ttfts"], q)) * 1000 for q in (10, 50, 90, 95, 99)}
            print("  TTFT percentiles (ms), measured / predicted: " +
                  ", ".join(f"p{q} {ms[q]:.0f} / {ps[q]:.0f}" for q in ms), flush=True)
            print(f"  TTFT means (ms): client {1000 * float(np.mean(real['ttfts'])):.0f}, server (receipt to first "
                  f"token) {1000 * mean_of(before, after, 'inferd_time_to_first_token_seconds'):.0f}, of which "
                  f"receipt to dispatch {1000 * mean_of(before, after, 'inferd_server_dispatch_seconds'):.1f}; "
                  f"predicted {1000 * float(np.mean(sim['ttfts'])):.0f}", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    print("| req/s | metric | measured | predicted | predicted / measured |\n|---|---|---|---|---|")
    for rate, measured, predicted in rows:
        for key in ("ttft_p50", "ttft_p99", "output_tok_s"):
            m, p = measured[key], predicted[key]
            unit = 1000 if key.startswith("ttft") else 1
            suffix = " ms" if key.startswith("ttft") else ""
            print(f"| {rate:g} | {key} | {m * unit:.0f}{suffix} | {p * unit:.0f}{suffix} | {p / m:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
