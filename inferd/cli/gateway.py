"""`inferd gateway`: the OpenAI-compatible server in front of workers that run elsewhere (`inferd worker --listen`),
given by address or found in Redis."""

from __future__ import annotations

import argparse
import os
import sys

from ..config import DEFAULT_TIER_SHARES, DEFAULT_WORKER_ALLOW
from .common_args import add_embedding_model_arg, add_gateway_lora_args, add_server_args, worker_allow
from .server import embedding_models, run_http_server
from .types import tier_shares_arg


def register(sub) -> None:
    gw = sub.add_parser("gateway", help="the OpenAI-compatible HTTP server in front of workers that run elsewhere "
                        "(inferd worker --listen HOST:PORT)")
    add_server_args(gw, rollouts=False)  # no local workers: no rollouts
    gw.add_argument("--worker", action="append", default=[], metavar="HOST:PORT",
                    help="a worker to connect to (repeat for several); with --redis, registered workers join too")
    gw.add_argument("--model", default=None, help="the workers' model (HF folder or .gguf): its tokenizer is "
                    "loaded here (default: SmolLM2-135M-Instruct)")
    add_embedding_model_arg(gw, remote=True)
    add_gateway_lora_args(gw)
    gw.add_argument("--embedding-worker", action="append", default=[], metavar="HOST:PORT",
                    help="an embedding worker of the (one) --embedding-model to connect to (repeat for several)")
    gw.add_argument("--tier-shares", type=tier_shares_arg, default=DEFAULT_TIER_SHARES, metavar="TIER=SHARE,...|strict",
                    help="each tier's nominal share of a worker's room, as the workers' own --tier-shares (default "
                    f"{DEFAULT_TIER_SHARES}); strict: tiers in strict priority")
    gw.add_argument("--worker-allow", type=worker_allow, default=",".join(DEFAULT_WORKER_ALLOW), metavar="CIDR,...",
                    help="with --redis: the networks a registered worker's address must be in, or it is never "
                    "connected to (default: loopback and private ranges; not link-local or public addresses)")
    gw.set_defaults(func=cmd_gateway)


def cmd_gateway(args: argparse.Namespace) -> int:
    from ..models.loader import default_model_path
    from ..worker.address import parse_address

    if not args.worker and args.redis is None:
        print("error: give the workers: --worker HOST:PORT (repeatable) or --redis URL (registered workers)",
              file=sys.stderr)
        return 2
    if args.embedding_worker and len(args.embedding_model) != 1:
        print("error: --embedding-worker needs exactly one --embedding-model (the one its workers serve)",
              file=sys.stderr)
        return 2
    model_path = os.path.abspath(args.model) if args.model else default_model_path()
    if not os.path.exists(model_path):
        print(f"error: model path {model_path} does not exist", file=sys.stderr)
        return 2
    try:
        for address in args.worker + args.embedding_worker:
            parse_address(address)
        embedding = embedding_models(args, model_path, None)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_http_server(args, model_path, worker_args=[], remote_workers=args.worker,
                           registry_url=args.redis, embedding_models=embedding,
                           embedding_workers=args.embedding_worker, worker_allow=args.worker_allow)

