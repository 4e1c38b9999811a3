"""`inferd generate`: one raw prompt (no chat template) completed offline by the engine, printed as it streams."""

from __future__ import annotations

import argparse
import sys

from .engine_flags import add_engine_args, engine_config


def register(sub) -> None:
    g = sub.add_parser("generate", help="complete one raw prompt (no chat template) and print it as it streams")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)


def stream(engine, request_id: str, out=sys.stdout) -> None:
    """Step the engine until request_id finishes, writing its new text to out as it comes."""
    done = False
    while not done:
        for o in engine.step():
            if o.request_id == request_id:
                out.write(o.new_text)
                out.flush()
                done = done or o.finished


def cmd_generate(args: argparse.Namespace) -> int:
    from ..engine import Engine, InvalidRequestError, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    try:  # bad parameters fail before the model loads
        params.validate()
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        engine = Engine.from_config(engine_config(args))
    except ValueError as e:  # a configuration the model cannot take (e.g. --tensor-parallel that does not divide it)
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        rid = engine.add_request(engine.tokenizer.encode(args.prompt), params)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        engine.close()
        return 2
    try:
        stream(engine, rid)
    finally:
        engine.close()
    print()
    return 0

