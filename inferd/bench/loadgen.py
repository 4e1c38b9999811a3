"""Load generator for an OpenAI-compatible completions server, in the manner of vLLM's `benchmark_serving.py`.

The whole of `inferd bench` but its command line (inferd/cli/bench.py): the synthetic workload (random token-id
prompts of exact lengths, seeded), the arrival process (fixed concurrency, or Poisson at a request rate with an
optional concurrency cap), the streaming client (a byte-exact SSE parser timing every token-bearing chunk), the
statistics (TTFT, TPOT, ITL, E2E latency, throughput, goodput) and the report (a rich table, a JSON dict). `--report
DIR` (the same workload swept over request rates and concurrencies, written as Markdown, PNG plots and JSON) is
inferd/bench/report.py.

Timing rules, per request:
  - t_start is taken just before the request is sent; TTFT is the first chunk with a token, E2E ends at `[DONE]`.
  - a chunk carries a token when one of its choices has non-empty text or token ids, or has no finish_reason yet
    (a token whose text the server holds back); an empty-text choice with a finish_reason is only an end marker.
  - ITL samples are the gaps between consecutive token-bearing chunks; output tokens come from the usage chunk
    (`stream_options.include_usage`), else from the token-bearing chunks counted.

Does not import torch: `inferd bench` must start fast.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import math
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

LOW_TOKEN_ID = 1000  # prompt ids are drawn from [LOW_TOKEN_ID, vocab_size): clear of special / byte tokens
DEFAULT_VOCAB_SIZE = 49152  # SmolLM2's
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
HTTP_TIMEOUT = httpx.Timeout(6 * 3600.0, connect=60.0)  # generous: a long run must not time out mid-stream


class BenchError(Exception):
    """The benchmark cannot run (server unreachable, no model, warm-up failed)."""


@dataclass
class BenchConfig:
    url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    concurrency: int | None = None  # fixed concurrency: this many workers pull from the queue
    request_rate: float = math.inf  # Poisson arrivals (req/s) when concurrency is None; inf: all at once
    max_concurrency: int | None = None  # cap on requests in flight under request_rate
    seed: int = 0
    temperature: float = 0.0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    goodput: dict[str, float] | None = None  # SLOs in ms, keys among GOODPUT_METRICS
    output_json: str | None = None
    warmup: int = 1  # warm-up requests sent one by one before the run, not counted

    def validate(self) -> None:
        checks = [
            (self.num_prompts >= 1, "--num-prompts must be >= 1"),
            (self.input_len >= 1 and self.output_len >= 1, "--input-len and --output-len must be >= 1"),
            (0.0 <= self.range_ratio < 1.0, "--range-ratio must be in [0, 1)"),
            (self.concurrency is None or self.concurrency >= 1, "--concurrency must be >= 1"),
            (self.max_concurrency is None or self.max_concurrency >= 1, "--max-concurrency must be >= 1"),
            (self.request_rate > 0, "--request-rate must be > 0 (inf: all at once)"),
            (self.concurrency is None or (math.isinf(self.request_rate) and self.max_concurrency is None),
             "--concurrency excludes --request-rate and --max-concurrency"),
            (self.vocab_size > LOW_TOKEN_ID, f"--vocab-size must be > {LOW_TOKEN_ID}"),
            (self.warmup >= 0, "--warmup must be >= 0"),
            (set(self.goodput or {}) <= set(GOODPUT_METRICS), f"--goodput metrics are {', '.join(GOODPUT_METRICS)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class RequestSpec:
    prompt: list[int]
    output_len: int


@dataclass
class RequestRecord:
    """What one request measured; times in seconds (start / end on the perf_counter clock)."""
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None
    start: float = 0.0
    end: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ---------------------------------------------------------------------------------------------------------------
# Workload and arrivals


def _length_range(mean: int, ratio: float) -> tuple[int, int]:
    return max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))


def generate_workload(config: BenchConfig, rng: random.Random, n: int | None = None) -> list[RequestSpec]:
    """n (default num_prompts) random-token prompts, lengths uniform in input_len * (1 -/+ range_ratio)."""
    in_lo, in_hi = _length_range(config.input_len, config.range_ratio)
    out_lo, out_hi = _length_range(config.output_len, config.range_ratio)
    specs = []
    for _ in range(config.num_prompts if n is None else n):
        prompt_len, output_len = rng.randint(in_lo, in_hi), rng.randint(out_lo, out_hi)
        prompt = [rng.randrange(LOW_TOKEN_ID, config.vocab_size) for _ in range(prompt_len)]
        specs.append(RequestSpec(prompt, output_len))
    return specs


def arrival_offsets(n: int, rate: float, rng: random.Random) -> list[float]:
    """Send times (s from the start) of n Poisson arrivals at `rate` req/s, the first at 0; all 0 for rate inf."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]
    return list(itertools.accumulate(gaps))


