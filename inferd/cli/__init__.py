"""The `inferd` command: one module per command, each with register(sub) (its parser) and what it runs.

serve (the OpenAI-compatible server, which runs its own worker processes), gateway (the same server in front of
workers elsewhere), rollout (drive a rollout on a running server), keys (tenants and their keys), profile (the
roofline of a model on a device), plan (capacity planning), bench (a load generator for a running server), generate
(one raw prompt, offline) and chat (a terminal chat), both streaming, and worker (one engine behind the worker
protocol, for a gateway). Flags more than one command takes: common_args.py; the engine's: engine_flags.py."""

from __future__ import annotations

import argparse

from . import bench, chat, gateway, generate, keys, plan, profile, rollout, serve, worker
from .credentials import add_redis_password

COMMANDS = (serve, gateway, rollout, keys, profile, plan, bench, generate, chat, worker)  # in `inferd --help`'s order


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferd", description="inferd: LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    add_redis_password(args)
    return args.func(args)
