"""`inferd bench --report DIR`: sweep the load, write a Markdown report, PNG plots and the raw figures.

One benchmark gives one number; a service is a curve. The report runs `inferd bench`'s workload (same prompts,
lengths, streaming client and statistics: inferd/bench/loadgen.py) once per load point:
  - offered load: Poisson arrivals at each of --rates (req/s; --max-concurrency still caps them when given),
  - concurrency: a fixed number of requests in flight, each of --concurrencies,
each point with --num-prompts requests of its own (seed + point index: no point shares prompts, so none is served
from the prefix cache another one filled). The warm-up requests run once, before the first point. Points run one
after another: the server is idle when each one starts.

DIR gets
  report.md                 the command line, the workload, one table per sweep (a row per point: counts, duration,
                            throughput, goodput, TTFT / TPOT / ITL p50, p90, p99, E2E p50 and p99), the plots
  results.json              the command, the workload, and per point its summary (loadgen.summarize's keys, plus
                            `sent`) and per-request TTFT, TPOT, E2E latency, lengths and error; rewritten after each
                            point, so an interrupted sweep keeps the points it finished
  latency_vs_rate.png       TTFT, TPOT, ITL p50/p90/p99 against the offered request rate
  throughput_vs_concurrency.png   output tokens/s and requests/s against concurrency
  latency_vs_concurrency.png      TTFT, TPOT, ITL p50/p90/p99 against concurrency
  ttft_cdf.png, tpot_cdf.png      the distribution (empirical CDF) of each point's per-request TTFT and TPOT
  goodput.png               with --goodput: requests/s meeting every SLO against rate and concurrency, beside the
                            request throughput

    inferd bench --url URL --report DIR [--rates 0.5,1,2,4] [--concurrencies 1,2,4,8] [--num-prompts N]
                 [--input-len L] [--output-len L] [--goodput ttft:500 tpot:50]

An empty list (`--rates ""`) skips that sweep. matplotlib is imported only here and with the Agg backend (no
display); without it the tables and results.json are still written.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import shlex
import sys
from dataclasses import dataclass

import httpx

from .loadgen import HTTP_TIMEOUT, BenchConfig, BenchError, RequestRecord, format_figure, resolve_model, run_benchmark

# sized for a small model on a CPU or one GPU; a big GPU server wants larger ones (--rates 4,8,16,32
# --concurrencies 8,32,128)
DEFAULT_REPORT_RATES = (0.5, 1.0, 2.0, 4.0)  # req/s, Poisson
DEFAULT_REPORT_CONCURRENCIES = (1, 2, 4, 8)
PLOT_DPI = 110
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LATENCY_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"))
PERCENTILES = (("median", "p50"), ("p90", "p90"), ("p99", "p99"))

# the columns of a sweep's table after the load column: (header, key in a point's summary, decimals)
TABLE_COLUMNS: list[tuple[str, str, int]] = [
    ("sent", "sent", 0), ("completed", "completed", 0), ("failed", "failed", 0),
    ("duration (s)", "duration", 2), ("req/s", "request_throughput", 3),
    ("output tok/s", "output_throughput", 2), ("goodput (req/s)", "request_goodput", 3),
] + [(f"{label} {p} (ms)", f"{stat}_{metric}_ms", 2) for metric, label in LATENCY_METRICS
     for stat, p in PERCENTILES] + [("E2E p50 (ms)", "median_e2el_ms", 2), ("E2E p99 (ms)", "p99_e2el_ms", 2)]


@dataclass
class SweepConfig:
    base: BenchConfig  # the workload; its concurrency / request_rate are set per point
    out_dir: str
    rates: list[float]
    concurrencies: list[int]
    command: str | None = None  # the command line as typed (None: not known)

    def validate(self) -> None:
        self.base.validate()
        if not self.rates and not self.concurrencies:
            raise ValueError("--report needs at least one point: give --rates or --concurrencies")
        if any(not (r > 0 and math.isfinite(r)) for r in self.rates):
            raise ValueError("--rates must be finite and > 0 (req/s)")
        if any(c < 1 for c in self.concurrencies):
            raise ValueError("--concurrencies must be >= 1")

    def points(self) -> list[tuple[str, float | int]]:
        return [("rate", r) for r in self.rates] + [("concurrency", c) for c in self.concurrencies]

    def point_config(self, index: int, kind: str, value: float | int) -> BenchConfig:
        """The base workload at one load point: seed + index, warm-up only before the first point."""
        load = ({"request_rate": float(value), "concurrency": None} if kind == "rate" else
                {"concurrency": int(value), "request_rate": math.inf, "max_concurrency": None})
        return dataclasses.replace(self.base, seed=self.base.seed + index, output_json=None,
                                   warmup=self.base.warmup if index == 0 else 0, **load)


def parse_list(text: str, kind: type, flag: str) -> list:
    """'0.5,1,2' -> [0.5, 1.0, 2.0]; '' -> []."""
    if not text.strip():
        return []
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be a comma-separated list of {kind.__name__}s, got {text!r}") from None


def point_label(kind: str, value: float | int) -> str:
    return f"rate {value:g} req/s" if kind == "rate" else f"concurrency {value}"


# ---------------------------------------------------------------------------------------------------------------
# Running the sweep


def _request_rows(records: list[RequestRecord]) -> dict[str, list]:
    """Per-request figures of one point (seconds; None where a request has none), in order of completion."""
    return {"ttft": [r.ttft for r in records], "tpot": [r.tpot if r.ok else None for r in records],
            "e2el": [r.e2e for r in records], "input_len": [r.prompt_tokens for r in records],
            "output_len": [r.output_tokens for r in records], "error": [r.error for r in records]}


async def run_point(config: BenchConfig, kind: str, value: float | int) -> dict:
    records: list[RequestRecord] = []
    report = await run_benchmark(config, on_result=records.append)
    summary = {k: v for k, v in report.items()
               if k not in ("date", "config", "input_lens", "output_lens", "ttfts", "e2els", "itls", "errors")}
    summary["sent"] = len(records)
    return {"kind": kind, "value": value, "label": point_label(kind, value), "seed": config.seed,
            "summary": summary, "requests": _request_rows(records)}


async def _resolve(config: BenchConfig) -> None:
    if config.model is None:
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, trust_env=False) as client:
            config.model = await resolve_model(client, config)


def workload(config: BenchConfig) -> dict:
    keys = ("url", "model", "num_prompts", "input_len", "output_len", "range_ratio", "max_concurrency", "seed",
            "temperature", "vocab_size", "warmup", "goodput")
    return {k: getattr(config, k) for k in keys}


def explicit_command(sweep: SweepConfig) -> str:
    """An `inferd bench` command with every option that shaped the run explicit (the API key never written)."""
    c = sweep.base
    argv = ["inferd", "bench", "--url", c.url, "--model", str(c.model), "--num-prompts", str(c.num_prompts),
            "--input-len", str(c.input_len), "--output-len", str(c.output_len), "--range-ratio", f"{c.range_ratio:g}",
            "--seed", str(c.seed), "--temperature", f"{c.temperature:g}", "--vocab-size", str(c.vocab_size),
            "--warmup", str(c.warmup)]
    if c.max_concurrency:
        argv += ["--max-concurrency", str(c.max_concurrency)]
    if c.goodput:
        argv += ["--goodput", *(f"{k}:{v:g}" for k, v in c.goodput.items())]
    if c.api_key:
        argv += ["--api-key", "REDACTED"]
    argv += ["--rates", ",".join(f"{r:g}" for r in sweep.rates),
             "--concurrencies", ",".join(str(x) for x in sweep.concurrencies), "--report", sweep.out_dir]
    return shlex.join(argv)


def invoked_command(argv: list[str] | None = None) -> str | None:
    """The `inferd bench ...` command line this process runs, as typed (the API key redacted); None when this
    process is not `inferd bench` (a test, a script)."""
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] != "bench" or os.path.basename(argv[0]) not in ("inferd", "__main__.py"):
        return None
    args = argv[2:]
    for i, a in enumerate(args):
        if a == "--api-key" and i + 1 < len(args):
            args[i + 1] = "REDACTED"
        elif a.startswith("--api-key="):
            args[i] = "--api-key=REDACTED"
    prefix = "inferd" if os.path.basename(argv[0]) == "inferd" else "python -m inferd"
    return f"{prefix} bench {shlex.join(args)}".rstrip()


async def run_sweep(sweep: SweepConfig, on_point=None) -> dict:
    """Every point in turn; on_point(point, results so far) after each. Raises BenchError when the run cannot
    start (server unreachable, no model, warm-up failed)."""
    sweep.validate()
    await _resolve(sweep.base)
    results = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": sweep.command,
               "command_explicit": explicit_command(sweep), "workload": workload(sweep.base),
               "rates": list(sweep.rates), "concurrencies": list(sweep.concurrencies), "points": []}
    for i, (kind, value) in enumerate(sweep.points()):
        point = await run_point(sweep.point_config(i, kind, value), kind, value)
        results["points"].append(point)
        if on_point:
            on_point(point, results)
    return results


# ---------------------------------------------------------------------------------------------------------------
# Markdown


def cell(value, digits: int) -> str:
    """A table cell: '-' for None, integers as they are, floats with `digits` decimals (no thousands separator)."""
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}" if digits else str(int(value))


def sweep_table(points: list[dict], kind: str) -> list[str]:
    rows = [p for p in points if p["kind"] == kind]
    if not rows:
        return []
    first = "rate (req/s)" if kind == "rate" else "concurrency"
    has_goodput = any("request_goodput" in p["summary"] for p in rows)
    columns = [c for c in TABLE_COLUMNS if has_goodput or c[1] != "request_goodput"]
    lines = ["| " + " | ".join([first] + [c[0] for c in columns]) + " |",
             "|" + "---|" * (len(columns) + 1)]
    for p in rows:
        load = f"{p['value']:g}" if kind == "rate" else str(p["value"])
        lines.append("| " + " | ".join([load] + [cell(p["summary"].get(key), d) for _, key, d in columns]) + " |")
    return lines


def render_markdown(results: dict, plots: list[str]) -> str:
    w = results["workload"]
    lines = ["# inferd bench report", "",
             f"{results['date']}: `{w['url']}`, model `{w['model']}`.", ""]
    if results.get("command"):
        lines += ["Command:", "", "```", results["command"], "```", ""]
    lines += ["Every option explicit:" if results.get("command") else "Command (every option explicit):", "",
              "```", results["command_explicit"], "```", "",
              f"Workload per point: {w['num_prompts']} requests of {w['input_len']} random prompt tokens and "
              f"{w['output_len']} output tokens (range ratio {w['range_ratio']:g}, ignore_eos, temperature "
              f"{w['temperature']:g}), streamed; seed {w['seed']} + the point's index. Latencies in ms; TTFT is to the "
              "first token-bearing chunk, TPOT = (E2E - TTFT) / (output tokens - 1) per request, ITL pools the "
              "gaps between chunks. Throughputs are over the point's duration (first send to last end)."]
    if w.get("goodput"):
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in w["goodput"].items())
        lines += ["", f"Goodput: requests/s that met every SLO ({slos})."]
    for kind, title in (("rate", "Offered load (Poisson arrivals)"), ("concurrency", "Fixed concurrency")):
        table = sweep_table(results["points"], kind)
        if table:
            cap = w.get("max_concurrency")
            note = f" (at most {cap} in flight)" if kind == "rate" and cap else ""
            lines += ["", f"## {title}{note}", ""] + table
    failures = [(p["label"], e) for p in results["points"] for e in p["requests"]["error"] if e]
    if failures:
        lines += ["", "## Failed requests", ""]
        seen: dict[tuple[str, str], int] = {}
        for key in failures:
            seen[key] = seen.get(key, 0) + 1
        lines += [f"- {label}: {n} x {message}" for (label, message), n in seen.items()]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{os.path.splitext(p)[0]}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Plots


def _nan(v) -> float:
    return math.nan if v is None else float(v)


def _latency_axes(fig, rows: list[dict], x: list, xlabel: str, log_x: bool) -> None:
    axes = fig.subplots(1, 3)
    for ax, (metric, label) in zip(axes, LATENCY_METRICS):
        for stat, p in PERCENTILES:
            ax.plot(x, [_nan(r["summary"].get(f"{stat}_{metric}_ms")) for r in rows], marker="o", label=p)
        ax.set_title(label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms")
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{v:g}" for v in x])
        values = [_nan(r["summary"].get(f"p99_{metric}_ms")) for r in rows]
        finite = [v for v in values if math.isfinite(v) and v > 0]
        if finite and max(finite) > 20 * min(finite):
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)


def _cdf(ax, results: dict, key: str, title: str) -> None:
    """Each point's empirical CDF: rates solid, concurrencies dashed; log x when the values span over 20x."""
    lo, hi = math.inf, 0.0
    for p in results["points"]:
        values = sorted(v * 1000.0 for v in p["requests"][key] if v is not None)
        if not values:
            continue
        lo, hi = min(lo, values[0]), max(hi, values[-1])
        ys = [0.0] + [(i + 1) / len(values) for i in range(len(values))]
        ax.step([values[0]] + values, ys, where="post", linestyle="-" if p["kind"] == "rate" else "--",
                label=p["label"])
    if 0 < lo and hi > 20 * lo:
        ax.set_xscale("log")
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def write_plots(results: dict, out_dir: str) -> list[str]:
    """The PNGs (file names in out_dir) for the points present; [] when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = results["workload"]["model"]
    rate_rows = [p for p in results["points"] if p["kind"] == "rate"]
    conc_rows = [p for p in results["points"] if p["kind"] == "concurrency"]
    written = []

    def save(fig, name: str, title: str) -> None:
        fig.suptitle(f"{title} ({model})")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=PLOT_DPI)
        plt.close(fig)
        written.append(name)

    if rate_rows:
        fig = plt.figure(figsize=(13, 4.2))
        _latency_axes(fig, rate_rows, [p["value"] for p in rate_rows], "offered load (req/s)", log_x=True)
        save(fig, "latency_vs_rate.png", "Latency percentiles vs offered load")
    if conc_rows:
        x = [p["value"] for p in conc_rows]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
        for ax, key, label in ((a1, "output_throughput", "output tokens/s"), (a2, "request_throughput",
                                                                               "requests/s")):
            ax.plot(x, [_nan(p["summary"].get(key)) for p in conc_rows], marker="o")
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [str(v) for v in x])
            ax.set_xlabel("concurrency (requests in flight)")
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            ax.grid(True, which="both", alpha=0.3)
        save(fig, "throughput_vs_concurrency.png", "Throughput vs concurrency")
        fig = plt.figure(figsize=(13, 4.2))
        _latency_axes(fig, conc_rows, x, "concurrency", log_x=True)
        save(fig, "latency_vs_concurrency.png", "Latency percentiles vs concurrency")
    for key, name, label in (("ttft", "ttft_cdf.png", "TTFT"), ("tpot", "tpot_cdf.png", "TPOT")):
        if any(v is not None for p in results["points"] for v in p["requests"][key]):
            fig, ax = plt.subplots(figsize=(8, 5))
            _cdf(ax, results, key, f"{label} per request, by load point")
            save(fig, name, f"{label} distribution")
    if results["workload"].get("goodput"):
        groups = [(rows, title) for rows, title in ((rate_rows, "offered load (req/s)"),
                                                    (conc_rows, "concurrency")) if rows]
        fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
        for ax, (rows, xlabel) in zip(axes[0], groups):
            x = [p["value"] for p in rows]
            ax.plot(x, [_nan(p["summary"].get("request_throughput")) for p in rows], marker="o",
                    label="requests/s completed")
            ax.plot(x, [_nan(p["summary"].get("request_goodput")) for p in rows], marker="s",
                    label="goodput (met every SLO)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [f"{v:g}" for v in x])
            ax.set_xlabel(xlabel)
            ax.set_ylabel("requests/s")
            ax.set_ylim(bottom=0)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in results["workload"]["goodput"].items())
        save(fig, "goodput.png", f"Goodput, SLOs {slos}")
    return written


def write_report(results: dict, out_dir: str) -> list[str]:
    """results.json, the PNGs and report.md into out_dir (created); returns the PNG names."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    plots = write_plots(results, out_dir)
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(render_markdown(results, plots))
    return plots


