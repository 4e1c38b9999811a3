"""The gateway's own cost: `inferd serve --echo` (the API process and a worker that runs no model) under a lean,
closed-loop HTTP load, so that whatever a request costs is the serving path's, not the model's.

    .venv/bin/python bench/gateway_overhead.py [--duration 20] [--concurrency 64] [--json PATH]

This script owns: starting the echo server and stopping its process group; a load client in a SEPARATE process (raw
asyncio streams, HTTP/1.1 keep-alive, --concurrency connections each sending a pre-encoded non-streaming
`POST /v1/chat/completions` (one short user message, max_tokens 1) back to back, parsing only the status line and
Content-Length); and the report over the measured window (after --warmup seconds):
  - requests/s, status counts, client-side latency p50/p99;
  - the server's `inferd_gateway_overhead_seconds` histogram (receipt to response end, minus the time spent waiting
    for the worker), differenced over the window, p50/p99 interpolated within buckets as PromQL's
    histogram_quantile does;
  - CPU seconds over the window of the API process, the worker and the client (from /proc/PID/stat), so that it is
    plain which one is CPU-bound (on a 2-core machine, the client takes a share of the cores too);
  - targets: >= 1000 requests/s and < 2 ms p50 added by the gateway.
The load is closed-loop: at 64 connections the API process saturates, and the overhead histogram then includes the
time requests wait for its event loop (latency ~ connections / throughput). `--concurrency 1` gives the cost of one
request on an idle server.

--py-spy PATH also records the API process with py-spy during the window (raw collapsed stacks, GIL holder only; its
sampling slows the server, so take figures from a run without it) and prints where the samples fall, by package and
by function.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import multiprocessing
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

TARGET_RPS = 1000.0
TARGET_P50_S = 0.002
OVERHEAD_METRIC = "inferd_gateway_overhead_seconds"
CONTEXT_METRICS = ("inferd_server_dispatch_seconds",)  # shown beside it when the server exports them
READY_TIMEOUT_S = 300.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---- the server -----------------------------------------------------------------------------------------------
def start_server(args) -> tuple[subprocess.Popen, str]:
    """`inferd serve --echo` in its own process group (its worker included); returns (process, base URL)."""
    command = [sys.executable, "-m", "inferd", "serve", "--echo", "--port", "0", "--log-level", "warning",
               # the worker never queues a request: every connection has a batch slot
               "--max-num-seqs", str(max(64, args.concurrency)),
               # no --keys: every request is the anonymous tenant's, which has no quota; the waiting line must
               # never refuse one either
               "--max-queue-requests", str(max(1024, 2 * args.concurrency))]
    if args.model:
        command += ["--model", args.model]
    args.server_command = command + args.serve_arg
    env = {k: v for k, v in os.environ.items() if k != "INFERD_API_KEY"}  # an inherited key would answer 401
    log = tempfile.NamedTemporaryFile(prefix="gateway-overhead-", suffix=".log", delete=False)
    proc = subprocess.Popen(args.server_command, stdout=subprocess.PIPE, stderr=log, start_new_session=True,
                            env=env)
    line = first_line(proc, READY_TIMEOUT_S)
    if not line.startswith("READY http://"):
        stop_server(proc)
        raise SystemExit(f"the server did not start (first line {line!r}); its log: {log.name}")
    os.unlink(log.name)  # the server keeps writing to the unlinked file: nothing is left behind
    return proc, line.split()[1]


def first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first stdout line of proc ("" if none came within timeout or it exited)."""
    deadline, data = time.monotonic() + timeout, b""
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([proc.stdout], [], [], remaining)[0]:
            break
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the whole group (the worker too), SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def served_model(url: str) -> str:
    return json.loads(http_get(url + "/v1/models"))["data"][0]["id"]


# ---- CPU time -------------------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5), counted after the comm


