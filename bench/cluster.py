"""The cluster's costs on this machine, side by side in one run:

    .venv/bin/python bench/cluster.py [--model PATH] [--concurrency 16] [--output-len 64] [--seconds 20]
                                      [--rounds 2] [--json PATH]

1. throughput: one worker with 2 torch threads against two workers with 1 thread each (`inferd serve --workers N
   --threads T`), a closed loop of --concurrency streamed completions (random --input-len token-id prompts, greedy,
   ignore_eos, --output-len tokens) for --seconds per round; rounds alternate (A, B, A, B) so the machine's drift
   falls on both. Output tokens/s, TTFT p50, ITL p50, and the ratio.
2. failover gap: two workers; --failover-streams streams of --failover-len tokens; once every stream has tokens,
   worker-0 is killed (kill -9). Per stream the longest pause between two chunks, for the streams that were on the
   killed worker against the ITL p50 of the others; every stream must complete.
3. drain time: one worker; --drain-streams streams of --drain-len tokens; once all run, SIGTERM to `inferd serve`
   (grace 60 s): seconds until the process exited, and whether every stream completed.

The default model is the SmolLM2 GGUF (what `make serve` runs), fp32. Servers are started and killed here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from _servers import start_server  # noqa: E402

ADMIN = "bench-admin-key"


def new_record() -> dict:
    return {"sent": time.perf_counter(), "chunks": [], "tokens": 0, "done": False, "errors": [], "worker": None,
            "finish_reason": None}


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                     rec: dict | None = None) -> dict:
    """One greedy streamed completion; rec (filled as chunks arrive, so a caller can watch progress)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0,
            "logprobs": 0, "return_tokens_as_token_ids": True}  # the logprobs entries count tokens exactly
    rec = rec if rec is not None else new_record()
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        rec["worker"] = r.headers.get("x-inferd-worker")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                rec["done"] = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                rec["errors"].append(chunk["error"]["code"])
                continue
            choice = chunk["choices"][0]
            n = len(choice["logprobs"]["tokens"]) if choice.get("logprobs") else 0
            if n:
                rec["chunks"].append(time.perf_counter())
                rec["tokens"] += n
            if choice.get("finish_reason"):
                rec["finish_reason"] = choice["finish_reason"]
    return rec


def complete(rec: dict, length: int) -> bool:
    return rec["done"] and not rec["errors"] and rec["tokens"] == length and rec["finish_reason"] == "length"


def gaps(rec: dict) -> list[float]:
    c = rec["chunks"]
    return [b - a for a, b in zip(c, c[1:])]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


async def closed_loop(url: str, concurrency: int, input_len: int, output_len: int, seconds: float) -> dict:
    stop_at = time.perf_counter() + seconds
    records: list[dict] = []

    async def loop(i: int):
        k = 0
        async with httpx.AsyncClient(timeout=600) as client:
            while time.perf_counter() < stop_at:
                [p] = prompts(1, input_len, seed=i * 1000 + k)
                records.append(await stream_one(client, url, p, output_len))
                k += 1

    start = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in records)
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "requests": len(records),
            "ttft_p50_s": pct([r["chunks"][0] - r["sent"] for r in records if r["chunks"]], 0.5),
            "itl_p50_s": pct([g for r in records for g in gaps(r)], 0.5),
            "failed": sum(1 for r in records if not complete(r, output_len))}


def throughput(args) -> dict:
    configs = {"1 worker x 2 threads": ["--workers", "1", "--threads", "2"],
               "2 workers x 1 thread": ["--workers", "2", "--threads", "1"]}
    servers = {name: start_server(args.model, extra, f"tp-{i}") for i, (name, extra) in enumerate(configs.items())}
    try:
        results: dict[str, list[dict]] = {name: [] for name in configs}
        for server in servers.values():  # warm-up (first requests pay one-off costs)
            asyncio.run(closed_loop(server.url, 2, args.input_len, 8, 2))
        for r in range(args.rounds):
            for name, server in servers.items():
                res = asyncio.run(closed_loop(server.url, args.concurrency, args.input_len, args.output_len,
                                              args.seconds))  # the idle server only sends heartbeats
                print(f"  round {r + 1} {name}: {res['tokens_per_s']:.1f} tok/s, TTFT p50 {res['ttft_p50_s']:.3f} s, "
                      f"ITL p50 {res['itl_p50_s'] * 1000:.1f} ms, failed {res['failed']}", flush=True)
                results[name].append(res)
    finally:
        for s in servers.values():
            s.kill()
    summary = {name: {"tokens_per_s": statistics.mean(r["tokens_per_s"] for r in rs),
                      "ttft_p50_s": statistics.mean(r["ttft_p50_s"] for r in rs),
                      "itl_p50_s": statistics.mean(r["itl_p50_s"] for r in rs)} for name, rs in results.items()}
    a, b = summary.values()
    summary["ratio_2w_over_1w"] = b["tokens_per_s"] / a["tokens_per_s"]
    return summary


