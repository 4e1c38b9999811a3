"""`inferd serve`: the OpenAI-compatible server with its own local worker processes, each started as `inferd worker`
with serve's engine flags."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from .common_args import add_embed_args, add_embedding_model_arg, add_peak_args, add_server_args
from .engine_flags import add_engine_args, engine_argv, engine_config
from .server import embedding_models, run_http_server


def register(sub) -> None:
    s = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (starts and supervises its worker processes)")
    add_server_args(s)
    s.add_argument("--workers", type=int, default=1, help="local worker processes, each its own engine (default 1)")
    s.add_argument("--threads", type=int, default=None,
                   help="torch threads per worker (default: the cores divided among the workers)")
    add_embedding_model_arg(s, remote=False)
    add_embed_args(s)
    s.add_argument("--echo", action="store_true", help="run echo workers (no model; answers repeat the prompt's "
                   "tokens): measures the server alone (bench/gateway_overhead.py)")
    add_peak_args(s)
    s.add_argument("--autoscale", action="store_true", help="start and retire local workers to match the "
                   "autoscaler's desired count (needs --worker-capacity)")
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)


def worker_args(args: argparse.Namespace, model_path: str) -> list[str]:
    """The engine options of `inferd serve`, as `inferd worker` arguments: the heartbeat, each engine setting that is
    not the default (engine_flags' table), and --echo."""
    config = dataclasses.replace(engine_config(args), model=model_path)
    out = ["--heartbeat-interval", str(args.heartbeat_interval), *engine_argv(config)]
    if getattr(args, "echo", False):
        out.append("--echo")
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    from ..models.loader import default_model_path

    model_path = os.path.abspath(args.model) if args.model else default_model_path()
    if not os.path.exists(model_path):
        print(f"error: model path {model_path} does not exist", file=sys.stderr)
        return 2
    if args.workers < 1:
        print("error: --workers must be at least 1", file=sys.stderr)
        return 2
    if args.autoscale and args.worker_capacity is None:
        print("error: --autoscale needs --worker-capacity (tokens/s one worker sustains)", file=sys.stderr)
        return 2
    threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 1) // args.workers)
    extra = ["--threads", str(threads), "--shutdown-grace", str(args.shutdown_grace)]
    for flag, value in (("--peak-bandwidth", args.peak_bandwidth), ("--peak-flops", args.peak_flops)):
        if value is not None:
            extra += [flag, repr(value)]
    try:
        # embedding workers: serve's dtype, device and sequences per step, not its generation settings
        engine = engine_argv(engine_config(args), only=("dtype", "device", "max_num_seqs"))
        embedding = embedding_models(args, model_path, [
            *engine, "--heartbeat-interval", str(args.heartbeat_interval), *extra])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_http_server(args, model_path, worker_args=worker_args(args, model_path) + extra, workers=args.workers,
                           embedding_models=embedding)
