"""The API server against the offline engine on the same requests, side by side in one run.

For each concurrency C (default 1, 8, 32) the same random-token requests (`inferd bench`'s workload: prompts of
--input-len token ids, --output-len tokens each, greedy, ignore_eos) run
  1. offline: inferd's Engine in this process, at most C requests in it at once (a new one enters as one ends),
  2. served: `inferd serve` (API process + worker process) driven by `inferd bench --concurrency C`,
and the script prints output tokens/s of both and the ratio. Then one TTFT run (default: concurrency 16,
~75-token prompts, 128 output tokens) and the server's own time per request, from its /metrics histograms
(receipt to dispatch; token arrival to SSE write).

    .venv/bin/python bench/server_vs_offline.py [--concurrency 1,8,32] [--requests-per-slot 2] [--repeats 2]

The two never run at the same time (the offline engine idles while the server is measured), and they alternate,
offline then served, --repeats times per concurrency: these shared machines drift by tens of percent over minutes,
and alternating keeps that drift out of the ratio. Each measured run uses its own seed, so no run reuses the
prompts (and the prefix cache) of another.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from inferd.bench.loadgen import BenchConfig, generate_workload, run_benchmark  # noqa: E402
from inferd.config import EngineConfig  # noqa: E402


def offline(engine, config: BenchConfig) -> float:
    """Output tokens/s of the workload through the engine with at most config.concurrency requests in flight."""
    from inferd.engine import SamplingParams

    specs = generate_workload(config, random.Random(config.seed))
    pending = list(specs)
    inflight = produced = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and inflight < config.concurrency:
            spec = pending.pop(0)
            engine.add_request(spec.prompt, SamplingParams(max_tokens=spec.output_len, temperature=0.0,
                                                           ignore_eos=True))
            inflight += 1
        for out in engine.step():
            produced += len(out.new_token_ids)
            inflight -= out.finished
    return produced / (time.perf_counter() - start)


def start_server(args) -> tuple[subprocess.Popen, str]:
    extra = (["--quantize", args.quantize] if args.quantize else []) + args.serve_args.split()
    proc = subprocess.Popen([sys.executable, "-m", "inferd", "serve", "--port", "0", "--dtype", args.dtype, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline().strip()
    if not line.startswith("READY "):
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.removeprefix("READY ")


def histogram_quantile(metrics_text: str, name: str, q: float) -> float:
    """Quantile q of a Prometheus histogram, linearly interpolated inside its bucket (as PromQL does)."""
    buckets = sorted((float("inf") if le == "+Inf" else float(le), float(v))
                     for le, v in re.findall(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', metrics_text, re.M))
    total = buckets[-1][1]
    rank, prev_le, prev_count = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-12)
        prev_le, prev_count = le, count
    return prev_le


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests-per-slot", type=int, default=2, help="requests = this x concurrency (min 4)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ttft-concurrency", type=int, default=16)
    p.add_argument("--ttft-input-len", type=int, default=75)
    p.add_argument("--ttft-requests", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantize", default=None, choices=["int8", "int4"], help="both the offline engine and the server")
    p.add_argument("--serve-args", default="", help="more `inferd serve` flags, e.g. '--threads 1'")
    p.add_argument("--repeats", type=int, default=2, help="offline/served pairs per concurrency (median reported)")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    def workload(c: int, seed: int, **kw) -> BenchConfig:
        base = dict(num_prompts=max(4, args.requests_per_slot * c), input_len=args.input_len,
                    output_len=args.output_len, concurrency=c, seed=seed)
        return BenchConfig(**{**base, **kw})

    from inferd.engine import Engine

    engine = Engine.from_config(EngineConfig(dtype=args.dtype, enable_prefix_caching=True, quantize=args.quantize))
    offline(engine, workload(1, 10_000, num_prompts=1, output_len=4))  # warm-up
    proc, url = start_server(args)
    offline_tps: dict[int, list[float]] = {c: [] for c in levels}
    served: dict[int, list[dict]] = {c: [] for c in levels}
    try:
        for c in levels:
            for k in range(args.repeats):
                offline_tps[c].append(offline(engine, workload(c, seed=100 * c + 2 * k)))
                report = asyncio.run(run_benchmark(workload(c, seed=100 * c + 2 * k + 1, url=url)))
                assert report["failed"] == 0, report["errors"]
                served[c].append(report)
                print(f"concurrency {c:3d} pair {k + 1}: offline {offline_tps[c][-1]:7.1f}, served "
                      f"{report['output_throughput']:7.1f} output tok/s (served TTFT p50 "
                      f"{report['median_ttft_ms']:.0f} ms, TPOT p50 {report['median_tpot_ms']:.1f} ms)", flush=True)
        del engine
        gc.collect()
        ttft = asyncio.run(run_benchmark(BenchConfig(
            url=url, num_prompts=args.ttft_requests, input_len=args.ttft_input_len, output_len=args.output_len,
            concurrency=args.ttft_concurrency, seed=99)))
        metrics = httpx.get(url + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    print("\n| concurrency | offline engine tok/s (median) | server tok/s (median) | server / offline, per pair |")
    print("|---:|---:|---:|---:|")
    for c in levels:
        served_tps = [r["output_throughput"] for r in served[c]]
        pairs = ", ".join(f"{s / o:.2f}" for s, o in zip(served_tps, offline_tps[c]))
        print(f"| {c} | {statistics.median(offline_tps[c]):.1f} | {statistics.median(served_tps):.1f} | "
              f"{pairs} |")
    print(f"\nTTFT at concurrency {args.ttft_concurrency}, {args.ttft_requests} requests of {args.ttft_input_len} "
          f"prompt tokens and {args.output_len} output tokens: p50 {ttft['median_ttft_ms']:.0f} ms, "
          f"p90 {ttft['p90_ttft_ms']:.0f} ms, p99 {ttft['p99_ttft_ms']:.0f} ms; TPOT p50 "
          f"{ttft['median_tpot_ms']:.1f} ms; {ttft['output_throughput']:.1f} output tok/s")
    for name, what in (("inferd_server_dispatch_seconds", "receipt to dispatch"),
                       ("inferd_server_token_write_seconds", "token arrival to SSE write")):
        print(f"server's own time, {what}: p50 {1e3 * histogram_quantile(metrics, name, 0.5):.2f} ms, "
              f"p99 {1e3 * histogram_quantile(metrics, name, 0.99):.2f} ms")


if __name__ == "__main__":
    main()
