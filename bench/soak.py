"""Soak test of a whole server under misbehaving clients (issue 13): `inferd serve` on the default model, a fixed
number of concurrent clients for a long run, of which some disconnect at a random point, some ask for n=2, and a
few read slowly. It reports, per minute, requests served and status codes, the RSS of the API process and of its
worker, and at the end (after the clients stopped) whether everything came back: KV blocks in use, the gateway's
open requests and room, tenant leases.

    .venv/bin/python bench/soak.py --duration 600 --concurrency 32 --json docs/soak.json

What "good" looks like: no 5xx, RSS flat after warm-up (within 10%), served per minute without a decline, and at the
end 0 KV blocks in use and 0 open requests. Not a test: it runs for minutes and its figures depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from overload import Server, scrape, wait_ready  # noqa: E402

from inferd.bench.loadgen import SSEParser  # noqa: E402

PROMPTS = ["Tell me a story about a lighthouse keeper.", "Explain how a bicycle stays upright.",
           "Write a short poem about rain.", "List five uses for a paper clip.", "What is a prime number?",
           "Describe the water cycle to a child.", "Give me a recipe for pancakes.", "Why is the sky blue?"]


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        return None
    return None


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


class Stats:
    def __init__(self, start: float):
        self.start = start
        self.per_minute: dict[int, Counter] = {}

    def add(self, outcome: str) -> None:
        minute = int((time.monotonic() - self.start) // 60)
        self.per_minute.setdefault(minute, Counter())[outcome] += 1


async def one_request(client: httpx.AsyncClient, url: str, model: str, rng: random.Random, args) -> str:
    """One streamed chat completion; returns its outcome: ok, disconnected, slow_ok, or HTTP_<status>/<code>."""
    n = 2 if rng.random() < args.n2_share else 1
    disconnect = rng.random() < args.disconnect_share
    slow = not disconnect and rng.random() < args.slow_share
    body = {"model": model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "stream": True,
            "max_tokens": rng.randint(16, args.max_tokens), "n": n, "temperature": 0.8, "seed": rng.getrandbits(31)}
    cut_after = rng.randint(1, 40) if disconnect else None
    parser, events = SSEParser(), 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            try:
                code = r.json()["error"].get("code")
            except (ValueError, KeyError, TypeError):
                code = None
            return f"HTTP_{r.status_code}/{code}"
        async for chunk in r.aiter_raw():
            for data in parser.feed(chunk):
                events += 1
                if data == "[DONE]":
                    return "slow_ok" if slow else "ok"
                if '"error"' in data[:20]:
                    return "in_band_error"
            if cut_after is not None and events >= cut_after:
                return "disconnected"  # leaving the block drops the connection mid-stream
            if slow:
                await asyncio.sleep(args.slow_read_s)
    return "truncated"


async def client_loop(client, url, model, seed: int, deadline: float, stats: Stats, args) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        try:
            outcome = await one_request(client, url, model, rng, args)
        except httpx.HTTPError as e:
            outcome = f"transport_error/{type(e).__name__}"
        stats.add(outcome)


async def run(args) -> dict:
    command = [sys.executable, "-m", "inferd", "serve", "--port", "0", "--served-model-name", "soak",
               "--heartbeat-interval", "0.2", *args.serve_args]
    server = Server("soak", command)
    try:
        wait_ready([server])
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=httpx.Limits(
                max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)) as client:
            while (await client.get(server.url + "/ready")).status_code != 200:
                await asyncio.sleep(0.5)
            start = time.monotonic()
            deadline = start + args.duration
            stats = Stats(start)
            rss: list[dict] = []

            async def sample_rss() -> None:
                while time.monotonic() < deadline:
                    workers = children(server.proc.pid)
                    rss.append({"t": round(time.monotonic() - start, 1), "api_mb": rss_mb(server.proc.pid),
                                "worker_mb": sum(rss_mb(p) or 0 for p in workers)})
                    await asyncio.sleep(args.rss_every)

            sampler = asyncio.create_task(sample_rss())
            await asyncio.gather(*(client_loop(client, server.url, "soak", args.seed + i, deadline, stats, args)
                                   for i in range(args.concurrency)))
            sampler.cancel()
            # the clients are gone: everything must come back
            settle_deadline = time.monotonic() + 30
            while True:
                m = await scrape(client, server.url)
                end = {"kv_blocks_in_use": m.get('inferd_kv_blocks_in_use{model="soak"}'),
                       "requests_running": m.get('inferd_num_requests_running{model="soak"}'),
                       "gateway_open_requests": m.get("inferd_gateway_open_requests"),
                       "gateway_in_flight_sequences": m.get("inferd_gateway_in_flight_sequences"),
                       "settlements_pending": m.get("inferd_gateway_settlements_pending"),
                       "sse_write_timeouts": m.get("inferd_sse_write_timeouts_total")}
                if (end["kv_blocks_in_use"] == 0 and end["gateway_open_requests"] == 0
                        and end["gateway_in_flight_sequences"] == 0) or time.monotonic() > settle_deadline:
                    break
                await asyncio.sleep(0.5)
            statuses = Counter()
            for name, value in m.items():
                if name.startswith("inferd_requests_total{") and 'route="/v1/chat/completions"' in name:
                    statuses[name.split('status="')[1].split('"')[0]] += int(value)
    finally:
        server.stop()
    minutes = [{"minute": k, **dict(v), "served": v["ok"] + v["slow_ok"]} for k, v in sorted(stats.per_minute.items())]
    warm = [s for s in rss if s["t"] >= args.warmup]
    return {"command": " ".join(sys.argv), "duration_s": args.duration, "concurrency": args.concurrency,
            "per_minute": minutes, "rss": rss, "statuses": dict(statuses), "end": end,
            "rss_growth_after_warmup": {
                k: (round(warm[-1][k] / warm[0][k] - 1, 4) if warm and warm[0][k] else None)
                for k in ("api_mb", "worker_mb")}}


def print_report(result: dict) -> None:
    print(f"soak: {result['duration_s']} s at concurrency {result['concurrency']}")
    print("minute  served  disconnected  slow_ok  other")
    for row in result["per_minute"]:
        other = {k: v for k, v in row.items() if k not in ("minute", "served", "ok", "slow_ok", "disconnected")}
        print(f"{row['minute']:>6}  {row['served']:>6}  {row.get('disconnected', 0):>12}  {row.get('slow_ok', 0):>7}  "
              f"{other or ''}")
    print("HTTP statuses (chat completions):", result["statuses"])
    rss = result["rss"]
    if rss:
        print(f"RSS MB, API: first {rss[0]['api_mb']:.0f}, last {rss[-1]['api_mb']:.0f}; worker: first "
              f"{rss[0]['worker_mb']:.0f}, last {rss[-1]['worker_mb']:.0f}; growth after warm-up: "
              f"{result['rss_growth_after_warmup']}")
    print("at the end:", result["end"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128, help="each request asks for 16..this many tokens")
    p.add_argument("--disconnect-share", type=float, default=0.10, help="requests whose client leaves mid-stream")
    p.add_argument("--n2-share", type=float, default=0.25, help="requests with n=2")
    p.add_argument("--slow-share", type=float, default=0.03, help="requests whose client reads one chunk at a time")
    p.add_argument("--slow-read-s", type=float, default=0.5, help="a slow reader's pause between two reads")
    p.add_argument("--warmup", type=float, default=60.0, help="RSS growth is measured from this second on")
    p.add_argument("--rss-every", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("serve_args", nargs="*", help="extra `inferd serve` arguments (after --)")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = asyncio.run(run(args))
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
