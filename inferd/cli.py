"""The `inferd` command: serve (the OpenAI-compatible server, which runs its own worker process); worker (one
engine behind the worker protocol, for a gateway); bench (a load generator for a running server); generate (one
raw prompt, offline) and chat (a terminal chat), both streaming."""

from __future__ import annotations

import argparse
import os
import re
import sys

# The parent at start-up, read before the slow imports below: `worker --die-with-parent` compares it with the parent
# after arming PR_SET_PDEATHSIG, to notice a parent that died in between.
_PARENT_PID_AT_START = os.getppid()

from .config import (DEFAULT_BLOCK_SIZE, DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_HOST,
                     DEFAULT_KV_CACHE_BYTES, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_PORT,
                     MAX_REQUEST_BODY_BYTES, EngineConfig)


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '1G', '1.5GiB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 536870912, 512M, 2G)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bf16 where the device computes it natively, else fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-cache-bytes", type=parse_bytes, default=DEFAULT_KV_CACHE_BYTES,
                   help="size of the KV cache pool (default 1G)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    p.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS, help="running sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                   help="token budget of one step")
    p.add_argument("--no-prefix-caching", action="store_true")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                        kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                        enable_prefix_caching=not args.no_prefix_caching)


def _stream(engine, request_id: str, out=sys.stdout) -> None:
    done = False
    while not done:
        for o in engine.step():
            if o.request_id == request_id:
                out.write(o.new_text)
                out.flush()
                done = done or o.finished


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine import Engine, InvalidRequestError, SamplingParams

    engine = Engine.from_config(engine_config(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    try:
        rid = engine.add_request(engine.tokenizer.encode(args.prompt), params)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _stream(engine, rid)
    print()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from .engine import Engine, InvalidRequestError, SamplingParams

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
                text.append(s)
                sys.stdout.write(s)

            def flush(self):
                sys.stdout.flush()

        _stream(engine, rid, _Tee())
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(text)})


def worker_args(args: argparse.Namespace, model_path: str) -> list[str]:
    """The engine options of `inferd serve`, as `inferd worker` arguments."""
    out = ["--model", model_path, "--dtype", args.dtype, "--device", args.device,
           "--kv-cache-bytes", str(args.kv_cache_bytes), "--block-size", str(args.block_size),
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--heartbeat-interval", str(args.heartbeat_interval)]
    if args.max_model_len is not None:
        out += ["--max-model-len", str(args.max_model_len)]
    if args.no_prefix_caching:
        out.append("--no-prefix-caching")
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    from .api.server import ServeOptions, default_served_name, run_server
    from .models.loader import default_model_path

    model_path = os.path.abspath(args.model) if args.model else default_model_path()
    if not os.path.exists(model_path):
        print(f"error: model path {model_path} does not exist", file=sys.stderr)
        return 2
    api_key = args.api_key if args.api_key is not None else os.environ.get("INFERD_API_KEY") or None
    opts = ServeOptions(host=args.host, port=args.port, model_path=model_path,
                        served_model_name=args.served_model_name or default_served_name(model_path),
                        worker_args=worker_args(args, model_path), api_key=api_key,
                        max_body_bytes=args.max_body_bytes, heartbeat_timeout=args.heartbeat_timeout,
                        shutdown_grace=args.shutdown_grace, log_level=args.log_level)
    return run_server(opts)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.loadgen import cmd_bench as run

    return run(args)


def cmd_worker(args: argparse.Namespace) -> int:
    from .worker.server import run_worker

    return run_worker(engine_config(args), host=args.host, port=args.port, heartbeat_interval=args.heartbeat_interval,
                      worker_id=args.worker_id,
                      parent_pid=_PARENT_PID_AT_START if args.die_with_parent else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferd", description="inferd: LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (starts and supervises a worker process)")
    s.add_argument("--host", default=DEFAULT_HOST)
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 = pick a free port (printed in the READY line)")
    s.add_argument("--served-model-name", default=None, help="the model id clients use (default: the file's name)")
    s.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer KEY); "
                   "default: $INFERD_API_KEY, else no key")
    s.add_argument("--max-body-bytes", type=parse_bytes, default=MAX_REQUEST_BODY_BYTES,
                   help="largest request body accepted (413 beyond; default 8M)")
    s.add_argument("--heartbeat-interval", type=float, default=DEFAULT_HEARTBEAT_INTERVAL,
                   help=f"seconds between the worker's heartbeats (default {DEFAULT_HEARTBEAT_INTERVAL})")
    s.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT,
                   help=f"silence after which the worker is declared dead (default {DEFAULT_HEARTBEAT_TIMEOUT} s)")
    s.add_argument("--shutdown-grace", type=float, default=5.0,
                   help="seconds open responses get to finish after SIGTERM (default 5)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="load-test a running OpenAI-compatible server (TTFT, TPOT, ITL, throughput)")
    from .bench.loadgen import add_bench_arguments

    add_bench_arguments(b)
    b.set_defaults(func=cmd_bench)

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

    c = sub.add_parser("chat", help="chat in the terminal with the model's chat template, streaming")
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--max-tokens", type=int, default=512)
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--top-p", type=float, default=0.9)
    c.add_argument("--seed", type=int, default=None)
    add_engine_args(c)
    c.set_defaults(func=cmd_chat)

    w = sub.add_parser("worker", help="serve one engine to a gateway over the worker protocol (TCP)")
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, default=0, help="0 = pick a free port (printed in the READY line)")
    w.add_argument("--heartbeat-interval", type=float, default=DEFAULT_HEARTBEAT_INTERVAL,
                   help=f"seconds between heartbeats (default {DEFAULT_HEARTBEAT_INTERVAL})")
    w.add_argument("--die-with-parent", action=argparse.BooleanOptionalAction, default=False,
                   help="exit (SIGTERM) when the parent process dies (Linux); supervisors turn it on")
    w.add_argument("--worker-id", default=None, help="default: HOSTNAME-PID")
    add_engine_args(w)
    w.set_defaults(func=cmd_worker)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
