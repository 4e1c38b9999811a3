"""What happens far above capacity, with and without fair sharing: a Poisson load ramp (default 0.5x, 1x and 3x of a
capacity measured first) from two tenants, one interactive-tier and one batch-tier, against `inferd serve` with a
small batch and a small, bounded waiting line; --fairness vtc and fcfs side by side in one run.

    .venv/bin/python bench/overload.py [--echo] [--model PATH] [--fairness vtc,fcfs] [--steps 0.5,1,3]
                                       [--step-seconds 20] [--ttft-target 2] [--json PATH]

The servers (one per policy, started at once; the idle one only sends heartbeats): the real default model (SmolLM2
GGUF) unless --echo, --max-num-seqs 4 (the worker's default queue depth, 4, stays), --max-queue-requests 32 and
--max-queue-tokens 2400 (25 requests of 64 + 32 tokens: the token bound is the one that binds), --kv-cache-bytes
256M, the default queue timeouts (interactive 10 s, batch 300 s) and SSE keep-alive (5 s).

The workload: every request is a streamed completion of a random --input-len (64) token-id prompt, --output-len (32)
tokens, ignore_eos, greedy; each arrival is the interactive tenant's with probability --interactive-share (0.5), else
the batch tenant's. The arrival times, tenants and prompts of a step come from a seed of their own: every policy gets
exactly the same requests.

  1. capacity: on each server, a closed loop of --max-num-seqs requests at a time (the two tenants in turn) for
     --capacity-seconds (8, after a 2 s warm-up); completed requests per second. The FIRST server's figure sets the
     offered rates of every policy (the other's is printed as a check of the machine's drift).
  2. for each step, on each policy's server in turn (0.5x vtc, 0.5x fcfs, 1x vtc, ...: the machine's drift over
     minutes falls on both alike; the idle server costs ~1% of a core): Poisson arrivals at multiplier x capacity for
     --step-seconds; then the requests still open are awaited (the line drains) before the next run. Per step:
       - offered rate (target and achieved), requests by tenant;
       - answers by status and error code ("200 ok"; "200 in-band CODE": a stream whose headers went out while it
         waited, then ended with an error event; "429 CODE", "503 CODE");
       - Retry-After seen on 429/503 (p50, max);
       - goodput: requests that were 200, complete (every token, [DONE]) and had TTFT <= --ttft-target (TTFT measured
         client-side: sending to the first chunk with a token), per second from the step's start to its last answer
         (the backlog's drain included, as vLLM's benchmark counts its duration), all and interactive only;
       - TTFT p50/p99 of the complete 200s, interactive and batch;
       - the line: the most requests / reserved tokens seen in it (polling /metrics every 0.5 s during the step)
         and the server's high-water gauges (inferd_queue_requests_high_water, inferd_queue_tokens_high_water, over
         the server's life so far) against the bounds;
       - admission outcomes (inferd_gateway_admissions_total, differenced over the step: admitted, overloaded, shed,
         queue_timeout, rate_limited_*).
  3. the contract, checked on every answer and printed loudly when broken: the status is 200, 429 or 503; a 429 or
     503 (but request_too_large) carries an integer Retry-After >= 1; its code is rate_limit_exceeded,
     request_too_large, overloaded or queue_timeout; a 200 stream ends in [DONE] with either every token or an
     in-band queue_timeout/overloaded error; no client-side failure; the line never exceeds its bounds. The script
     exits with status 1 when anything broke it.

Tiers and policies: VTC and FCFS differ only in the order INSIDE a tier, and with the default tenants each tier has
one tenant, so the two policies should behave alike here (a check that fair sharing costs nothing under overload);
`--tiers standard,standard` puts both tenants in one tier, where the policy decides between them.

Quotas: none by default (so 429s are not expected). `--quota-x F` gives each tenant an RPM quota of F x its share of
the measured capacity per --rate-window (10 s), written to the keys file after the capacity runs and loaded with
SIGHUP, so that 429s (and their Retry-After) show up in the steps above F x capacity.

The default run (real model, both policies, 3 steps of 20 s) takes about 3.5 minutes on 2 CPU cores; --echo is
quicker, but the echo worker's steps cost microseconds, so its "capacity" is the API process's, and a 3x load from
a Python client on the same cores is more the client's limit than the server's.
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
TENANTS = ("vip", "bulk")  # the interactive and the batch tenant (their tiers: --tiers)
EXPECTED_CODES = {(429, "rate_limit_exceeded"), (429, "request_too_large"), (503, "overloaded"),
                  (503, "queue_timeout")}
IN_BAND_CODES = ("queue_timeout", "overloaded")


# ---- servers ----------------------------------------------------------------------------------------------------
class Server:
    def __init__(self, name: str, command: list[str]):
        self.name, self.command = name, command
        self.log = tempfile.NamedTemporaryFile(prefix=f"overload-{name}-", suffix=".log", delete=False)
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

    def log_tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError), open(self.log.name, errors="replace") as f:
            return "".join(f.readlines()[-n:])
        return ""


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


def queued(m: dict[str, float]) -> tuple[float, float]:
    """(requests, reserved tokens) in the line."""
    return sum(v for k, v in m.items() if k.startswith("inferd_queue_requests{")), m.get("inferd_queue_tokens", 0.0)


# ---- one request ------------------------------------------------------------------------------------------------
def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(LOW_TOKEN_ID, vocab) for _ in range(n)]


async def one_request(client: httpx.AsyncClient, url: str, model: str, key: str, tenant: str, prompt: list[int],
                      args, t_base: float) -> dict:
    """A streamed completion: status, error code, Retry-After, TTFT (first token-bearing chunk), completeness."""
    body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    rec = {"tenant": tenant, "sent": sent - t_base, "status": None, "code": None, "message": None,
           "retry_after": None, "ttft": None, "e2e": None, "completion_tokens": None, "done_marker": False,
           "in_band": None, "keepalives": 0, "client_error": None}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                raw = await r.aread()
                rec["retry_after"] = r.headers.get("retry-after")
                try:
                    error = json.loads(raw)["error"]
                    rec["code"], rec["message"] = error.get("code"), error.get("message")
                except (ValueError, KeyError, TypeError):
                    rec["message"] = raw[:300].decode(errors="replace")
            else:
                async for line in r.aiter_lines():
                    if line.startswith(":"):
                        rec["keepalives"] += 1
                        continue
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        rec["done_marker"] = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        rec["in_band"] = event["error"].get("code") or "?"
                        rec["message"] = event["error"].get("message")
                        continue
                    if rec["ttft"] is None and any(c.get("text") or c.get("finish_reason") is None
                                                   for c in event.get("choices", ())):
                        rec["ttft"] = time.perf_counter() - sent
                    if event.get("usage"):
                        rec["completion_tokens"] = event["usage"]["completion_tokens"]
    except (httpx.HTTPError, ValueError) as e:
        rec["client_error"] = f"{type(e).__name__}: {e}"[:200]
    except asyncio.CancelledError:
        rec["client_error"] = "cancelled: still open after --drain-timeout"
    rec["e2e"] = time.perf_counter() - sent
    return rec


def outcome(rec: dict, output_len: int) -> str:
    if rec["client_error"] is not None:
        return "client error"
    if rec["status"] == 200:
        if rec["in_band"] is not None:
            return f"200 in-band {rec['in_band']}"
        if rec["done_marker"] and rec["completion_tokens"] == output_len and rec["ttft"] is not None:
            return "200 ok"
        return "200 incomplete"
    return f"{rec['status']} {rec['code']}"


def violations(rec: dict, output_len: int) -> list[str]:
    """How one answer breaks the overload contract (empty: it keeps it)."""
    out = []
    status = rec["status"]
    if rec["client_error"] is not None:
        return [f"client-side failure: {rec['client_error']}"]
    if status not in (200, 429, 503):
        out.append(f"status {status} ({rec['code']}: {rec['message']})")
    elif status != 200:
        if (status, rec["code"]) not in EXPECTED_CODES:
            out.append(f"{status} with unexpected code {rec['code']!r}: {rec['message']}")
        if rec["code"] != "request_too_large":
            ra = rec["retry_after"]
            if ra is None:
                out.append(f"{status} {rec['code']} without Retry-After")
            elif not ra.isdigit() or int(ra) < 1:
                out.append(f"{status} {rec['code']} with Retry-After {ra!r} (not an integer >= 1)")
    else:
        if not rec["done_marker"]:
            out.append("a 200 stream without data: [DONE]")
        if rec["in_band"] is not None:
            if rec["in_band"] not in IN_BAND_CODES:
                out.append(f"a 200 stream ended by an in-band error {rec['in_band']!r}: {rec['message']}")
            if rec["ttft"] is not None:
                out.append(f"a 200 stream with tokens, then an in-band error {rec['in_band']!r}")
        elif rec["completion_tokens"] != output_len:
            out.append(f"a 200 stream with {rec['completion_tokens']} completion tokens, expected {output_len}")
    return out


# ---- capacity ---------------------------------------------------------------------------------------------------
async def measure_capacity(client: httpx.AsyncClient, server: Server, model: str, keys: dict[str, str], args,
                           seed: int) -> dict:
    """A closed loop of --max-num-seqs requests (the tenants in turn); completions per second after the warm-up."""
    rng = random.Random(seed)
    done: list[tuple[float, dict]] = []
    stop = asyncio.Event()
    t_base = time.perf_counter()

    async def loop(i: int) -> None:
        n = i
        while not stop.is_set():
            tenant = TENANTS[n % 2]
            n += 1
            rec = await one_request(client, server.url, model, keys[tenant], tenant,
                                    random_prompt(rng, args.input_len, args.vocab_size), args, t_base)
            done.append((time.perf_counter(), rec))

    tasks = [asyncio.create_task(loop(i)) for i in range(args.max_num_seqs)]
    await asyncio.sleep(args.capacity_warmup)
    t0 = time.perf_counter()
    await asyncio.sleep(args.capacity_seconds)
    t1 = time.perf_counter()
    stop.set()
    await asyncio.wait(tasks, timeout=120)
    in_window = [rec for t, rec in done if t0 <= t < t1]
    ok = [rec for rec in in_window if outcome(rec, args.output_len) == "200 ok"]
    return {"requests_per_s": len(ok) / (t1 - t0), "completed": len(ok), "window_s": t1 - t0,
            "statuses": count(outcome(r, args.output_len) for r in in_window),
            "ttft_p50_s": pct([r["ttft"] for r in ok], 50)}


# ---- one step ---------------------------------------------------------------------------------------------------
def schedule(args, step: int, rate: float) -> list[tuple[float, str, list[int]]]:
    """(send offset, tenant, prompt) of a step's Poisson arrivals: a function of the seed and the step only. A Poisson
    process conditioned on its count: exactly round(rate x duration) arrivals at uniformly random times, so that a
    step offers its nominal rate (a free count over 20 s varies by +-15% at 2.5 req/s)."""
    rng = random.Random(args.seed * 7919 + step)
    n = max(1, round(rate * args.step_seconds))
    times = sorted(rng.uniform(0, args.step_seconds) for _ in range(n))
    return [(t, TENANTS[0] if rng.random() < args.interactive_share else TENANTS[1],
             random_prompt(rng, args.input_len, args.vocab_size)) for t in times]


async def run_step(client: httpx.AsyncClient, server: Server, model: str, keys: dict[str, str], args, step: int,
                   multiplier: float, rate: float) -> dict:
    arrivals = schedule(args, step, rate)
    before = await scrape(client, server.url)
    peak = {"requests": 0.0, "tokens": 0.0}
    polling = True

    async def poll() -> None:
        while polling:
            with contextlib.suppress(httpx.HTTPError):
                m = await scrape(client, server.url)
                r, t = queued(m)
                peak["requests"], peak["tokens"] = max(peak["requests"], r), max(peak["tokens"], t)
            await asyncio.sleep(0.5)

    poller = asyncio.create_task(poll())
    t_base = time.perf_counter()
    tasks, lag = [], 0.0
    for offset, tenant, prompt in arrivals:
        delay = t_base + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            lag = max(lag, -delay)
            if lag > 2.0:  # the client cannot keep up: what it measures now is itself
                print(f"[{server.name}] the client fell {lag:.1f} s behind the arrival schedule: stopping this step's "
                      "arrivals early", file=sys.stderr, flush=True)
                arrivals = arrivals[:len(tasks)]
                break
        tasks.append(asyncio.create_task(one_request(client, server.url, model, keys[tenant], tenant, prompt, args,
                                                     t_base)))
    sent_s = time.perf_counter() - t_base
    await asyncio.sleep(max(0.0, args.step_seconds - sent_s))
    step_s = time.perf_counter() - t_base
    _, still_open = await asyncio.wait(tasks, timeout=args.drain_timeout) if tasks else (set(), set())
    for t in still_open:
        t.cancel()
    records = []
    for (offset, tenant, _), res in zip(arrivals, await asyncio.gather(*tasks, return_exceptions=True)):
        if not isinstance(res, dict):  # one_request catches what it expects: anything else is a failure too
            res = {"tenant": tenant, "sent": offset, "status": None, "code": None, "message": None,
                   "retry_after": None, "ttft": None, "e2e": None, "completion_tokens": None,
                   "done_marker": False, "in_band": None, "keepalives": 0,
                   "client_error": f"{type(res).__name__}: {res}"[:200]}
        records.append(res)
    drained_s = time.perf_counter() - t_base
    # the line should be empty once every request answered; give the server a moment to settle its gauges
    settle_until, empty = time.perf_counter() + 10, False
    while time.perf_counter() < settle_until:
        m = await scrape(client, server.url)
        if queued(m) == (0.0, 0.0):
            empty = True
            break
        await asyncio.sleep(0.25)
    polling = False
    await poller
    after = await scrape(client, server.url)
    r, t = queued(after)
    peak["requests"], peak["tokens"] = max(peak["requests"], r), max(peak["tokens"], t)
    return summarize_step(args, multiplier, rate, arrivals, records, step_s, drained_s, lag, before, after, peak,
                          empty, len(still_open))


def pct(values, q: float) -> float:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else math.nan


def count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in items:
        out[k] = out.get(k, 0) + 1
    return dict(sorted(out.items()))


def summarize_step(args, multiplier: float, rate: float, arrivals: list, records: list[dict], step_s: float,
                   drained_s: float, lag: float, before: dict, after: dict, peak: dict, empty: bool,
                   cancelled: int) -> dict:
    ok = [r for r in records if outcome(r, args.output_len) == "200 ok"]
    good = [r for r in ok if r["ttft"] <= args.ttft_target]
    retry_after = [int(r["retry_after"]) for r in records if r["status"] in (429, 503) and r["retry_after"]
                   and r["retry_after"].isdigit()]
    bad = [(r, v) for r in records for v in violations(r, args.output_len)]
    if peak["requests"] > args.max_queue_requests:
        bad.append((None, f"the line held {peak['requests']:.0f} requests, over its bound {args.max_queue_requests}"))
    if peak["tokens"] > args.max_queue_tokens:
        bad.append((None, f"the line held {peak['tokens']:.0f} tokens, over its bound {args.max_queue_tokens}"))
    hw_r, hw_t = after.get("inferd_queue_requests_high_water", 0.0), after.get("inferd_queue_tokens_high_water", 0.0)
    if hw_r > args.max_queue_requests or hw_t > args.max_queue_tokens:
        bad.append((None, (f"high-water gauges {hw_r:.0f} requests / {hw_t:.0f} tokens over the bounds "
                           f"{args.max_queue_requests} / {args.max_queue_tokens}")))
    if not empty:
        bad.append((None, f"the line did not empty after the step: {queued(after)} (requests, tokens)"))
    by_tenant = {t: [r for r in ok if r["tenant"] == t] for t in TENANTS}
    refusals: dict[str, str] = {}
    for r in records:
        key = outcome(r, args.output_len)
        if key != "200 ok" and key not in refusals:
            refusals[key] = f"{r['tenant']}, Retry-After {r['retry_after']}: {r['message']}"
    return {
        "multiplier": multiplier, "target_rate": rate, "requests": len(records),
        "offered_rate": len(arrivals) / args.step_seconds, "send_lag_max_s": lag,
        "by_tenant": {t: sum(1 for r in records if r["tenant"] == t) for t in TENANTS},
        "step_s": step_s, "drained_s": drained_s,
        "outcomes": count(outcome(r, args.output_len) for r in records),
        "outcomes_by_tenant": {t: count(outcome(r, args.output_len) for r in records if r["tenant"] == t)
                               for t in TENANTS},
        "retry_after_p50": pct(retry_after, 50), "retry_after_max": max(retry_after) if retry_after else None,
        "retry_after_n": len(retry_after),
        "goodput_rps": len(good) / drained_s,
        "goodput_interactive_rps": sum(1 for r in good if r["tenant"] == "vip") / drained_s,
        "ok_rps": len(ok) / drained_s, "ok_over_target": len(ok) - len(good),
        "ttft": {t: {"p50_s": pct([r["ttft"] for r in by_tenant[t]], 50),
                     "p99_s": pct([r["ttft"] for r in by_tenant[t]], 99), "n": len(by_tenant[t])} for t in TENANTS},
        "queue_peak_requests": peak["requests"], "queue_peak_tokens": peak["tokens"],
        "queue_high_water_requests": hw_r, "queue_high_water_tokens": hw_t,
        "admissions": {k.split('"')[1]: after.get(k, 0.0) - before.get(k, 0.0) for k in after
                       if k.startswith("inferd_gateway_admissions_total{")},
        "drain_rate_at_start": before.get("inferd_drain_tokens_per_second"),
        "preemptions": sum(v for k, v in after.items() if k.startswith("inferd_preemptions_total"))
        - sum(v for k, v in before.items() if k.startswith("inferd_preemptions_total")),
        "first_of_each_outcome": refusals,
        "violations": [v if r is None else f"{r['tenant']} request sent at {r['sent']:.2f} s: {v}" for r, v in bad],
        "cancelled_after_drain_timeout": cancelled,
        "keepalive_streams": sum(1 for r in records if r["keepalives"]),
        "records": records,
    }


# ---- a policy ---------------------------------------------------------------------------------------------------
async def warm_and_measure(server: Server, model: str, keys: dict[str, str], args, seed: int) -> dict:
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, limits=httpx.Limits(max_connections=64)) as client:
        return await measure_capacity(client, server, model, keys, args, seed)


async def run_steps(servers: dict[str, Server], model: str, keys: dict[str, str], args, capacity: float
                    ) -> dict[str, list[dict]]:
    """Every step on every policy's server, the policies in turn within a step (0.5x vtc, 0.5x fcfs, 1x vtc, ...):
    the machine's drift over minutes then falls on both policies alike instead of on the one that runs last."""
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    out: dict[str, list[dict]] = {p: [] for p in servers}
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, limits=limits) as client:
        for i, multiplier in enumerate(args.steps):
            rate = multiplier * capacity
            if rate > args.max_offered_rate:
                print(f"step {multiplier:g}x: {rate:.0f} req/s is over --max-offered-rate; offering "
                      f"{args.max_offered_rate:g} req/s instead", file=sys.stderr, flush=True)
                rate = args.max_offered_rate
            for p, server in servers.items():
                s = await run_step(client, server, model, keys, args, i, multiplier, rate)
                out[p].append(s)
                print(f"[{p}] step {multiplier:g}x ({rate:.2f} req/s): {s['outcomes']}, goodput "
                      f"{s['goodput_rps']:.2f} req/s, line peak {s['queue_peak_requests']:.0f} requests / "
                      f"{s['queue_peak_tokens']:.0f} tokens, {len(s['violations'])} violation(s), drained after "
                      f"{s['drained_s']:.1f} s", file=sys.stderr, flush=True)
    return out


