"""`inferd chat`: a terminal chat with the model's chat template, each reply streamed (a REPL on stdin; /reset
clears the conversation)."""

from __future__ import annotations

import argparse
import sys

from .engine_flags import add_engine_args, engine_config
from .generate import stream


def register(sub) -> None:
    c = sub.add_parser("chat", help="chat in the terminal with the model's chat template, streaming")
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--max-tokens", type=int, default=512)
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--top-p", type=float, default=0.9)
    c.add_argument("--seed", type=int, default=None)
    add_engine_args(c)
    c.set_defaults(func=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    from ..engine import Engine, InvalidRequestError, SamplingParams

    engine = Engine.from_config(engine_config(args))
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    if interactive:
        print("inferd chat: type a message; /reset clears the conversation, Ctrl-D quits.", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        if not line:
            return 0
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        try:
            rid = engine.add_request(prompt, params)
        except InvalidRequestError as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        text = []

        class _Tee:
            def write(self, s):
                text.append(s)  # noqa: B023 -- stream() below is the only user of this tee, within this iteration
                sys.stdout.write(s)

            def flush(self):
                sys.stdout.flush()

        stream(engine, rid, _Tee())
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(text)})