# ---------------------------------------------------------------------------------------------------------------
# Streaming client


class SSEParser:
    """Incremental server-sent-events parser: feed it bytes, get the data of each completed event.

    Lines end in \\n, \\r\\n or \\r; an event ends at a blank line; its `data:` lines are joined by \\n; lines
    starting with ':' (keep-alive comments) and other fields are ignored."""

    _EOL = re.compile(rb"\r\n|\r|\n")

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._skip_lf = False  # the last chunk ended in \r: a \n opening the next one belongs to it

    def feed(self, chunk: bytes) -> list[str]:
        if self._skip_lf and chunk:
            self._skip_lf = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        self._buf += chunk
        events = []
        while m := self._EOL.search(self._buf):
            line, self._buf = self._buf[:m.start()], self._buf[m.end():]
            self._skip_lf = m.group() == b"\r" and not self._buf
            if (event := self._line(line)) is not None:
                events.append(event)
        return events

    def close(self) -> list[str]:
        """Data of an event the stream ended in without its blank line (lenient)."""
        events = self.feed(b"\n") if self._buf else []
        if (event := self._line(b"")) is not None:
            events.append(event)
        return events

    def _line(self, line: bytes) -> str | None:
        if not line:
            event, self._data = ("\n".join(self._data) if self._data else None), []
            return event
        if line.startswith(b":"):
            return None
        name, _, value = line.partition(b":")
        if name == b"data":
            self._data.append(value.removeprefix(b" ").decode("utf-8"))
        return None


def _error_message(payload) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), FastAPI's {"detail"}, or text."""
    if isinstance(payload, dict):
        err = payload.get("error", payload.get("detail", payload))
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return str(payload)


def _tokens_in(choice: dict) -> int:
    """Tokens a streamed choice carries: its token ids if any, else 1 unless it is only an end marker."""
    if not isinstance(choice, dict):
        raise ValueError(f"unexpected choice in stream: {choice!r}")
    if choice.get("token_ids"):
        return len(choice["token_ids"])
    return 1 if choice.get("text") or choice.get("finish_reason") is None else 0


class _StreamState:
    """Accumulates the chunks of one response into its RequestRecord."""

    def __init__(self, record: RequestRecord):
        self.record = record
        self.last_token_time: float | None = None
        self.counted_tokens = 0
        self.usage: dict | None = None
        self.done = False

    def on_event(self, data: str, now: float) -> None:
        if data.strip() == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise ValueError(f"unexpected chunk in stream: {data[:200]!r}")
        if "error" in chunk:
            self.record.error = _error_message(chunk)
            return
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        n = sum(_tokens_in(c) for c in chunk.get("choices") or [])
        if n:
            self._on_tokens(n, now)

    def _on_tokens(self, n: int, now: float) -> None:
        rec = self.record
        if self.last_token_time is None:
            rec.ttft = now - rec.start
        else:
            rec.itls.append(now - self.last_token_time)
        self.last_token_time = now
        self.counted_tokens += n

    def finish(self, now: float) -> None:
        rec = self.record
        rec.end, rec.e2e = now, now - rec.start
        if self.usage:
            rec.prompt_tokens = int(self.usage.get("prompt_tokens", rec.prompt_tokens))
            rec.output_tokens = int(self.usage.get("completion_tokens", self.counted_tokens))
        else:
            rec.output_tokens = self.counted_tokens
        if rec.error is None and not self.done:
            rec.error = "stream ended before data: [DONE]"
        elif rec.error is None and rec.ttft is None:
            rec.error = "no token received"


async def _read_stream(response: httpx.Response, record: RequestRecord) -> None:
    state, parser = _StreamState(record), SSEParser()
    async for chunk in response.aiter_bytes():
        now = time.perf_counter()
        for data in parser.feed(chunk):
            state.on_event(data, now)
            if state.done or record.error is not None:
                state.finish(now)
                return
    now = time.perf_counter()
    for data in parser.close():
        state.on_event(data, now)
    state.finish(now)