def group_pids(pgid: int) -> list[int]:
    """The processes of a process group (the server and its worker)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[2]) == pgid:
                        pids.append(int(name))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return pids


def cpu_snapshot(server_pid: int, client_pid: int) -> dict[str, float]:
    """CPU seconds of the API process, the rest of its group (the worker) and the client."""
    workers = [p for p in group_pids(server_pid) if p != server_pid]
    return {"api": cpu_seconds(server_pid), "worker": sum(cpu_seconds(p) for p in workers),
            "client": cpu_seconds(client_pid)}


# ---- histograms -----------------------------------------------------------------------------------------------
def histogram(metrics_text: str, name: str) -> dict[str, float] | None:
    """Cumulative bucket counts of a Prometheus histogram by `le`, summed over its other labels, plus "_sum" and
    "_count"; None when the server does not export it."""
    counts: dict[str, float] = collections.defaultdict(float)
    for labels, value in re.findall(rf"^{name}_bucket{{([^}}]*)}} (\S+)$", metrics_text, re.M):
        counts[re.search(r'le="([^"]+)"', labels).group(1)] += float(value)
    if not counts:
        return None
    for suffix in ("_sum", "_count"):
        counts[suffix] = sum(float(v) for v in re.findall(rf"^{name}{suffix}(?:{{[^}}]*}})? (\S+)$", metrics_text,
                                                          re.M))
    return dict(counts)


def histogram_quantile(buckets: dict[str, float], q: float) -> float:
    """Quantile q from cumulative bucket counts, linearly interpolated inside its bucket (PromQL's
    histogram_quantile: the lowest bucket starts at 0, a quantile in the +Inf bucket is the highest finite bound)."""
    bounds = sorted((float("inf") if le == "+Inf" else float(le), n) for le, n in buckets.items()
                    if not le.startswith("_"))
    total = bounds[-1][1]
    if total <= 0:
        return math.nan
    rank, prev_le, prev_count = q * total, 0.0, 0.0
    for le, count in bounds:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-12)
        prev_le, prev_count = le, count
    return prev_le


def histogram_window(before: str, after: str, name: str) -> dict | None:
    """p50/p99/mean/count of what the histogram observed between two scrapes; None when it is not exported."""
    b, a = histogram(before, name), histogram(after, name)
    if a is None:
        return None
    diff = {k: v - (b or {}).get(k, 0.0) for k, v in a.items()}
    n = diff["_count"]
    return {"count": n, "p50_s": histogram_quantile(diff, 0.5), "p99_s": histogram_quantile(diff, 0.99),
            "mean_s": diff["_sum"] / n if n else math.nan}


# ---- the client process ---------------------------------------------------------------------------------------
def encode_requests(host: str, port: int, model: str, variants: int = 16) -> list[bytes]:
    """Whole HTTP/1.1 requests, encoded once: the client's loop only writes bytes."""
    out = []
    for i in range(variants):
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": f"Hello number {i}!"}],
                           "max_tokens": 1}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        out.append(head + body)
    return out


async def read_response(reader: asyncio.StreamReader) -> int:
    """Reads one response (the body by Content-Length, unread); returns its status code."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    match = re.search(rb"\r\ncontent-length:\s*(\d+)", head, re.I)
    if match is None:
        raise ConnectionError(f"a response without Content-Length (status {status})")
    await reader.readexactly(int(match.group(1)))
    return status


class Window:
    """What completed inside the measured window: [start, end) in time.perf_counter()."""

    def __init__(self):
        self.start = math.inf
        self.end = math.inf
        self.latencies: list[float] = []
        self.statuses: collections.Counter = collections.Counter()

    def record(self, sent: float | None, done: float, status: int | str) -> None:
        """sent=None: a failure with no request to time (it counts among the statuses only)."""
        if self.start <= done < self.end:
            if sent is not None:
                self.latencies.append(done - sent)
            self.statuses[status] += 1


async def connection_loop(host: str, port: int, payload: bytes, window: Window, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as e:
            window.record(None, time.perf_counter(), f"connect: {type(e).__name__}")
            await asyncio.sleep(0.01)
            continue
        try:
            while not stop.is_set():  # keep-alive: one request after the other on the same connection
                sent = time.perf_counter()
                writer.write(payload)
                status = await read_response(reader)
                window.record(sent, time.perf_counter(), status)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError) as e:
            window.record(None, time.perf_counter(), f"error: {type(e).__name__}")
        finally:
            writer.close()


async def drive(host: str, port: int, payloads: list[bytes], concurrency: int, warmup: float, duration: float,
                pipe) -> dict:
    window, stop = Window(), asyncio.Event()
    tasks = [asyncio.create_task(connection_loop(host, port, payloads[i % len(payloads)], window, stop))
             for i in range(concurrency)]
    await asyncio.sleep(warmup)
    window.start = time.perf_counter()
    pipe.send("start")  # the parent takes its "before" snapshot now
    await asyncio.sleep(duration)
    window.end = time.perf_counter()
    pipe.send("stop")
    stop.set()
    await asyncio.wait(tasks, timeout=10)
    return {"seconds": window.end - window.start, "latencies": window.latencies,
            "statuses": {str(k): v for k, v in window.statuses.items()}}


def client_main(pipe, url: str, model: str, concurrency: int, warmup: float, duration: float) -> None:
    """The client process: drives the load and sends back its window's results."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payloads = encode_requests(host, int(port), model)
    result = asyncio.run(drive(host, int(port), payloads, concurrency, warmup, duration, pipe))
    pipe.send(result)