# ---------------------------------------------------------------------------------------------------------------
# From the command line (its flags: inferd/cli/bench.py)


def sweep_config(args: argparse.Namespace, base: BenchConfig) -> SweepConfig:
    if args.concurrency is not None or not math.isinf(args.request_rate):
        raise ValueError("--report sweeps --rates and --concurrencies; --concurrency and --request-rate set a "
                         "single run")
    if args.output_json:
        raise ValueError("--report writes DIR/results.json; --output-json is for a single run")
    rates = list(DEFAULT_REPORT_RATES) if args.rates is None else parse_list(args.rates, float, "--rates")
    concurrencies = (list(DEFAULT_REPORT_CONCURRENCIES) if args.concurrencies is None else
                     parse_list(args.concurrencies, int, "--concurrencies"))
    sweep = SweepConfig(base, args.report, rates, concurrencies, command=invoked_command())
    sweep.validate()
    return sweep


def cmd_report(args: argparse.Namespace, base: BenchConfig) -> int:
    """0 when every request of every point succeeded, 1 when one failed or the run could not start, 2 on bad
    arguments."""
    from rich.console import Console

    err = Console(stderr=True)
    try:
        sweep = sweep_config(args, base)
    except ValueError as e:
        err.print(f"inferd bench: {e}", markup=False, highlight=False, soft_wrap=True)
        return 2
    err.print(f"report into {sweep.out_dir}: {len(sweep.points())} points x {base.num_prompts} requests to "
              f"{base.url}", markup=False, highlight=False, soft_wrap=True)

    def show(point: dict, so_far: dict) -> None:
        os.makedirs(sweep.out_dir, exist_ok=True)
        with open(os.path.join(sweep.out_dir, "results.json"), "w", encoding="utf-8") as f:
            json.dump(so_far, f, indent=1)  # the points so far: an interrupted sweep keeps them
        s = point["summary"]
        err.print(f"  {point['label']}: {s['completed']}/{s['sent']} ok in {s['duration']:.1f} s, "
                  f"{format_figure(s['output_throughput'])} output tok/s, "
                  f"TTFT p50 {format_figure(s['median_ttft_ms'])} ms, "
                  f"TPOT p50 {format_figure(s['median_tpot_ms'])} ms", markup=False, highlight=False, soft_wrap=True)

    try:
        results = asyncio.run(run_sweep(sweep, on_point=show))
    except BenchError as e:
        err.print(f"inferd bench: {e}", markup=False, highlight=False, soft_wrap=True)
        return 1
    plots = write_report(results, sweep.out_dir)
    err.print(f"wrote {sweep.out_dir}/report.md, results.json and {len(plots)} plot(s)", markup=False,
              highlight=False, soft_wrap=True)
    return 0 if all(p["summary"]["failed"] == 0 for p in results["points"]) else 1
