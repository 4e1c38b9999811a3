"""Capacity shares between tiers (issue 29), on the default model, `--tier-shares` default against `strict`, side by
side in one run:

    .venv/bin/python bench/tier_shares.py [--clients 80] [--seconds 20] [--rate 2] [--duration 60] [--lines 2000]

1. shares: tenants of the three tiers each keep --clients completions (32 tokens) in flight, more than a worker's
   68 seats; each tier's share of the completion tokens finished over --seconds (client side), against the
   configured 70 / 25 / 5;
2. interactive latency beside a batch job: Poisson arrivals at --rate requests/s of streamed chat completions
   (max_tokens 32) from an interactive tenant for --duration seconds, alone, then while a --lines Batch API job (of
   the batch tenant) runs: TTFT p50 / p99 and their ratios (target: p99 at most 1.5x alone), and the batch's lines
   per second with the interactive load and alone.
Prints tables and JSON. Run it on a quiet machine: any other process on the cores spoils the figures."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _servers import start_server  # noqa: E402
from batch_interference import QUESTIONS, completed, interactive, pct  # noqa: E402

from inferd.gateway.tenants import create_key  # noqa: E402

TIERS = ("interactive", "standard", "batch")
MODES = ("interactive=70,standard=25,batch=5", "strict")


def keys_file(folder: str) -> tuple[str, dict[str, str]]:
    path = str(Path(folder) / "keys.json")
    return path, {tier: create_key(path, tier, tier=tier)[0] for tier in TIERS}


async def backlog(url: str, keys: dict[str, str], clients: int, seconds: float) -> dict[str, int]:
    """Completion tokens each tier finished over `seconds`, after a warm-up in which every tier finished one."""
    finished: list[tuple[str, float, int]] = []
    stop = asyncio.Event()

    async def client(http: httpx.AsyncClient, tier: str, i: int) -> None:
        body = {"prompt": f"Count slowly from {i} onwards:", "max_tokens": 32, "ignore_eos": True, "temperature": 0}
        while not stop.is_set():
            try:
                r = await http.post(url + "/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {keys[tier]}"})
            except httpx.TransportError:
                continue
            if r.status_code == 200:
                finished.append((tier, time.monotonic(), r.json()["usage"]["completion_tokens"]))
            else:
                await asyncio.sleep(0.2)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as http:
        tasks = [asyncio.create_task(client(http, tier, i)) for tier in TIERS for i in range(clients)]
        t0 = time.monotonic()
        while {tier for tier, t, _ in finished if t > t0} != set(TIERS) and time.monotonic() < t0 + 300:
            await asyncio.sleep(0.2)
        start = time.monotonic()
        await asyncio.sleep(seconds)
        end = time.monotonic()
        stop.set()
        await asyncio.gather(*tasks)
    tokens = dict.fromkeys(TIERS, 0)
    for tier, t, n in finished:
        if start <= t < end:
            tokens[tier] += n
    return tokens


def shares_run(mode: str, clients: int, seconds: float) -> dict:
    folder = tempfile.mkdtemp(prefix="inferd-bench-tiers-")
    path, keys = keys_file(folder)
    server = start_server(None, ["--dtype", "auto", "--keys", path, "--tenant-queue-share", "1", "--tier-shares", mode,
                                 "--state-dir", folder, "--http-idle-per-address", "1024"], "tier-shares")
    try:
        tokens = asyncio.run(backlog(server.url, keys, clients, seconds))
    finally:
        server.kill()
    total = sum(tokens.values()) or 1
    return {"mode": mode, "tokens": tokens, "shares": {t: n / total for t, n in tokens.items()},
            "tokens_per_s": total / seconds}


def latency_run(mode: str, rate: float, duration: float, lines: int) -> dict:
    folder = tempfile.mkdtemp(prefix="inferd-bench-tiers-")
    path, keys = keys_file(folder)
    server = start_server(None, ["--dtype", "auto", "--keys", path, "--tier-shares", mode, "--state-dir", folder],
                          "tier-latency")
    vip = {"Authorization": f"Bearer {keys['interactive']}"}
    try:
        http = httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {keys['batch']}"})
        asyncio.run(interactive(server.url, 4.0, 3.0, 0, vip))  # warm-up
        alone = asyncio.run(interactive(server.url, rate, duration, 1, vip))
        text = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"messages": [{"role": "user", "content": QUESTIONS[i % 7] + f" ({i})"}],
                                            "max_tokens": 16, "temperature": 0}}) + "\n" for i in range(lines))
        f = http.post("/v1/files", files={"file": ("job.jsonl", io.BytesIO(text.encode()))},
                      data={"purpose": "batch"}).json()
        b = http.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                           "completion_window": "24h"}).json()
        while completed(http, b["id"])[0] < 10:
            time.sleep(0.2)
        n0, t0 = completed(http, b["id"])[0], time.perf_counter()
        during = asyncio.run(interactive(server.url, rate, duration, 1, vip))
        n1, t1 = completed(http, b["id"])[0], time.perf_counter()
        end = time.perf_counter() + min(duration, 30.0)
        while time.perf_counter() < end and completed(http, b["id"])[1] == "in_progress":
            time.sleep(0.5)
        n2, t2 = completed(http, b["id"])[0], time.perf_counter()
        http.post(f"/v1/batches/{b['id']}/cancel")
    finally:
        server.kill()
    return {"mode": mode, "ttft_alone": {"p50": pct(alone, 0.5), "p99": pct(alone, 0.99), "n": len(alone)},
            "ttft_with_batch": {"p50": pct(during, 0.5), "p99": pct(during, 0.99), "n": len(during)},
            "batch_lines_per_s_with_interactive": (n1 - n0) / (t1 - t0),
            "batch_lines_per_s_alone": (n2 - n1) / (t2 - t1) if t2 > t1 else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=80, help="completions in flight per tier (part 1)")
    ap.add_argument("--seconds", type=float, default=20.0, help="the measured window of part 1")
    ap.add_argument("--rate", type=float, default=2.0, help="interactive requests per second (part 2)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of interactive load, alone and beside")
    ap.add_argument("--lines", type=int, default=2000, help="lines of the batch job (part 2)")
    ap.add_argument("--only", choices=["shares", "latency"], default=None)
    ap.add_argument("--modes", default=",".join(MODES).replace(",strict", ";strict"),
                    help="the --tier-shares values to compare, separated by ';'")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(";") if m]
    result: dict = {"shares": [], "latency": []}
    if args.only in (None, "shares"):
        for mode in modes:
            result["shares"].append(shares_run(mode, args.clients, args.seconds))
        print("\nthree tiers backlogged: each tier's share of the tokens finished in "
              f"{args.seconds:g} s (configured 70 / 25 / 5)")
        print("| --tier-shares | interactive | standard | batch | tokens/s |")
        print("|---|---|---|---|---|")
        for r in result["shares"]:
            s = r["shares"]
            print(f"| {r['mode']} | {s['interactive']:.1%} | {s['standard']:.1%} | {s['batch']:.1%} | "
                  f"{r['tokens_per_s']:.0f} |")
    if args.only in (None, "latency"):
        for mode in modes:
            result["latency"].append(latency_run(mode, args.rate, args.duration, args.lines))
        print(f"\ninteractive TTFT at {args.rate:g} req/s, alone and beside a {args.lines}-line batch job")
        print("| --tier-shares | TTFT p50 alone -> beside | TTFT p99 alone -> beside | batch lines/s beside / alone |")
        print("|---|---|---|---|")
        for r in result["latency"]:
            a, d = r["ttft_alone"], r["ttft_with_batch"]
            print(f"| {r['mode']} | {a['p50'] * 1e3:.1f} -> {d['p50'] * 1e3:.1f} ms ({d['p50'] / a['p50']:.2f}x) | "
                  f"{a['p99'] * 1e3:.1f} -> {d['p99'] * 1e3:.1f} ms ({d['p99'] / a['p99']:.2f}x) | "
                  f"{r['batch_lines_per_s_with_interactive']:.1f} / {r['batch_lines_per_s_alone'] or float('nan'):.1f}"
                  " |")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
