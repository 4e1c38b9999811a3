"""Does fair sharing protect a light tenant from a heavy one? Three phases side by side in one run, same seeds:

  (a) B alone                                  (server 1: --fairness vtc)
  (b) A + B, the line ordered by VTC           (server 1 again, after (a): nothing of (a) is left in the line)
  (c) A + B, the line ordered FCFS             (server 2: --fairness fcfs)

    .venv/bin/python bench/fairness.py [--echo] [--model PATH] [--b-requests 20] [--ttft-target 2] [--json PATH]

Tenant A (heavy): a closed loop that keeps --a-concurrency (16) non-streaming requests outstanding, each a fresh
random prompt of --a-input-len (400) token ids and --a-output-len (32) tokens (ignore_eos, greedy).
Tenant B (light): one request at a time, back to back, --b-requests (20) of them, each a random prompt of
--b-input-len (16) token ids and --b-output-len (16) tokens, streamed. B's prompts are the same list in every phase
(a 16-token prompt is one block: the prefix cache cannot match any of it, so reusing them across phases on one
server gives B nothing). A's prompts come from per-connection seeded generators, the same in (b) and (c).

Server settings that make the gateway's line, not the engine, decide the order: --max-num-seqs 4 and
--worker-queue-depth 0 (the worker holds only what it runs; the other 12 of A's requests wait in the line), and
--kv-cache-bytes 256M (enough for 4 x 432 tokens many times over). Both servers are started at once before the
first phase (start-up is the slow part); the idle one only sends heartbeats.

A is warmed up before B starts: until the line holds most of A's backlog and for at least --a-warmup seconds (30,
the window over which the gateway measures its drain rate), so that B meets a steady state. (The first version of
the gateway measured its drain rate over wall time, idle included, and refused A's first requests with 503 after a
quiet spell; it now counts busy time only. A's answers during the warm-up are still reported on their own row, with
the first refusals' messages, should that ever come back.)

What is measured, per phase, over the window from B's first request to B's last answer:
  - B's TTFT, client-side: sending the request to the first SSE chunk that carries a token.
  - B's dispatched-ahead (the `x-inferd-dispatched-ahead` header: requests the gateway dispatched while this one
    waited). A stream's response headers carry the x-inferd-* headers only when its first token came before the
    keep-alive interval, so the servers run with --sse-keepalive 120: a stream's headers then always wait for its
    first token (the TTFT measured is the same: the first chunk cannot come before the headers), and one streamed
    request gives both figures. A request still waiting after 120 s would show up as "missing".
  - goodput: B requests per second of the window that were 200 and met --ttft-target (2 s).
  - service, from /metrics differenced over the window: inferd_tenant_service_total{tenant} (VTC units: prompt
    tokens x 1 at dispatch + generated tokens x 2 as they come, over the tenant's weight; the server counts it
    under either policy) as the ratio A:B and B's share; B's share of tokens from inferd_tenant_tokens_total
    (prompt + generated tokens charged at the end of each request).
  - A's throughput: A's requests and output tokens completed per second of the window, so that what fairness costs
    A is visible. The phases run one after the other (a policy is a server's setting, and a phase needs minutes),
    so a drift of the machine between (b) and (c) lands in this ratio; B's TTFT differs by far more than that.

Time: under FCFS each of B's requests waits behind A's whole backlog (~12 A requests, about 1 request/s on 2 CPU
cores with the real model: ~11 s each), so a phase stops sending B requests after --max-phase-seconds (45) and
reports how many it got (n; its p99 is then nearly its max); with --echo everything is fast and all --b-requests
run. B honours Retry-After (up to 5 s) after a refusal. The default run (real model) takes about 3.5 minutes on a
2-core machine (~25 s of it starting the servers), --echo about 40 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import select
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from inferd.gateway.tenants import create_key  # noqa: E402

LOW_TOKEN_ID = 1000  # random prompt ids come from [LOW_TOKEN_ID, --vocab-size): clear of special and byte tokens
READY_TIMEOUT_S = 300.0
HTTP_TIMEOUT = httpx.Timeout(600.0, connect=30.0)
REFUSED_PAUSE_S = 0.2  # A's connection pauses this long after a refusal before its next request
MAX_RETRY_AFTER_WAIT_S = 5.0  # B honours Retry-After after a refusal, up to this
SSE_KEEPALIVE_S = 120.0  # so that a stream's headers (with x-inferd-dispatched-ahead) wait for its first token
PHASES = ("alone", "vtc", "fcfs")
PHASE_TITLES = {"alone": "(a) B alone", "vtc": "(b) A+B, vtc", "fcfs": "(c) A+B, fcfs"}


# ---- servers ----------------------------------------------------------------------------------------------------
class Server:
    def __init__(self, name: str, command: list[str]):
        self.name, self.command = name, command
        self.log = tempfile.NamedTemporaryFile(prefix=f"fairness-{name}-", suffix=".log", delete=False)
        env = {k: v for k, v in os.environ.items() if k != "INFERD_API_KEY"}
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, start_new_session=True,
                                     env=env, cwd=REPO)
        self.url = ""

    def stop(self) -> None:
        """SIGTERM to the whole group (its worker too), SIGKILL if it lingers."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)