def _headers(config: BenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


def _request_body(config: BenchConfig, spec: RequestSpec) -> dict:
    return {"model": config.model, "prompt": spec.prompt, "max_tokens": spec.output_len,
            "temperature": config.temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def send_request(client: httpx.AsyncClient, config: BenchConfig, spec: RequestSpec) -> RequestRecord:
    """One streamed completion; failures (HTTP status, error chunk, broken stream) land in record.error."""
    record = RequestRecord(prompt_tokens=len(spec.prompt))
    url = config.url.rstrip("/") + "/v1/completions"
    record.start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=_request_body(config, spec), headers=_headers(config)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                try:
                    message = _error_message(json.loads(body))
                except ValueError:
                    message = body[:500]
                record.error = f"HTTP {resp.status_code}: {message}"
            else:
                await _read_stream(resp, record)
    except (httpx.HTTPError, ValueError) as e:  # ValueError: a malformed chunk (bad JSON, bad UTF-8, bad shape)
        record.error = f"{type(e).__name__}: {e}"
    if not record.end:
        record.end = time.perf_counter()
        record.e2e = record.end - record.start
    return record


async def resolve_model(client: httpx.AsyncClient, config: BenchConfig) -> str:
    """The first model id of GET /v1/models."""
    url = config.url.rstrip("/") + "/v1/models"
    try:
        resp = await client.get(url, headers=_headers(config))
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {url}: {type(e).__name__}: {e}") from e
    if resp.status_code != 200:
        raise BenchError(f"GET {url}: HTTP {resp.status_code}: {resp.text[:500]}")
    try:
        return resp.json()["data"][0]["id"]
    except (ValueError, LookupError, TypeError) as e:
        raise BenchError(f"GET {url} lists no model ({resp.text[:200]}); pass --model") from e


# ---------------------------------------------------------------------------------------------------------------
# Arrival processes

OnResult = Callable[[RequestRecord], None]


async def _run_fixed_concurrency(client: httpx.AsyncClient, config: BenchConfig, specs: list[RequestSpec],
                                 on_result: OnResult | None) -> list[RequestRecord]:
    """`concurrency` workers, each sending the next queued request as soon as its previous one finished."""
    queue: asyncio.Queue[tuple[int, RequestSpec]] = asyncio.Queue()
    for item in enumerate(specs):
        queue.put_nowait(item)
    records: list[RequestRecord | None] = [None] * len(specs)

    async def worker() -> None:
        while not queue.empty():
            i, spec = queue.get_nowait()
            records[i] = await send_request(client, config, spec)
            if on_result:
                on_result(records[i])

    await asyncio.gather(*(worker() for _ in range(min(config.concurrency, len(specs)))))
    return records


async def _run_poisson(client: httpx.AsyncClient, config: BenchConfig, specs: list[RequestSpec],
                       offsets: list[float], on_result: OnResult | None) -> list[RequestRecord]:
    """Each request arrives at its offset; at most max_concurrency are in flight (the rest wait for a slot)."""
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

    async def one(spec: RequestSpec) -> RequestRecord:
        if limit is None:
            record = await send_request(client, config, spec)
        else:
            async with limit:
                record = await send_request(client, config, spec)
        if on_result:
            on_result(record)
        return record

    t0, tasks = time.perf_counter(), []
    for spec, offset in zip(specs, offsets):
        if (delay := t0 + offset - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(spec)))
    return list(await asyncio.gather(*tasks))


async def _warm_up(client: httpx.AsyncClient, config: BenchConfig) -> None:
    """Warm-up requests one by one, on prompts of their own (a shared prompt would be a prefix-cache hit)."""
    for spec in generate_workload(config, random.Random(f"warmup-{config.seed}"), n=config.warmup):
        record = await send_request(client, config, spec)
        if record.error is not None:
            raise BenchError(f"warm-up request failed: {record.error}")


async def run_benchmark(config: BenchConfig, *, on_result: OnResult | None = None,
                        transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """Runs the benchmark and returns the report (see build_report). config.model is resolved in place when None.

    on_result is called as each measured request finishes (a progress bar); transport replaces the network
    (tests). Raises BenchError when the run cannot start (server unreachable, no model, warm-up failed)."""
    config.validate()
    rng = random.Random(config.seed)
    specs = generate_workload(config, rng)
    offsets = arrival_offsets(len(specs), config.request_rate, rng)
    n_conn = config.concurrency or config.max_concurrency or config.num_prompts
    limits = httpx.Limits(max_connections=n_conn, max_keepalive_connections=n_conn)
    # trust_env=False: no proxy from the environment between the load generator and the server it measures
    async with httpx.AsyncClient(limits=limits, timeout=HTTP_TIMEOUT, transport=transport,
                                 trust_env=False) as client:
        if config.model is None:
            config.model = await resolve_model(client, config)
        await _warm_up(client, config)
        if config.concurrency:
            records = await _run_fixed_concurrency(client, config, specs, on_result)
        else:
            records = await _run_poisson(client, config, specs, offsets, on_result)
    duration = max(r.end for r in records) - min(r.start for r in records)
    return build_report(config, records, duration)


# ---------------------------------------------------------------------------------------------------------------
# Statistics and report


def _latency_stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    """mean / median / std / p90 / p99 of `seconds`, in ms, keyed like vLLM's (mean_ttft_ms, p99_ttft_ms, ...)."""
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    if ms.size == 0:
        return {f"{stat}_{name}_ms": None for stat in ("mean", "median", "std", "p90", "p99")}
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.percentile(ms, 50)),
            f"std_{name}_ms": float(ms.std()), f"p90_{name}_ms": float(np.percentile(ms, 90)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def _meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2e}
    return all(values[k] is not None and values[k] * 1000.0 <= slo for k, slo in slos_ms.items())


def summarize(records: list[RequestRecord], duration: float, goodput_slos: dict[str, float] | None = None) -> dict:
    """Aggregate metrics over the successful requests; latencies in ms, throughputs per second of `duration`."""
    ok = [r for r in records if r.ok]
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    result = {
        "duration": duration, "completed": len(ok), "failed": len(records) - len(ok),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)), "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
    }
    if goodput_slos:
        result["request_goodput"] = per_s(sum(_meets_slos(r, goodput_slos) for r in ok))
    result |= _latency_stats("ttft", [r.ttft for r in ok])
    result |= _latency_stats("tpot", [r.tpot for r in ok if r.tpot is not None])
    result |= _latency_stats("itl", [x for r in ok for x in r.itls])
    result |= _latency_stats("e2el", [r.e2e for r in ok])
    return result


