"""`inferd worker`: one engine (or an embedding model, or the no-model echo) served to gateways over the worker
protocol."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..config import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_MODEL_VERSION, DEFAULT_SHUTDOWN_GRACE_S, WORKER_SECRET_ENV
from .common_args import add_embed_args, add_peak_args, add_worker_secret_args
from .credentials import is_loopback, read_worker_secret
from .engine_flags import add_engine_args, engine_config

# The parent at start-up, read when `inferd` imports its commands, before main() builds their parsers (which import
# httpx, numpy and rich) and long before the worker loads torch: `--die-with-parent` compares it with the parent
# after arming PR_SET_PDEATHSIG, to notice a parent that died in between. (The inferd.cli modules import nothing
# slow at their top for this.)
_PARENT_PID_AT_START = os.getppid()


def register(sub) -> None:
    w = sub.add_parser("worker", help="serve one engine to a gateway over the worker protocol (TCP)")
    add_worker_secret_args(w)
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, default=0, help="0 = pick a free port (printed in the READY line)")
    w.add_argument("--heartbeat-interval", type=float, default=DEFAULT_HEARTBEAT_INTERVAL,
                   help=f"seconds between heartbeats (default {DEFAULT_HEARTBEAT_INTERVAL})")
    w.add_argument("--die-with-parent", action=argparse.BooleanOptionalAction, default=False,
                   help="exit (SIGTERM) when the parent process dies (Linux); supervisors turn it on")
    w.add_argument("--worker-id", default=None, help="default: HOSTNAME-PID")
    w.add_argument("--listen", default=None, metavar="HOST:PORT", help="where gateways connect (instead of "
                   "--host/--port); e.g. 0.0.0.0:9000 on a GPU host")
    w.add_argument("--model-version", default=DEFAULT_MODEL_VERSION,
                   help=f"the version this worker serves, for rollouts (default {DEFAULT_MODEL_VERSION})")
    w.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
                   help="SIGTERM: seconds running requests get to finish; then they are handed back to the gateway, "
                   f"which replays them on another worker (default {DEFAULT_SHUTDOWN_GRACE_S:g})")
    w.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, every core)")
    w.add_argument("--register", default=None, metavar="REDIS_URL",
                   help="announce this worker in Redis (gateway --redis finds it); renewed every heartbeat")
    w.add_argument("--advertise", default=None, metavar="HOST:PORT",
                   help="the address registered for gateways (default: the listening one)")
    add_peak_args(w)
    w.add_argument("--task", choices=("generate", "embed"), default="generate",
                   help="embed: one vector per request (--model: 'default', an encoder folder, or a model our "
                        "engine loads: a decoder folder or .gguf, one prefill pass through the paged engine)")
    add_embed_args(w)
    w.add_argument("--echo", action="store_true", help="no model (only its config is read): every step gives each "
                   "request the next token of its prompt, until max_tokens")
    add_engine_args(w)
    w.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    if args.echo:
        from ..worker.echo import run_echo_worker as run_worker  # no model: answers echo the prompt
    elif args.task == "embed":
        from ..worker.server import run_embed_worker

        def run_worker(config, opts):
            return run_embed_worker(config, opts, args.embed_max_wait_ms / 1000, args.embed_max_batch_tokens,
                                    args.embed_pooling, args.embed_normalize)
    else:
        from ..worker.server import run_worker
    from ..worker.server import WorkerRunOptions

    host, port = args.host, args.port
    if args.listen is not None:
        from ..worker.address import parse_address

        try:
            host, port = parse_address(args.listen, allow_any_port=True)
        except ValueError as e:
            print(f"error: --listen: {e}", file=sys.stderr)
            return 2
    try:
        secret = read_worker_secret(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not secret and not is_loopback(host):
        print(f"error: refusing to listen on {host} without a worker secret: anyone who can reach the port could "
              f"add, abort or shut down work. Give --worker-secret-file FILE (or ${WORKER_SECRET_ENV}) here and to "
              "the gateways, or listen on a loopback address.", file=sys.stderr)
        return 2
    opts = WorkerRunOptions(host=host, port=port, heartbeat_interval=args.heartbeat_interval,
                            worker_id=args.worker_id,
                            parent_pid=_PARENT_PID_AT_START if args.die_with_parent else None,
                            version=args.model_version, shutdown_grace=args.shutdown_grace, threads=args.threads,
                            register=args.register, advertise=args.advertise, peak_bandwidth=args.peak_bandwidth,
                            peak_flops=args.peak_flops, secret=secret)
    code = run_worker(engine_config(args), opts)
    # nothing is left to clean up: skip the interpreter's teardown (about a second with torch loaded), so that a
    # drained worker's exit is seen at once by whoever waits for it
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