def wait_ready(servers: list[Server], timeout: float = READY_TIMEOUT_S) -> None:
    """Reads each server's first stdout line (`READY http://HOST:PORT`), all of them at once."""
    deadline = time.monotonic() + timeout
    pending = {s.proc.stdout.fileno(): (s, b"") for s in servers}
    while pending:
        remaining = deadline - time.monotonic()
        readable = select.select(list(pending), [], [], max(0.0, remaining))[0] if remaining > 0 else []
        if not readable:
            names = ", ".join(f"{s.name} (log {s.log.name})" for s, _ in pending.values())
            raise SystemExit(f"no READY line within {timeout:.0f} s from: {names}")
        for fd in readable:
            server, data = pending[fd]
            chunk = os.read(fd, 4096)
            data += chunk
            if b"\n" in data or not chunk:
                line = data.split(b"\n", 1)[0].decode(errors="replace")
                if not line.startswith("READY http://"):
                    raise SystemExit(f"server {server.name} did not start (first line {line!r}); its log: "
                                     f"{server.log.name}")
                server.url = line.split()[1]
                del pending[fd]
            else:
                pending[fd] = (server, data)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$", re.MULTILINE)


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    r = await client.get(url + "/metrics")
    r.raise_for_status()
    return {name: float(value) for name, value in _SAMPLE.findall(r.text)}


def delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


# ---- the two tenants --------------------------------------------------------------------------------------------
def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(LOW_TOKEN_ID, vocab) for _ in range(n)]


async def heavy_loop(client: httpx.AsyncClient, url: str, model: str, key: str, args, index: int,
                     records: list[dict]) -> None:
    """One of A's connections: the next request as soon as the last one answered, until cancelled."""
    rng = random.Random(args.seed * 1000 + 100 + index)
    headers = {"Authorization": f"Bearer {key}"}
    while True:
        body = {"model": model, "prompt": random_prompt(rng, args.a_input_len, args.vocab_size),
                "max_tokens": args.a_output_len, "ignore_eos": True, "temperature": 0}
        sent = time.perf_counter()
        try:
            r = await client.post(url + "/v1/completions", json=body, headers=headers)
            done = time.perf_counter()
            payload = r.json()
            tokens = payload["usage"]["completion_tokens"] if r.status_code == 200 else 0
            record = {"sent": sent, "done": done, "status": r.status_code, "completion_tokens": tokens}
            if r.status_code != 200:
                record["error"] = payload.get("error", {}).get("code")
                record["message"] = payload.get("error", {}).get("message")
                record["retry_after"] = r.headers.get("retry-after")
            records.append(record)
            if r.status_code != 200:
                await asyncio.sleep(REFUSED_PAUSE_S)  # a refusal: do not spin
        except (httpx.HTTPError, ValueError, KeyError) as e:
            records.append({"sent": sent, "done": time.perf_counter(), "status": f"error: {type(e).__name__}",
                            "completion_tokens": 0})
            await asyncio.sleep(REFUSED_PAUSE_S)


