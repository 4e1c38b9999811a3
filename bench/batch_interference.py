"""What a Batch API job costs interactive traffic, and what interactive traffic costs the job (issue 17), on the
default model, one server, in one run:

    .venv/bin/python bench/batch_interference.py [--lines 2000] [--line-tokens 16] [--rate 1.0] [--duration 40]

1. interactive alone: Poisson arrivals at --rate requests/s of streamed chat completions (max_tokens 32) for
   --duration seconds: TTFT p50 / p99;
2. a --lines batch job submitted, then the same interactive load while it runs: TTFT p50 / p99, and the batch's
   lines completed per second meanwhile;
3. the interactive load stopped: the batch's lines per second alone (over --duration seconds or until it ends).
Prints a table, the TTFT ratios (target: at most 1.2x) and JSON."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _servers import start_server  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Say hello in Spanish.",
             "What is 2 + 2?", "Give me a fruit.", "Who wrote Hamlet?", "What is water made of?"]


async def interactive(url: str, rate: float, duration: float, seed: int, headers: dict | None = None) -> list[float]:
    """TTFTs (s) of Poisson arrivals over duration seconds (headers: e.g. a tenant's key)."""
    rng = random.Random(seed)
    ttfts: list[float] = []

    async def one(client, q):
        t0 = time.perf_counter()
        async with client.stream("POST", url + "/v1/chat/completions", headers=headers, json={
                "messages": [{"role": "user", "content": q}], "max_tokens": 32, "temperature": 0,
                "stream": True}) as r:
            first = True
            async for line in r.aiter_lines():
                if first and line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    ttfts.append(time.perf_counter() - t0)
                    first = False

    async with httpx.AsyncClient(timeout=300) as client:
        tasks, end = [], time.perf_counter() + duration
        while time.perf_counter() < end:
            tasks.append(asyncio.create_task(one(client, rng.choice(QUESTIONS))))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return ttfts


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def completed(client: httpx.Client, batch_id: str) -> tuple[int, str]:
    b = client.get(f"/v1/batches/{batch_id}").json()
    return b["request_counts"]["completed"] + b["request_counts"]["failed"], b["status"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--line-tokens", type=int, default=16)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=40.0)
    args = ap.parse_args()
    import tempfile

    state = tempfile.mkdtemp(prefix="inferd-bench-batches-")
    server = start_server(None, ["--dtype", "auto", "--state-dir", state], "batch-interference")
    result: dict = {}
    try:
        http = httpx.Client(base_url=server.url, timeout=120)
        asyncio.run(interactive(server.url, 4.0, 3.0, 0))  # warm-up
        alone = asyncio.run(interactive(server.url, args.rate, args.duration, 1))
        lines = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"messages": [{"role": "user", "content": QUESTIONS[i % 7] + f" ({i})"}],
                                             "max_tokens": args.line_tokens, "temperature": 0}}) + "\n"
                        for i in range(args.lines))
        f = http.post("/v1/files", files={"file": ("job.jsonl", io.BytesIO(lines.encode()))},
                      data={"purpose": "batch"}).json()
        b = http.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                           "completion_window": "24h"}).json()
        while completed(http, b["id"])[0] < 10:  # running
            time.sleep(0.2)
        n0, t0 = completed(http, b["id"])[0], time.perf_counter()
        during = asyncio.run(interactive(server.url, args.rate, args.duration, 1))
        n1, t1 = completed(http, b["id"])[0], time.perf_counter()
        end = time.perf_counter() + args.duration
        while time.perf_counter() < end and completed(http, b["id"])[1] == "in_progress":
            time.sleep(0.5)
        n2, t2 = completed(http, b["id"])[0], time.perf_counter()
        result = {"lines": args.lines, "line_tokens": args.line_tokens, "rate": args.rate,
                  "ttft_alone": {"p50": pct(alone, 0.5), "p99": pct(alone, 0.99), "n": len(alone)},
                  "ttft_with_batch": {"p50": pct(during, 0.5), "p99": pct(during, 0.99), "n": len(during)},
                  "batch_lines_per_s_with_interactive": (n1 - n0) / (t1 - t0),
                  "batch_lines_per_s_alone": (n2 - n1) / (t2 - t1) if t2 > t1 else None}
        http.post(f"/v1/batches/{b['id']}/cancel")
    finally:
        server.kill()
    a, d = result["ttft_alone"], result["ttft_with_batch"]
    print(f"interactive TTFT alone:      p50 {a['p50'] * 1e3:7.1f} ms  p99 {a['p99'] * 1e3:7.1f} ms  "
          f"({a['n']} requests)")
    print(f"with the batch job running:  p50 {d['p50'] * 1e3:7.1f} ms  p99 {d['p99'] * 1e3:7.1f} ms  "
          f"({d['n']} requests)  ratios {d['p50'] / a['p50']:.2f}x / {d['p99'] / a['p99']:.2f}x")
    print(f"batch lines/s: {result['batch_lines_per_s_with_interactive']:.2f} with interactive load, "
          f"{result['batch_lines_per_s_alone'] or float('nan'):.2f} alone")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