# ---- the report -------------------------------------------------------------------------------------------------
def fmt_s(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.2f} s"


def print_report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    cfg = result["config"]
    policies = list(result["policies"])
    cols = [(i, p) for i in range(len(cfg["steps"])) for p in policies]
    cap = result["capacity"]
    t = Table(title=f"Overload: {cfg['worker']}, --max-num-seqs {cfg['max_num_seqs']}, line bounds "
                    f"{cfg['max_queue_requests']} requests / {cfg['max_queue_tokens']} tokens; tenants vip "
                    f"({cfg['tiers'][0]}) and bulk ({cfg['tiers'][1]}), {cfg['input_len']}+{cfg['output_len']} "
                    f"tokens, streamed; capacity {cap['offered_from']:.2f} req/s (measured on {policies[0]}); "
                    f"{cfg['step_seconds']:g} s per step")
    t.add_column("measure")
    for i, p in cols:
        t.add_column(f"{cfg['steps'][i]:g}x {p}", justify="right")

    def row(label, getter):
        t.add_row(label, *[getter(result["policies"][p][i]) for i, p in cols])

    row("offered req/s (target / achieved)", lambda s: f"{s['target_rate']:.2f} / {s['offered_rate']:.2f}"
        + (f" [yellow](client lag {s['send_lag_max_s']:.1f} s)[/]" if s["send_lag_max_s"] > 0.5 else ""))
    row("requests vip / bulk", lambda s: f"{s['by_tenant']['vip']} / {s['by_tenant']['bulk']}")
    outcomes = sorted({k for p in policies for s in result["policies"][p] for k in s["outcomes"]},
                      key=lambda k: (k != "200 ok", k))
    for k in outcomes:
        row(f"  {k}", lambda s, k=k: f"{s['outcomes'].get(k, 0)}"
            + (f" ({s['outcomes_by_tenant']['vip'].get(k, 0)}/{s['outcomes_by_tenant']['bulk'].get(k, 0)})"
               if s["outcomes"].get(k) else ""))
    row("Retry-After p50 / max (n)", lambda s: f"{s['retry_after_p50']:.0f} / {s['retry_after_max']} "
        f"({s['retry_after_n']})" if s["retry_after_n"] else "-")
    row(f"goodput req/s (200, TTFT <= {cfg['ttft_target']:g} s)", lambda s: f"{s['goodput_rps']:.2f}")
    row("  of which interactive", lambda s: f"{s['goodput_interactive_rps']:.2f}")
    row("complete 200s req/s", lambda s: f"{s['ok_rps']:.2f}")
    row("TTFT > target among complete 200s", lambda s: str(s["ok_over_target"]))
    row("TTFT interactive p50 / p99", lambda s: f"{fmt_s(s['ttft']['vip']['p50_s'])} / "
        f"{fmt_s(s['ttft']['vip']['p99_s'])}")
    row("TTFT batch p50 / p99", lambda s: f"{fmt_s(s['ttft']['bulk']['p50_s'])} / "
        f"{fmt_s(s['ttft']['bulk']['p99_s'])}")
    row("line peak requests (polled) / bound", lambda s: f"{s['queue_peak_requests']:.0f} / "
        f"{cfg['max_queue_requests']}")
    row("line peak tokens (polled) / bound", lambda s: f"{s['queue_peak_tokens']:.0f} / {cfg['max_queue_tokens']}")
    row("high-water gauges requests / tokens", lambda s: f"{s['queue_high_water_requests']:.0f} / "
        f"{s['queue_high_water_tokens']:.0f}")
    adm = sorted({k for p in policies for s in result["policies"][p] for k in s["admissions"]})
    for k in adm:
        row(f"admissions: {k}", lambda s, k=k: f"{s['admissions'].get(k, 0):.0f}")
    row("drain-rate gauge at step start, tokens/s", lambda s: f"{s['drain_rate_at_start'] or 0:.0f}")
    row("streams that got keep-alives", lambda s: str(s["keepalive_streams"]))
    row("engine preemptions (inferd_preemptions_total)", lambda s: f"{s['preemptions']:.0f}")
    row("step start to last answer (goodput's seconds)", lambda s: f"{s['drained_s']:.1f} s")
    row("contract violations", lambda s: "[bold red]" + str(len(s["violations"])) + "[/]" if s["violations"]
        else "0")
    console.print(t)
    caps = ", ".join(f"{p}: {c['requests_per_s']:.2f} req/s (TTFT p50 {fmt_s(c['ttft_p50_s'])}, "
                     f"{c['statuses']})" for p, c in cap["by_policy"].items())
    console.print(f"capacity (closed loop of {cfg['max_num_seqs']}, {cfg['capacity_seconds']:g} s): {caps}",
                  highlight=False)
    for p in policies:
        for s in result["policies"][p]:
            for k, v in s["first_of_each_outcome"].items():
                console.print(f"  {s['multiplier']:g}x {p}, first '{k}': {v}", highlight=False)
    broken = [(p, s["multiplier"], v) for p in policies for s in result["policies"][p] for v in s["violations"]]
    if broken:
        console.print(f"[bold red]CONTRACT VIOLATIONS ({len(broken)}):[/]")
        for p, m, v in broken[:30]:
            console.print(f"[red]  {m:g}x {p}: {v}[/]", highlight=False)
    else:
        console.print("[green]every answer kept the contract (200/429/503, Retry-After, complete streams, line "
                      "within its bounds)[/]")


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
               "--max-queue-requests", str(args.max_queue_requests), "--max-queue-tokens", str(args.max_queue_tokens),
               "--kv-cache-bytes", args.kv_cache_bytes, "--rate-window", str(args.rate_window)]
    if args.worker_queue_depth is not None:
        command += ["--worker-queue-depth", str(args.worker_queue_depth)]
    if args.queue_timeout is not None:
        command += ["--queue-timeout", args.queue_timeout]
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
    ap.add_argument("--echo", action="store_true", help="echo worker (no model): quick, not realistic for TTFT")
    ap.add_argument("--model", default=None, help="model path (default: the SmolLM2-135M GGUF)")
    ap.add_argument("--fairness", default="vtc,fcfs", help="policies, comma-separated, side by side (default "
                    "vtc,fcfs; the first one's capacity sets the offered rates)")
    ap.add_argument("--steps", default="0.5,1,3", help="load multipliers of the measured capacity (default 0.5,1,3)")
    ap.add_argument("--step-seconds", type=float, default=20.0)
    ap.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to wait for a step's open requests")
    ap.add_argument("--capacity-seconds", type=float, default=8.0)
    ap.add_argument("--capacity-warmup", type=float, default=2.0)
    ap.add_argument("--tiers", default="interactive,batch", help="tiers of the two tenants (vip, bulk)")
    ap.add_argument("--interactive-share", type=float, default=0.5, help="share of arrivals that are vip's")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--ttft-target", type=float, default=2.0, help="TTFT target for goodput (default 2 s)")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--worker-queue-depth", type=int, default=None, help="default: the server's")
    ap.add_argument("--max-queue-requests", type=int, default=32)
    ap.add_argument("--max-queue-tokens", type=int, default=2400)
    ap.add_argument("--queue-timeout", default=None, help="`inferd serve --queue-timeout` (default: the server's)")
    ap.add_argument("--kv-cache-bytes", default="256M")
    ap.add_argument("--quota-x", type=float, default=0.0, help="RPM quota per tenant: this x its share of the "
                    "capacity per --rate-window (default 0: no quota)")
    ap.add_argument("--rate-window", type=float, default=10.0)
    ap.add_argument("--max-offered-rate", type=float, default=60.0, help="the client offers at most this many "
                    "requests/s (default 60: one Python process cannot drive streams much faster on a shared 2-core "
                    "machine; matters with --echo only)")
    ap.add_argument("--vocab-size", type=int, default=49152, help="prompt ids are drawn below this (SmolLM2's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra `inferd serve` argument (repeat)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every figure as JSON")
    args = ap.parse_args()
    args.steps = [float(x) for x in args.steps.split(",")]
    args.tiers = args.tiers.split(",")
    policies = args.fairness.split(",")
    if len(args.tiers) != 2:
        raise SystemExit("--tiers takes two tiers: vip's and bulk's")

    started = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="overload-keys-")
    keys_path = os.path.join(tmp, "keys.json")
    keys = {t: create_key(keys_path, t, tier=tier)[0] for t, tier in zip(TENANTS, args.tiers)}
    servers = {p: Server(p, server_command(args, keys_path, p)) for p in policies}
    result: dict = {}
    try:
        wait_ready(list(servers.values()))
        ready_s = time.perf_counter() - started
        print(f"servers ready after {ready_s:.1f} s: " + ", ".join(f"{p} {s.url}" for p, s in servers.items()),
              file=sys.stderr, flush=True)
        model = asyncio.run(served_model(servers[policies[0]].url, keys["vip"]))
        caps = {p: asyncio.run(warm_and_measure(servers[p], model, keys, args, seed=args.seed + 1))
                for p in policies}
        capacity = caps[policies[0]]["requests_per_s"]
        print("capacity: " + ", ".join(f"{p} {c['requests_per_s']:.2f} req/s" for p, c in caps.items()),
              file=sys.stderr, flush=True)
        if capacity <= 0:
            raise SystemExit(f"no request completed in the capacity run: {caps}")
        quotas = {}
        if args.quota_x > 0:
            shares = {"vip": args.interactive_share, "bulk": 1 - args.interactive_share}
            for t in TENANTS:
                quotas[t] = max(1, math.ceil(args.quota_x * capacity * shares[t] * args.rate_window))
                create_key(keys_path, t, rpm=quotas[t])  # updates the tenant (and adds a key we do not use)
            for s in servers.values():
                os.kill(s.proc.pid, signal.SIGHUP)  # reload the keys file now
            time.sleep(1.0)
        by_policy = asyncio.run(run_steps(servers, model, keys, args, capacity))
        result = {"config": {**{k: v for k, v in vars(args).items() if k != "json"},
                             "worker": "echo worker" if args.echo else f"model {model}",
                             "server_commands": {p: ["inferd", *s.command[3:]] for p, s in servers.items()},
                             "quotas_rpm": quotas},
                  "servers_ready_s": ready_s,
                  "capacity": {"offered_from": capacity, "by_policy": caps},
                  "policies": by_policy}
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
    result["elapsed_s"] = time.perf_counter() - started
    print_report(result)
    print(f"total {result['elapsed_s']:.0f} s (servers ready after {ready_s:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(no_nan(result), f, indent=2)
    if any(s["violations"] for steps in result["policies"].values() for s in steps):
        sys.exit(1)


if __name__ == "__main__":
    main()
