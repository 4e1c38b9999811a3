"""`inferd bench`: its flags, and the run they ask for: one load (inferd/bench/loadgen.py) or, with --report DIR, the
load swept over rates and concurrencies (inferd/bench/report.py). Both are imported when used: every `inferd`
command builds this parser, and they import httpx, numpy and rich."""

from __future__ import annotations

import argparse
import math
import os
import sys


def register(sub) -> None:
    b = sub.add_parser("bench", help="load-test a running OpenAI-compatible server (TTFT, TPOT, ITL, throughput)")
    add_bench_arguments(b)
    b.set_defaults(func=cmd_bench)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from ..bench.loadgen import DEFAULT_VOCAB_SIZE, LOW_TOKEN_ID
    from ..bench.report import DEFAULT_REPORT_CONCURRENCIES, DEFAULT_REPORT_RATES

    p = parser
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (POST {url}/v1/completions)")
    p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--num-prompts", type=int, default=64, help="measured requests")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (random token ids)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (ignore_eos)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in LEN * (1 -/+ RATIO), RATIO in [0, 1)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="fixed concurrency: N requests always in flight (excludes --request-rate)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals in req/s; inf (default): all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight under --request-rate")
    p.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help=f"prompt token ids are drawn from [{LOW_TOKEN_ID}, VOCAB_SIZE)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (metrics: ttft, tpot, e2el)")
    p.add_argument("--output-json", default=None, metavar="PATH", help="write the report (with per-request data)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests before the run, not counted")
    p.add_argument("--report", default=None, metavar="DIR",
                   help="sweep the load (--rates, --concurrencies; --num-prompts requests per point) and write "
                        "DIR/report.md, DIR/results.json and PNG plots (inferd/bench/report.py)")
    p.add_argument("--rates", default=None, metavar="R1,R2,...",
                   help="with --report: Poisson request rates (req/s) to sweep; '' for none (default: "
                        f"{','.join(f'{r:g}' for r in DEFAULT_REPORT_RATES)})")
    p.add_argument("--concurrencies", default=None, metavar="C1,C2,...",
                   help="with --report: fixed concurrencies to sweep; '' for none (default: "
                        f"{','.join(map(str, DEFAULT_REPORT_CONCURRENCIES))})")


def cmd_bench(args: argparse.Namespace) -> int:
    """`inferd bench`: 0 when every request succeeded, 1 when one failed or the run could not start, 2 on bad
    arguments."""
    import asyncio
    import itertools

    from rich.console import Console

    from ..bench.loadgen import BenchError, RequestRecord, bench_config, print_report, run_benchmark, write_json

    err = Console(stderr=True)
    try:
        config = bench_config(args)
        report_dir = getattr(args, "report", None)
        if report_dir is None and (getattr(args, "rates", None) is not None or
                                   getattr(args, "concurrencies", None) is not None):
            raise ValueError("--rates and --concurrencies need --report DIR")
    except ValueError as e:
        err.print(f"inferd bench: {e}", markup=False, highlight=False)
        return 2
    if report_dir is not None:
        from ..bench.report import cmd_report

        return cmd_report(args, config)
    mode = (f"concurrency {config.concurrency}" if config.concurrency else
            f"request rate {config.request_rate} req/s" +
            (f", max concurrency {config.max_concurrency}" if config.max_concurrency else ""))
    err.print(f"{config.num_prompts} requests to {config.url}, {mode}", markup=False, highlight=False)
    done, show = itertools.count(1), sys.stderr.isatty()

    def progress(record: RequestRecord) -> None:
        if show:
            sys.stderr.write(f"\r{next(done)}/{config.num_prompts} done")
            sys.stderr.flush()

    try:
        result = asyncio.run(run_benchmark(config, on_result=progress if show else None))
    except BenchError as e:
        err.print(f"inferd bench: {e}", markup=False, highlight=False)
        return 1
    finally:
        if show:
            sys.stderr.write("\n")
    print_report(result)
    if config.output_json:
        write_json(result, config.output_json)
    return 0 if result["failed"] == 0 else 1
