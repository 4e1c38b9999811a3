"""`inferd keys`: tenants and their API keys in the keys file that `inferd serve --keys` reads (create, list,
revoke)."""

from __future__ import annotations

import argparse
import sys
import time

from ..config import DEFAULT_TIER, TIERS


def register(sub) -> None:
    k = sub.add_parser("keys", help="tenants and their API keys (the file `inferd serve --keys` reads)")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    kc = ksub.add_parser("create", help="create a key for a tenant (created or updated) and print it, once")
    kc.add_argument("--keys", required=True, metavar="FILE", help="the keys file (created if missing)")
    kc.add_argument("--tenant", required=True)
    kc.add_argument("--tier", choices=TIERS, default=None, help=f"priority tier (new tenants: {DEFAULT_TIER})")
    kc.add_argument("--rpm", type=int, default=None, help="requests per rate window (default: unlimited)")
    kc.add_argument("--tpm", type=int, default=None, help="tokens (prompt + max_tokens, refunded to the tokens "
                    "used) per rate window (default: unlimited)")
    kc.add_argument("--max-concurrency", type=int, default=None, help="requests in flight (default: unlimited)")
    kc.add_argument("--weight", type=float, default=None, help="fair-share weight (default 1)")
    kc.add_argument("--cache-group", default=None, metavar="NAME",
                    help="share cached prompt prefixes with the tenants of this group (default: with nobody: a "
                    "tenant must not learn from cache hits or latency what another one sent)")
    kc.add_argument("--adapters", default=None, metavar="A,B",
                    help="the LoRA adapters the tenant may use, by name (\"*\": all; default for a new tenant: none, "
                         "only the base model)")
    kc.add_argument("--allow-grammar", choices=("yes", "no"), default=None,
                    help="whether the tenant may use the free-form `grammar` kind of structured outputs (EBNF, whose "
                    "matching cost the client controls; no: a 403 grammar_not_allowed). Default: yes for a new tenant")
    kl = ksub.add_parser("list", help="list tenants and keys (never the keys themselves)")
    kl.add_argument("--keys", required=True, metavar="FILE")
    kr = ksub.add_parser("revoke", help="revoke a key by its id (or the whole key)")
    kr.add_argument("--keys", required=True, metavar="FILE")
    kr.add_argument("key")
    k.set_defaults(func=cmd_keys)


def cmd_keys(args: argparse.Namespace) -> int:
    from ..gateway.tenants import KeyStore, create_key, revoke_key

    if args.keys_command == "create":
        try:
            key, tenant = create_key(args.keys, args.tenant, args.tier, args.rpm, args.tpm, args.max_concurrency,
                                     args.weight, args.cache_group,
                                     None if args.allow_grammar is None else args.allow_grammar == "yes",
                                     None if args.adapters is None else [a for a in args.adapters.split(",") if a])
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(key)
        print(f"created a key for tenant {tenant.name} (tier {tenant.tier}, rpm {tenant.rpm or '-'}, tpm "
              f"{tenant.tpm or '-'}, concurrency {tenant.max_concurrency or '-'}, weight {tenant.weight:g}, grammar "
              f"{'yes' if tenant.allow_grammar else 'no'}) in "
              f"{args.keys}; it is shown only this once", file=sys.stderr)
        return 0
    try:
        store = KeyStore.load(args.keys)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.keys_command == "list":
        print(f"{'tenant':<20} {'tier':<12} {'rpm':>8} {'tpm':>10} {'conc':>5} {'weight':>6} {'grammar':<7} "
              "cache group")
        for t in store.tenants.values():
            print(f"{t.name:<20} {t.tier:<12} {t.rpm or '-':>8} {t.tpm or '-':>10} {t.max_concurrency or '-':>5} "
                  f"{t.weight:>6g} {'yes' if t.allow_grammar else 'no':<7} {t.cache_group or '-'}")
        print(f"\n{'key id':<14} {'tenant':<20} {'created':<20} revoked")
        for r in store.keys.values():
            revoked = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.revoked)) if r.revoked else "-"
            print(f"{r.id:<14} {r.tenant:<20} {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(r.created)):<20} "
                  f"{revoked}")
        return 0
    try:
        record = revoke_key(args.keys, args.key)
    except KeyError:
        print(f"error: no key {args.key!r} in {args.keys}", file=sys.stderr)
        return 2
    print(f"revoked key {record.id} of tenant {record.tenant}", file=sys.stderr)
    return 0