async def running_streams(client: httpx.AsyncClient, url: str, n: int, args, length: int, seed: int
                          ) -> list[asyncio.Task]:
    """Starts n streams and returns their tasks once every one has streamed 3 chunks."""
    recs = [new_record() for _ in range(n)]
    tasks = [asyncio.create_task(stream_one(client, url, p, length, r))
             for p, r in zip(prompts(n, args.input_len, seed), recs)]
    while not all(len(r["chunks"]) >= 3 for r in recs):
        await asyncio.sleep(0.01)
    return tasks


def failover(args) -> dict:
    server = start_server(args.model, ["--workers", "2", "--threads", "1", "--admin-key", ADMIN], "failover")
    try:
        workers = httpx.get(server.url + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        pid = next(w["pid"] for w in workers["workers"] if w["worker_id"] == "worker-0")

        async def main():
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=600) as client:
                tasks = await running_streams(client, server.url, args.failover_streams, args, args.failover_len, 7)
                os.kill(pid, signal.SIGKILL)
                return await asyncio.gather(*tasks)

        recs = asyncio.run(main())
    finally:
        server.kill()
    moved = [r for r in recs if r["worker"] == "worker-0"]
    stayed = [r for r in recs if r["worker"] != "worker-0"]
    moved_gaps = [max(gaps(r)) for r in moved if len(r["chunks"]) > 1]
    return {"streams": len(recs), "moved": len(moved), "completed": sum(complete(r, args.failover_len) for r in recs),
            "failover_gap_max_s": max(moved_gaps, default=float("nan")),
            "failover_gap_p50_s": pct(moved_gaps, 0.5),
            "itl_p50_other_s": pct([g for r in stayed for g in gaps(r)], 0.5)}


def drain(args) -> dict:
    server = start_server(args.model, ["--workers", "1", "--shutdown-grace", "60"], "drain")
    try:
        async def main():
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=600) as client:
                tasks = await running_streams(client, server.url, args.drain_streams, args, args.drain_len, 9)
                sent = time.perf_counter()
                server.proc.send_signal(signal.SIGTERM)
                recs = await asyncio.gather(*tasks)
                last_token = max(r["chunks"][-1] for r in recs) - sent
                code = await asyncio.to_thread(server.proc.wait, 120)
                return recs, time.perf_counter() - sent, last_token, code

        recs, drain_s, last_token_s, code = asyncio.run(main())
    finally:
        server.kill()
    return {"streams": len(recs), "completed": sum(complete(r, args.drain_len) for r in recs),
            "drain_s": drain_s, "last_token_after_sigterm_s": last_token_s, "exit_code": code}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--failover-streams", type=int, default=8)
    p.add_argument("--failover-len", type=int, default=96)
    p.add_argument("--drain-streams", type=int, default=8)
    p.add_argument("--drain-len", type=int, default=64)
    p.add_argument("--only", default="throughput,failover,drain")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    only = set(args.only.split(","))
    result = {"machine": f"{os.cpu_count()} cores", "args": vars(args)}
    if "throughput" in only:
        print("throughput, 1 vs 2 workers:", flush=True)
        result["throughput"] = throughput(args)
        t = result["throughput"]
        for name, v in t.items():
            if name != "ratio_2w_over_1w":
                print(f"  {name:22s} {v['tokens_per_s']:8.1f} tok/s  TTFT p50 {v['ttft_p50_s']:.3f} s  "
                      f"ITL p50 {v['itl_p50_s'] * 1000:.1f} ms")
        print(f"  ratio (2 workers / 1 worker): {t['ratio_2w_over_1w']:.2f}x", flush=True)
    if "failover" in only:
        f = result["failover"] = failover(args)
        print(f"failover (kill -9 of worker-0 under {f['streams']} streams, {f['moved']} on it): {f['completed']}/"
              f"{f['streams']} complete; longest pause in a moved stream {f['failover_gap_max_s']:.2f} s (p50 "
              f"{f['failover_gap_p50_s']:.2f} s) vs ITL p50 {f['itl_p50_other_s'] * 1000:.1f} ms elsewhere",
              flush=True)
    if "drain" in only:
        d = result["drain"] = drain(args)
        print(f"drain (SIGTERM under {d['streams']} streams): {d['completed']}/{d['streams']} complete; exited "
              f"{d['drain_s']:.2f} s after the signal (last token at {d['last_token_after_sigterm_s']:.2f} s), "
              f"exit code {d['exit_code']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