# ---- measuring ------------------------------------------------------------------------------------------------
def measure(args, url: str, server_pid: int) -> dict:
    """Runs the client process; snapshots /metrics and CPU times at the edges of its measured window."""
    model = served_model(url)
    parent_end, child_end = multiprocessing.Pipe()
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of this process's state
    client = ctx.Process(target=client_main, args=(child_end, url, model, args.concurrency, args.warmup,
                                                   args.duration), daemon=True)
    client.start()
    expect(parent_end, "start", args.warmup + 60)
    before_metrics, before_cpu = http_get(url + "/metrics"), cpu_snapshot(server_pid, client.pid)
    profiler = start_py_spy(args.py_spy, server_pid, args.duration) if args.py_spy else None
    expect(parent_end, "stop", args.duration + 60)
    after_cpu, after_metrics = cpu_snapshot(server_pid, client.pid), http_get(url + "/metrics")
    if not parent_end.poll(60):
        raise SystemExit("the client process sent no results")
    result = parent_end.recv()
    client.join(10)
    if profiler is not None:
        profiler.wait(timeout=60)
    return summarize(args, result, before_cpu, after_cpu, before_metrics, after_metrics)


def expect(pipe, message: str, timeout: float) -> None:
    if not pipe.poll(timeout):
        raise SystemExit(f"the client process did not say {message!r} within {timeout:.0f} s")
    got = pipe.recv()
    if got != message:
        raise SystemExit(f"the client process said {got!r}, expected {message!r}")


def quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def summarize(args, result: dict, before_cpu: dict, after_cpu: dict, before_metrics: str, after_metrics: str
              ) -> dict:
    seconds, latencies = result["seconds"], sorted(result["latencies"])
    ok = result["statuses"].get("200", 0)
    return {
        "concurrency": args.concurrency, "duration_s": seconds, "warmup_s": args.warmup,
        "requests": sum(result["statuses"].values()), "requests_per_s": len(latencies) / seconds,
        "ok_per_s": ok / seconds, "statuses": result["statuses"],
        "client_latency_p50_s": quantile(latencies, 0.5), "client_latency_p99_s": quantile(latencies, 0.99),
        "gateway_overhead": histogram_window(before_metrics, after_metrics, OVERHEAD_METRIC),
        "context": {name: histogram_window(before_metrics, after_metrics, name) for name in CONTEXT_METRICS},
        "cpu_s": {k: after_cpu[k] - before_cpu[k] for k in after_cpu},
        "targets": {"requests_per_s": TARGET_RPS, "gateway_overhead_p50_s": TARGET_P50_S},
        "server_command": ["inferd", *args.server_command[3:]],  # without "python -m"
    }


# ---- profiling ------------------------------------------------------------------------------------------------
def start_py_spy(path: str, pid: int, duration: float) -> subprocess.Popen:
    """py-spy on the API process for the window: raw collapsed stacks at `path`. --gil samples only the thread that
    holds the GIL, i.e. where the process spends CPU in Python (idle pool threads and epoll waits drop out)."""
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(max(1, int(duration) - 1)),
                             "--format", "raw", "--rate", "200", "--gil", "--output", path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def read_stacks(path: str) -> list[tuple[list[str], int]]:
    """py-spy's raw output as (frames outermost first, as "function (file)" without the line, samples)."""
    stacks = []
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            stacks.append(([re.sub(r":\d+\)$", ")", frame) for frame in stack.split(";")], int(count)))
    return stacks


def package(frame: str) -> str:
    """The top-level package (or file) of a frame: "fastapi", "pydantic", "json", "inferd", ..."""
    path = frame.rpartition(" (")[2].rstrip(")")
    return path.split("/")[0] if "/" in path else path  # a bare file name: py-spy shortened the path