async def light_request(client: httpx.AsyncClient, url: str, model: str, key: str, prompt: list[int], args) -> dict:
    """One of B's requests, streamed: TTFT to the first token-bearing chunk, the gateway's headers, the usage."""
    body = {"model": model, "prompt": prompt, "max_tokens": args.b_output_len, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    rec = {"status": None, "ttft": None, "e2e": None, "dispatched_ahead": None, "queue_seconds": None,
           "completion_tokens": 0, "error": None, "message": None, "retry_after": None, "done_marker": False}
    sent = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as r:
            rec["status"] = r.status_code
            if "x-inferd-dispatched-ahead" in r.headers:
                rec["dispatched_ahead"] = int(r.headers["x-inferd-dispatched-ahead"])
                rec["queue_seconds"] = float(r.headers["x-inferd-queue-seconds"])
            if r.status_code != 200:
                raw = await r.aread()
                rec["retry_after"] = r.headers.get("retry-after")
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    error = json.loads(raw)["error"]
                    rec["error"], rec["message"] = error["code"], error["message"]
                rec["e2e"] = time.perf_counter() - sent
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    rec["done_marker"] = True
                    break
                event = json.loads(data)
                if "error" in event:
                    rec["error"] = event["error"].get("code") or "in-band error"
                    continue
                if rec["ttft"] is None and any(c.get("text") or c.get("finish_reason") is None
                                               for c in event.get("choices", ())):
                    rec["ttft"] = time.perf_counter() - sent
                if event.get("usage"):
                    rec["completion_tokens"] = event["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        rec["error"] = f"client: {type(e).__name__}"
    rec["e2e"] = time.perf_counter() - sent
    return rec


def b_ok(rec: dict) -> bool:
    return rec["status"] == 200 and rec["error"] is None and rec["done_marker"] and rec["ttft"] is not None


# ---- one phase --------------------------------------------------------------------------------------------------
async def run_phase(phase: str, server: Server, model: str, keys: dict[str, str], args, b_prompts: list[list[int]]
                    ) -> dict:
    limits = httpx.Limits(max_connections=args.a_concurrency + 8, max_keepalive_connections=args.a_concurrency + 8)
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, limits=limits) as client:
        # warm-up, unmeasured: the first requests of a fresh worker are slow
        warm_rng = random.Random(args.seed + 7)
        for _ in range(2):
            await light_request(client, server.url, model, keys["B"], random_prompt(warm_rng, args.b_input_len,
                                                                                    args.vocab_size), args)
        a_records: list[dict] = []
        a_tasks: list[asyncio.Task] = []
        warmup_s = 0.0
        if phase != "alone":
            started = time.perf_counter()
            a_tasks = [asyncio.create_task(heavy_loop(client, server.url, model, keys["A"], args, i, a_records))
                       for i in range(args.a_concurrency)]
            want = max(1, args.a_concurrency - args.max_num_seqs - 2)
            backlog_at = None
            while time.perf_counter() - started < args.a_warmup_timeout:
                m = await scrape(client, server.url)
                if backlog_at is None and m.get('inferd_queue_requests{tier="standard"}', 0.0) >= want \
                        and any(r["status"] == 200 for r in a_records):
                    backlog_at = time.perf_counter()
                if backlog_at is not None and time.perf_counter() - started >= args.a_warmup:
                    break
                await asyncio.sleep(0.25)
            else:
                print(f"[{phase}] warning: A's backlog did not reach {want} waiting requests with one completed "
                      f"within {args.a_warmup_timeout:.0f} s", file=sys.stderr)
            warmup_s = time.perf_counter() - started
            print(f"[{phase}] A warmed up for {warmup_s:.1f} s (backlog formed after "
                  f"{(backlog_at or math.nan) - started:.1f} s); A answers so far: "
                  f"{count_statuses(a_records)}", file=sys.stderr, flush=True)
        before = await scrape(client, server.url)
        t0 = time.perf_counter()
        b_records = []
        for i, prompt in enumerate(b_prompts):
            if i > 0 and time.perf_counter() - t0 > args.max_phase_seconds:
                break
            b_records.append(await light_request(client, server.url, model, keys["B"], prompt, args))
            print(f"[{phase}] B {i + 1}/{len(b_prompts)}: status {b_records[-1]['status']}, TTFT "
                  f"{fmt_s(b_records[-1]['ttft'])}, dispatched ahead {b_records[-1]['dispatched_ahead']}",
                  file=sys.stderr, flush=True)
            if b_records[-1]["status"] in (429, 503):  # a refusal: honour Retry-After before the next one
                with contextlib.suppress(TypeError, ValueError):
                    await asyncio.sleep(min(MAX_RETRY_AFTER_WAIT_S, float(b_records[-1]["retry_after"])))
            if args.b_gap:
                await asyncio.sleep(args.b_gap)
        t1 = time.perf_counter()
        after = await scrape(client, server.url)
        for t in a_tasks:
            t.cancel()
        await asyncio.gather(*a_tasks, return_exceptions=True)
    return summarize(phase, args, t0, t1, warmup_s, before, after, a_records, b_records)


def count_statuses(records: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        k = str(r["status"]) + (f" {r['error']}" if r.get("error") else "")
        out[k] = out.get(k, 0) + 1
    return out


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def summarize(phase: str, args, t0: float, t1: float, warmup_s: float, before: dict, after: dict,
              a_records: list[dict], b_records: list[dict]) -> dict:
    window = t1 - t0
    ok = [r for r in b_records if b_ok(r)]
    ttfts = [r["ttft"] for r in ok]
    ahead = [r["dispatched_ahead"] for r in b_records if r["dispatched_ahead"] is not None]
    a_in = [r for r in a_records if t0 <= r["done"] < t1]
    svc = {t: delta(before, after, f'inferd_tenant_service_total{{tenant="{t}"}}') for t in ("A", "B")}
    tok = {t: delta(before, after, f'inferd_tenant_tokens_total{{tenant="{t}"}}') for t in ("A", "B")}
    statuses_b = count_statuses(b_records)
    statuses_a = count_statuses(a_in)
    a_warm = [r for r in a_records if r["done"] < t0]
    refusals = [r for r in a_records + b_records if r.get("message")]
    return {
        "phase": phase, "window_s": window, "a_warmup_s": warmup_s, "a_warmup_statuses": count_statuses(a_warm),
        "drain_rate_at_start": before.get("inferd_drain_tokens_per_second"),
        "drain_rate_at_end": after.get("inferd_drain_tokens_per_second"),
        "first_refusals": [{"status": r["status"], "code": r["error"], "retry_after": r["retry_after"],
                            "message": r["message"], "tenant": "B" if "ttft" in r else "A"}
                           for r in refusals[:3]],
        "b": {"requests": len(b_records), "ok": len(ok), "statuses": statuses_b,
              "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99), "ttft_mean_s": float(np.mean(ttfts))
              if ttfts else math.nan, "ttft_max_s": max(ttfts) if ttfts else math.nan,
              "e2e_p50_s": pct([r["e2e"] for r in ok], 50),
              "dispatched_ahead_mean": float(np.mean(ahead)) if ahead else math.nan,
              "dispatched_ahead_max": max(ahead) if ahead else None,
              "dispatched_ahead_missing": len(b_records) - len(ahead),
              "queue_seconds_mean": float(np.mean([r["queue_seconds"] for r in b_records
                                                    if r["queue_seconds"] is not None] or [math.nan])),
              "goodput_rps": sum(1 for r in ok if r["ttft"] <= args.ttft_target) / window if window > 0 else 0.0,
              "met_ttft_target": sum(1 for r in ok if r["ttft"] <= args.ttft_target),
              "records": b_records},
        "a": {"completed": sum(1 for r in a_in if r["status"] == 200), "statuses": statuses_a,
              "requests_per_s": sum(1 for r in a_in if r["status"] == 200) / window if window > 0 else 0.0,
              "output_tokens_per_s": sum(r["completion_tokens"] for r in a_in) / window if window > 0 else 0.0},
        "service": {"A": svc["A"], "B": svc["B"], "ratio_a_to_b": svc["A"] / svc["B"] if svc["B"] else math.nan,
                    "b_share": svc["B"] / (svc["A"] + svc["B"]) if svc["A"] + svc["B"] else math.nan},
        "tokens": {"A": tok["A"], "B": tok["B"],
                   "b_share": tok["B"] / (tok["A"] + tok["B"]) if tok["A"] + tok["B"] else math.nan},
        "admissions": {k.split('"')[1]: delta(before, after, k) for k in after
                       if k.startswith("inferd_gateway_admissions_total{")},
    }


# ---- the report -------------------------------------------------------------------------------------------------
def fmt_s(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.2f} s"


def fmt(v, spec: str = ".2f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, spec)


def ratio(num, den) -> str:
    if num is None or den is None or any(isinstance(x, float) and math.isnan(x) for x in (num, den)) or not den:
        return "n/a"
    return f"{num / den:.2f}x"


def print_report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 150)
    p = result["phases"]
    cfg = result["config"]
    t = Table(title=f"Fair sharing: heavy A ({cfg['a_concurrency']} outstanding, {cfg['a_input_len']}+"
                    f"{cfg['a_output_len']} tokens) vs light B (1 at a time, {cfg['b_input_len']}+"
                    f"{cfg['b_output_len']} tokens, streamed); {cfg['worker']}, --max-num-seqs {cfg['max_num_seqs']}"
                    f", --worker-queue-depth 0")
    t.add_column("measure")
    for ph in PHASES:
        t.add_column(PHASE_TITLES[ph], justify="right")
    t.add_column("fcfs / vtc", justify="right")

    def row(label, getter, formatter, ratio_of=None):
        values = [getter(p[ph]) if ph in p else None for ph in PHASES]
        extra = ""
        if ratio_of == "fcfs/vtc" and "vtc" in p and "fcfs" in p:
            extra = ratio(getter(p["fcfs"]), getter(p["vtc"]))
        t.add_row(label, *[formatter(v) if v is not None else "-" for v in values], extra)

    row("window (B's first request to last answer)", lambda x: x["window_s"], lambda v: f"{v:.1f} s")
    row("B requests answered / sent (200, complete)", lambda x: f"{x['b']['ok']} / {x['b']['requests']}", str)
    row("B statuses", lambda x: ", ".join(f"{k}: {v}" for k, v in sorted(x["b"]["statuses"].items())), str)
    row("B TTFT p50", lambda x: x["b"]["ttft_p50_s"], fmt_s, "fcfs/vtc")
    row("B TTFT p99", lambda x: x["b"]["ttft_p99_s"], fmt_s, "fcfs/vtc")
    row("B TTFT mean", lambda x: x["b"]["ttft_mean_s"], fmt_s, "fcfs/vtc")
    row("B e2e p50", lambda x: x["b"]["e2e_p50_s"], fmt_s, "fcfs/vtc")
    row("B dispatched-ahead mean (max)", lambda x: (x["b"]["dispatched_ahead_mean"], x["b"]["dispatched_ahead_max"],
                                                     x["b"]["dispatched_ahead_missing"]),
        lambda v: f"{fmt(v[0], '.1f')} ({v[1] if v[1] is not None else 'n/a'})"
                  + (f" [yellow]{v[2]} missing[/]" if v[2] else ""))
    row("B queue seconds mean (header)", lambda x: x["b"]["queue_seconds_mean"], fmt_s, "fcfs/vtc")
    row(f"B goodput (TTFT <= {cfg['ttft_target']:g} s), req/s", lambda x: (x["b"]["goodput_rps"],
                                                                          x["b"]["met_ttft_target"], x["b"]["ok"]),
        lambda v: f"{v[0]:.2f} ({v[1]}/{v[2]} met)")
    row("weighted service A:B (inferd_tenant_service_total)",
        lambda x: x["service"]["ratio_a_to_b"] if x["phase"] != "alone" else None,
        lambda v: "n/a" if math.isnan(v) else f"{v:.1f} : 1", "fcfs/vtc")
    row("B share of weighted service", lambda x: x["service"]["b_share"], lambda v: f"{100 * v:.1f}%")
    row("B share of tokens (inferd_tenant_tokens_total)", lambda x: x["tokens"]["b_share"],
        lambda v: f"{100 * v:.1f}%")
    row("A requests/s", lambda x: x["a"]["requests_per_s"] if x["phase"] != "alone" else None,
        lambda v: f"{v:.2f}")
    row("A output tokens/s", lambda x: x["a"]["output_tokens_per_s"] if x["phase"] != "alone" else None,
        lambda v: f"{v:.1f}")
    row("A statuses during A's warm-up", lambda x: ", ".join(f"{k}: {v}" for k, v in
                                                             sorted(x["a_warmup_statuses"].items()))
        if x["phase"] != "alone" else None, str)
    row("server drain rate at window start / end, tokens/s", lambda x: (x["drain_rate_at_start"],
                                                                       x["drain_rate_at_end"]),
        lambda v: f"{fmt(v[0], '.0f')} / {fmt(v[1], '.0f')}")
    row("A statuses in window", lambda x: ", ".join(f"{k}: {v}" for k, v in sorted(x["a"]["statuses"].items()))
        if x["phase"] != "alone" else None, str)
    console.print(t)
    if "vtc" in p and "fcfs" in p:
        v, f = p["vtc"], p["fcfs"]
        console.print(f"VTC vs FCFS: B's TTFT p50 {ratio(f['b']['ttft_p50_s'], v['b']['ttft_p50_s'])} lower, p99 "
                      f"{ratio(f['b']['ttft_p99_s'], v['b']['ttft_p99_s'])} lower under VTC; A's throughput under "
                      f"VTC is {ratio(v['a']['requests_per_s'], f['a']['requests_per_s'])} of FCFS's.")
        if "alone" in p:
            a = p["alone"]
            console.print(f"B's TTFT p50 against B alone: VTC {ratio(v['b']['ttft_p50_s'], a['b']['ttft_p50_s'])}, "
                          f"FCFS {ratio(f['b']['ttft_p50_s'], a['b']['ttft_p50_s'])}.")
    for ph in PHASES:
        if ph in p:
            bad = {k: n for k, n in p[ph]["b"]["statuses"].items() if k != "200"}
            bad_a = {k: n for k, n in p[ph]["a"]["statuses"].items() if k != "200"}
            bad_w = {k: n for k, n in p[ph]["a_warmup_statuses"].items() if k != "200"}
            if bad or bad_a or bad_w:
                console.print(f"[bold red]{PHASE_TITLES[ph]}: refusals: B {bad}, A in the window {bad_a}, A during "
                              f"warm-up {bad_w}[/]")
                for r in p[ph]["first_refusals"]:
                    console.print(f"  first refusals: {r['tenant']} {r['status']} {r['code']} (Retry-After "
                                  f"{r['retry_after']}): {r['message']}", highlight=False)


def no_nan(value):
    if isinstance(value, dict):
        return {k: no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [no_nan(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


# ---- main -------------------------------------------------------------------------------------------------------
def server_command(args, keys_path: str, policy: str) -> list[str]:
    command = [sys.executable, "-m", "inferd", "serve", "--port", "0", "--log-level", "warning",
               "--keys", keys_path, "--fairness", policy, "--max-num-seqs", str(args.max_num_seqs),
               "--worker-queue-depth", "0", "--sse-keepalive", str(SSE_KEEPALIVE_S),
               "--kv-cache-bytes", args.kv_cache_bytes]
    if args.echo:
        command.append("--echo")
    if args.model:
        command += ["--model", os.path.abspath(args.model)]
    return command + args.serve_arg


async def served_model(url: str, key: str) -> str:
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        r.raise_for_status()
        return r.json()["data"][0]["id"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--echo", action="store_true", help="echo worker (no model): quick, but TTFT is then the "
                    "serving path's alone")
    ap.add_argument("--model", default=None, help="model path (default: the SmolLM2-135M GGUF)")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--kv-cache-bytes", default="256M")
    ap.add_argument("--a-concurrency", type=int, default=16, help="A's outstanding requests (default 16)")
    ap.add_argument("--a-input-len", type=int, default=400)
    ap.add_argument("--a-output-len", type=int, default=32)
    ap.add_argument("--b-requests", type=int, default=20, help="B's requests per phase (default 20)")
    ap.add_argument("--b-input-len", type=int, default=16)
    ap.add_argument("--b-output-len", type=int, default=16)
    ap.add_argument("--b-gap", type=float, default=0.0, help="seconds between two of B's requests (default 0)")
    ap.add_argument("--ttft-target", type=float, default=2.0, help="B's TTFT target for goodput (default 2 s)")
    ap.add_argument("--max-phase-seconds", type=float, default=45.0, help="B sends no new request after this "
                    "many seconds of a phase (default 45)")
    ap.add_argument("--a-warmup", type=float, default=None, help="seconds of A's load before B starts, at least "
                    "(default 30, the gateway's drain-rate window, so that its wait estimate has seen A's load; "
                    "10 with --echo)")
    ap.add_argument("--a-warmup-timeout", type=float, default=120.0)
    ap.add_argument("--vocab-size", type=int, default=49152, help="prompt ids are drawn below this (SmolLM2's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra `inferd serve` argument (repeat)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every figure as JSON")
    args = ap.parse_args()
    if args.a_warmup is None:
        args.a_warmup = 10.0 if args.echo else 30.0

    started = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="fairness-keys-")
    keys_path = os.path.join(tmp, "keys.json")
    keys = {t: create_key(keys_path, t)[0] for t in ("A", "B")}
    b_rng = random.Random(args.seed)
    b_prompts = [random_prompt(b_rng, args.b_input_len, args.vocab_size) for _ in range(args.b_requests)]
    servers = {"vtc": Server("vtc", server_command(args, keys_path, "vtc")),
               "fcfs": Server("fcfs", server_command(args, keys_path, "fcfs"))}
    phases: dict[str, dict] = {}
    try:
        wait_ready(list(servers.values()))
        ready_s = time.perf_counter() - started
        print(f"servers ready after {ready_s:.1f} s: vtc {servers['vtc'].url}, fcfs {servers['fcfs'].url}",
              file=sys.stderr, flush=True)
        model = asyncio.run(served_model(servers["vtc"].url, keys["B"]))
        for phase, server in (("alone", servers["vtc"]), ("vtc", servers["vtc"]), ("fcfs", servers["fcfs"])):
            phases[phase] = asyncio.run(run_phase(phase, server, model, keys, args, b_prompts))
            if phase in ("vtc", "fcfs"):
                servers[phase].stop()  # done with it: its worker stops competing for the CPU
    finally:
        for s in servers.values():
            s.stop()
            with contextlib.suppress(OSError):
                os.unlink(s.log.name)
        for name in ("keys.json", "keys.json.lock"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(tmp, name))
        with contextlib.suppress(OSError):
            os.rmdir(tmp)
    result = {"config": {**{k: v for k, v in vars(args).items() if k not in ("json",)},
                         "worker": "echo worker" if args.echo else f"model {model}",
                         "sse_keepalive_s": SSE_KEEPALIVE_S,
                         "server_commands": {k: ["inferd", *s.command[3:]] for k, s in servers.items()}},
              "servers_ready_s": ready_s, "phases": phases, "elapsed_s": time.perf_counter() - started}
    print_report(result)
    print(f"total {result['elapsed_s']:.0f} s (servers ready after {ready_s:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(no_nan(result), f, indent=2)


if __name__ == "__main__":
    main()
