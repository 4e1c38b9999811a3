"""serve and gateway: from the parsed flags to the running API server (its options, autoscaler, rollout targets,
embedding models), after the checks that refuse an unsafe or impossible start."""

from __future__ import annotations

import argparse
import os
import sys

from .credentials import is_loopback, read_key, read_worker_secret


def run_http_server(args: argparse.Namespace, model_path: str, **backend) -> int:
    """Run the API server of serve or gateway (backend: ServeOptions' fields for their workers) until it stops;
    2 for keys, a secret or an autoscaler setting it cannot start with."""
    from ..api.server import ServeOptions, default_served_name, run_server

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
        lora = lora_options(args)
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
                        tier_shares=args.tier_shares,
                        sse_keepalive=args.sse_keepalive, replay_timeout=args.replay_timeout, autoscale=autoscale,
                        sse_write_timeout=args.sse_write_timeout, tenant_queue_share=args.tenant_queue_share,
                        limit_concurrency=args.limit_concurrency, http_head_timeout=args.http_head_timeout,
                        http_body_timeout=args.http_body_timeout, http_idle_per_address=args.http_idle_per_address,
                        http_keep_alive=args.http_keep_alive,
                        worker_secret=worker_secret, metrics_key=metrics_key,
                        autoscale_local=getattr(args, "autoscale", False), autoscale_window=args.autoscale_window,
                        rollout=rollout_targets(args) if hasattr(args, "rollout_min_requests") else None,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                        allow_grammar=not args.no_grammar, disable_any_whitespace=args.disable_any_whitespace,
                        state_dir=None if args.state_dir == "" else (args.state_dir or default_state_dir()),
                        batch_concurrency=args.batch_concurrency,
                        batch_storage_per_tenant=args.batch_storage_per_tenant or None,
                        batch_retention=args.batch_retention or None, lora=lora, **backend)
    return run_server(opts)


def lora_options(args: argparse.Namespace):
    """The LoRA adapters' settings of the API process (--enable-lora and its limits, --lora-modules); None: off."""
    from ..models.lora_format import parse_modules

    modules = parse_modules(getattr(args, "lora_modules", None) or [])
    if not getattr(args, "enable_lora", False):
        if modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    from ..api.lora_catalog import LoraOptions

    return LoraOptions(tuple(modules), args.max_lora_rank, args.max_lora_bytes, args.lora_root)


def embedding_models(args: argparse.Namespace, model_path: str, local_args: list[str] | None) -> list:
    """--embedding-model (repeatable) -> EmbeddingModelSpec's; local_args: the options of their local workers
    (serve), None: remote workers (gateway). ValueError: a model that is not there, or two models of one name."""
    if not args.embedding_model:
        return []
    from ..api.server import EmbeddingModelSpec, default_served_name
    from ..models.embedding_models import embedding_model_name, resolve_embedding_model

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


def default_state_dir() -> str:
    from ..models.tokenizer import cache_dir

    return str(cache_dir() / "state")


def autoscaler_config(args: argparse.Namespace):
    if args.worker_capacity is None:
        return None
    from ..cluster.autoscaler import AutoscalerConfig

    return AutoscalerConfig(worker_capacity=args.worker_capacity, min_workers=args.min_workers,
                            max_workers=args.max_workers, scale_down_cooldown_s=args.scale_down_cooldown,
                            warm_schedule=args.warm_schedule, warm_lead_s=args.warm_lead)


def rollout_targets(args: argparse.Namespace):
    from ..cluster.rollout import RolloutTargets

    return RolloutTargets(min_requests=args.rollout_min_requests, min_seconds=args.rollout_min_seconds,
                          max_error_rate_increase=args.rollout_max_error_increase,
                          max_latency_ratio=args.rollout_max_latency_ratio, auto_promote=not args.no_auto_promote)