def build_report(config: BenchConfig, records: list[RequestRecord], duration: float) -> dict:
    """summarize() plus the date, the config and per-request arrays (s; None where a failed request has none)."""
    keys = ("url", "model", "num_prompts", "input_len", "output_len", "range_ratio", "concurrency",
            "request_rate", "max_concurrency", "seed", "temperature", "vocab_size", "warmup", "goodput")
    cfg = {k: getattr(config, k) for k in keys}
    cfg["request_rate"] = "inf" if math.isinf(config.request_rate) else config.request_rate  # JSON has no inf
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "config": cfg,
        **summarize(records, duration, config.goodput),
        "input_lens": [r.prompt_tokens for r in records], "output_lens": [r.output_tokens for r in records],
        "ttfts": [r.ttft for r in records], "e2els": [r.e2e for r in records],
        "itls": [r.itls for r in records], "errors": [r.error for r in records],
    }


def format_figure(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def report_tables(result: dict) -> tuple[Table, Table]:
    """The summary (counts, throughputs) and the latency table (ms) of a report."""
    summary = Table(title="Serving benchmark", show_header=False)
    summary.add_column("Metric")
    summary.add_column("Value", justify="right")
    rows = [("Successful requests", "completed"), ("Failed requests", "failed"),
            ("Benchmark duration (s)", "duration"), ("Total input tokens", "total_input_tokens"),
            ("Total generated tokens", "total_output_tokens"), ("Request throughput (req/s)", "request_throughput"),
            ("Request goodput (req/s)", "request_goodput"), ("Output token throughput (tok/s)", "output_throughput"),
            ("Total token throughput (tok/s)", "total_token_throughput")]
    for label, key in rows:
        if key in result:
            summary.add_row(label, format_figure(result[key]))
    latency = Table(title="Latency (ms)")
    latency.add_column("Metric")
    for stat in ("Mean", "Median", "P90", "P99", "Std"):
        latency.add_column(stat, justify="right")
    for label, name in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2el")):
        stats = ("mean", "median", "p90", "p99", "std")
        latency.add_row(label, *(format_figure(result[f"{s}_{name}_ms"]) for s in stats))
    return summary, latency


def print_report(result: dict, console: Console | None = None) -> None:
    console = console or Console()
    for table in report_tables(result):
        console.print(table)
    errors = Counter(e for e in result.get("errors", []) if e is not None)
    for message, count in errors.most_common(5):
        console.print(Text.assemble((f"{count} request(s) failed: ", "red"), message))


# ---------------------------------------------------------------------------------------------------------------
# Command line


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (SLOs in ms)."""
    if not items:
        return None
    slos = {}
    for item in items:
        name, sep, value = item.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            slos[name] = math.nan
        if not sep or name not in GOODPUT_METRICS or not slos[name] > 0:
            raise ValueError(f"bad --goodput item {item!r}: expected METRIC:MS with METRIC in "
                             f"{', '.join(GOODPUT_METRICS)} and MS > 0")
    return slos


def bench_config(args: argparse.Namespace) -> BenchConfig:
    config = BenchConfig(
        url=args.url, model=args.model, api_key=args.api_key, num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
        concurrency=args.concurrency, request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        seed=args.seed, temperature=args.temperature, vocab_size=args.vocab_size,
        goodput=parse_goodput(args.goodput), output_json=args.output_json, warmup=args.warmup)
    config.validate()
    return config


def write_json(result: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