def profile_summary(path: str, n: int = 20) -> dict:
    """Samples by own time per function and per package, and by inclusive time per function."""
    own, own_pkg, incl, total = collections.Counter(), collections.Counter(), collections.Counter(), 0
    for frames, count in read_stacks(path):
        total += count
        own[frames[-1]] += count
        own_pkg[package(frames[-1])] += count
        for frame in set(frames):
            incl[frame] += count
    return {"samples": total, "own": own.most_common(n), "own_by_package": own_pkg.most_common(n),
            "inclusive": incl.most_common(2 * n)}


# ---- the report -----------------------------------------------------------------------------------------------
def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.3f} ms"


def verdict(ok: bool) -> str:
    return "[green]met[/]" if ok else "[red]missed[/]"


def print_report(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 120)  # no wrapped rows in logs and pipes
    t = Table(title=f"inferd serve --echo: {r['concurrency']} keep-alive connection(s), "
                    f"{r['duration_s']:.1f} s measured after {r['warmup_s']:.0f} s warm-up")
    for col in ("measure", "value", "target", ""):
        t.add_column(col)
    t.add_row("requests/s (200 only)", f"{r['ok_per_s']:.0f}", f">= {TARGET_RPS:.0f}",
              verdict(r["ok_per_s"] >= TARGET_RPS))
    t.add_row("statuses", ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items())), "", "")
    t.add_row("client latency p50 / p99", f"{ms(r['client_latency_p50_s'])} / {ms(r['client_latency_p99_s'])}",
              "", "")
    g = r["gateway_overhead"]
    if g is None:
        t.add_row(f"{OVERHEAD_METRIC}", "[yellow]absent from /metrics: not measured[/]", f"p50 < {ms(TARGET_P50_S)}",
                  "")
    else:
        t.add_row("gateway overhead p50 / p99", f"{ms(g['p50_s'])} / {ms(g['p99_s'])}", f"p50 < {ms(TARGET_P50_S)}",
                  verdict(g["p50_s"] < TARGET_P50_S))
        t.add_row("gateway overhead mean (n)", f"{ms(g['mean_s'])} ({g['count']:.0f})", "", "")
    for name, h in r["context"].items():
        if h is not None:
            t.add_row(f"{name} p50 / p99", f"{ms(h['p50_s'])} / {ms(h['p99_s'])}", "", "")
    window, n = r["duration_s"], max(1, r["requests"])
    for who, label in (("api", "API process"), ("worker", "worker (echo)"), ("client", "load client")):
        s = r["cpu_s"][who]
        # CPU per request bounds the rate one process can serve: 1 s / (CPU per request) on its one core
        t.add_row(f"CPU, {label}", f"{s:.1f} s ({100 * s / window:.0f}% of a core), {1e3 * s / n:.3f} ms/request",
                  "", "")
    console.print(t)
    bad = {k: v for k, v in r["statuses"].items() if k != "200"}
    if bad:
        console.print(f"[yellow]non-200 answers in the window: {bad}[/] (429: a quota applies; pass --serve-arg "
                      "flags that lift it)")


def print_profile(path: str) -> dict:
    summary = profile_summary(path)
    total = summary["samples"]
    if not total:
        print(f"py-spy recorded nothing at {path}")
        return summary
    for key, what in (("own_by_package", "own time by package"), ("own", "own time by function"),
                      ("inclusive", "inclusive time by function")):
        print(f"\npy-spy, API process (GIL holder), {total} samples: {what}")
        for frame, count in summary[key]:
            print(f"  {100 * count / total:5.1f}%  {frame}")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds (default 20)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before the window (default 3)")
    p.add_argument("--concurrency", type=int, default=64, help="keep-alive connections (default 64)")
    p.add_argument("--model", default=None, help="model whose tokenizer and config the server uses (no weights "
                   "are loaded; default: the SmolLM2 GGUF)")
    p.add_argument("--serve-arg", action="append", default=[], help="an extra `inferd serve` argument (repeat)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON")
    p.add_argument("--py-spy", default=None, metavar="PATH", help="record the API process with py-spy during the "
                   "window (raw stacks to PATH) and print the top functions")
    args = p.parse_args()

    proc, url = start_server(args)
    try:
        result = measure(args, url, proc.pid)
    finally:
        stop_server(proc)
    print_report(result)
    if args.py_spy:
        result["profile"] = print_profile(args.py_spy)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(no_nan(result), f, indent=2)


def no_nan(value):
    """NaN (an empty quantile) as null: JSON has no NaN."""
    if isinstance(value, dict):
        return {k: no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [no_nan(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


if __name__ == "__main__":
    main()
