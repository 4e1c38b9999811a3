"""`inferd rollout`: start, watch, promote or abort a new model version's rollout on a running server, through its
admin API."""

from __future__ import annotations

import argparse
import os
import sys

from ..config import DEFAULT_HOST, DEFAULT_PORT, WORKER_START_TIMEOUT_S


def register(sub) -> None:
    ro = sub.add_parser("rollout", help="roll a new model version out on a running server (admin API)")
    rsub = ro.add_subparsers(dest="rollout_command", required=True)
    rs = rsub.add_parser("start", help="start new-version workers beside the old ones and give them a canary share")
    rs.add_argument("--model", default=None, help="the served model name (checked against the server's)")
    rs.add_argument("--version", required=True, help="the new version's name, e.g. v2")
    rs.add_argument("--path", required=True, help="the new version's weights (HF folder or .gguf)")
    rs.add_argument("--canary", type=float, default=None, help="percent of new requests for the new version "
                    "(default 10)")
    for name, text in (("status", "the rollout's state and each version's figures"),
                       ("promote", "send every new request to the new version and retire the old workers"),
                       ("abort", "roll back: retire the new version's workers")):
        rsub.add_parser(name, help=text)
    for sp in rsub.choices.values():
        sp.add_argument("--url", default=f"http://{DEFAULT_HOST}:{DEFAULT_PORT}", help="the server")
        sp.add_argument("--admin-key", default=None, help="default: $INFERD_ADMIN_KEY")
    ro.set_defaults(func=cmd_rollout)


def cmd_rollout(args: argparse.Namespace) -> int:
    """The admin API's rollout commands, over HTTP."""
    import json

    import httpx

    key = args.admin_key or os.environ.get("INFERD_ADMIN_KEY")
    if not key:
        print("error: give --admin-key (or set INFERD_ADMIN_KEY)", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {key}"}
    base = args.url.rstrip("/") + "/admin/rollout"
    try:
        if args.rollout_command == "status":
            response = httpx.get(base, headers=headers, timeout=30)
        elif args.rollout_command == "start":
            body = {"model": args.model, "version": args.version, "path": os.path.abspath(args.path),
                    "canary": args.canary}
            response = httpx.post(base + "/start", json=body, headers=headers, timeout=WORKER_START_TIMEOUT_S)
        else:
            response = httpx.post(f"{base}/{args.rollout_command}", headers=headers, timeout=60)
    except httpx.HTTPError as e:
        print(f"error: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    try:
        payload = response.json()
    except ValueError:
        payload = {"error": {"message": response.text}}
    if response.status_code != 200:
        print(f"error ({response.status_code}): {payload.get('error', {}).get('message', payload)}", file=sys.stderr)
        return 1
    print(json.dumps(payload, indent=2))
    return 0

