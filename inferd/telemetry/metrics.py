"""Prometheus metrics of the API process: requests, latencies, tokens, the server's own overhead, and the worker's
engine state (read from its latest heartbeat at scrape time). One registry per app, so that several apps in one
process (tests) never share counters."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # the *_created series double the output and no dashboard reads them

# latency buckets, seconds: dense where interactive serving lives (10 ms - 2 s), sparse out to minutes
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                         1.0, 2.5, 5.0)
UTILIZATION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

# every value a labelled series takes, exported at zero from the start: a fresh server's /metrics then has the series
# the dashboard and absent() alerts query, instead of nothing until the first request of each kind
FINISH_REASONS = ("stop", "length", "tool_calls", "abort")  # engine's FinishReason + the API's tool_calls
ADMISSION_OUTCOMES = ("admitted", "overloaded", "queue_share", "shed", "queue_timeout", "replayed", "replay_failed",
                      "rate_limited_requests", "rate_limited_tokens", "rate_limited_concurrency",
                      "rate_limited_too_large")  # inferd/gateway/admission.py, failover.py; limits' reasons
REPLAY_REASONS = ("worker_lost", "drain")
BATCH_LINE_OUTCOMES = ("ok", "error", "retried", "invalid")
REFUSING_ENDPOINTS = ("chat", "completions", "embeddings")


class Metrics:
    def __init__(self, model: str, engine_stats: Callable[[], object | None] = lambda: None,
                 workers: Callable[[], list] = lambda: [], affinity: Callable[[], tuple[int, int]] = lambda: (0, 0)):
        """engine_stats: returns the latest WorkerStats, summed over the workers (or None before the first
        heartbeat). workers: the attached WorkerClients (per-worker series)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("inferd_requests", "HTTP requests by route and status code", ["route", "status"],
                                registry=r)
        self.finished = Counter("inferd_request_finished", "Finished generations by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("inferd_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("inferd_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("inferd_time_to_first_token_seconds", "Receipt of the request to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("inferd_time_per_output_token_seconds",
                              "Mean time between output tokens of a request, after the first",
                              buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("inferd_e2e_request_latency_seconds", "Receipt of the request to its last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("inferd_engine_step_seconds", "Duration of one engine step (worker side)",
                                   buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.dispatch_overhead = Histogram(
            "inferd_server_dispatch_seconds", "Server's own time from receipt of a request to its dispatch to the "
            "worker (parsing, validation, tokenization)", buckets=OVERHEAD_BUCKETS, registry=r)
        self.write_overhead = Histogram(
            "inferd_server_token_write_seconds", "Server's own time from a token's arrival from the worker to its "
            "SSE write", buckets=OVERHEAD_BUCKETS, registry=r)
        self.gateway_overhead = Histogram(
            "inferd_gateway_overhead_seconds", "Time the API/gateway process adds to a request: receipt to the end "
            "of its response, less the time spent waiting in the queue and for the worker", buckets=OVERHEAD_BUCKETS,
            registry=r)
        self.refused_after_tokenizing = Counter(
            "inferd_refused_after_tokenizing", "Requests refused by validation after their inputs were tokenized (or "
            "read as token ids): work spent on requests never served, by endpoint", ["endpoint"], registry=r)
        self.embedding_requests = Counter("inferd_embedding_requests", "/v1/embeddings requests served", registry=r)
        self.embedding_inputs = Counter("inferd_embedding_inputs", "Inputs embedded (one vector each)", registry=r)
        self.embedding_passes = Gauge("inferd_embedding_model_passes", "Forward passes the embedding workers ran "
                                      "(their dynamic batching: fewer passes than inputs)", registry=r)
        # the gateway: quotas, the queue, admission
        self.admissions = Counter("inferd_gateway_admissions", "Generation requests by admission outcome",
                                  ["outcome"], registry=r)
        self.queue_requests = Gauge("inferd_queue_requests", "Requests waiting in the gateway's queue", ["tier"],
                                    registry=r)
        self.queue_tokens = Gauge("inferd_queue_tokens", "Reserved tokens of the requests in the queue", registry=r)
        self.queue_tier_tokens = Gauge("inferd_queue_tier_tokens", "Reserved tokens of the requests in the queue, by "
                                       "tier", ["tier"], registry=r)
        self.queue_requests_max = Gauge("inferd_queue_requests_high_water", "Most requests ever in the queue at once",
                                        registry=r)
        self.queue_tokens_max = Gauge("inferd_queue_tokens_high_water", "Most reserved tokens ever in the queue",
                                      registry=r)
        self.queue_wait = Histogram("inferd_queue_wait_seconds", "Time from admission to dispatch to a worker",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.drain_rate = Gauge("inferd_drain_tokens_per_second", "Measured rate at which admitted work completes "
                                "(prompt + generated tokens per second)", registry=r)
        self.tenant_service = Counter("inferd_tenant_service", "Weighted service given to a tenant (VTC units: prompt "
                                      "tokens x 1 + generated tokens x 2, over the tenant's weight)", ["tenant"],
                                      registry=r)
        self.tenant_tokens = Counter("inferd_tenant_tokens", "Tokens charged to a tenant's quota (after refunds)",
                                     ["tenant"], registry=r)
        self.tier_generated = Counter("inferd_tier_generated_tokens", "Tokens generated for each tier's requests "
                                      "(what the capacity shares divide)", ["tier"], registry=r)
        # roofline (inferd/telemetry/roofline.py): what bounds a step
        self.step_bytes = Counter("inferd_engine_bytes_read", "Bytes engine steps read (weights once per step, as "
                                  "stored, + the KV cache attended)", registry=r)
        self.step_flops = Counter("inferd_engine_flops", "FLOPs engine steps computed", registry=r)
        self.step_mbu = Histogram("inferd_step_bandwidth_utilization", "Model-bandwidth utilisation of an engine "
                                  "step: bytes read / step time / the device's peak bandwidth",
                                  buckets=UTILIZATION_BUCKETS, registry=r)
        self.step_mfu = Histogram("inferd_step_flops_utilization", "Model-FLOP utilisation of an engine step: FLOPs "
                                  "/ step time / the device's peak FLOP/s", buckets=UTILIZATION_BUCKETS, registry=r)
        # speculative decoding (`--speculative ngram`)
        self.spec_drafted = Counter("inferd_spec_draft_tokens", "Speculative draft tokens verified", registry=r)
        self.spec_accepted = Counter("inferd_spec_accepted_tokens", "Speculative draft tokens accepted (tokens that "
                                     "took no engine step of their own)", registry=r)
        # the cluster
        self.replays = Counter("inferd_replays", "Streams moved to another worker mid-request, by why their worker "
                               "was lost (worker_lost: died or hung; drain: shut down)", ["reason"], registry=r)
        self.desired_workers = Gauge("inferd_desired_workers", "Workers the autoscaler wants (for an HPA/KEDA); "
                                     "without an autoscaler, the workers attached", registry=r)
        self.rollout_state = Gauge("inferd_rollout_state", "1 for the rollout's current state", ["state"],
                                   registry=r)
        r.register(_EngineCollector(model, engine_stats))
        r.register(_WorkerCollector(workers, affinity))
        self.batch_lines = Counter("inferd_batch_lines", "Batch API lines by outcome: ok, error (the line's result "
                                   "is an error), retried (the service was busy: it runs again later), invalid "
                                   "(refused when its input file was validated)", ["outcome"], registry=r)
        self.lora_loaded = Gauge("inferd_lora_adapters_served", "LoRA adapters this server serves (loaded, not "
                                 "unloaded)", registry=r)
        self.lora_requests = Counter("inferd_lora_requests", "Generation requests admitted for a LoRA adapter",
                                     ["adapter"], registry=r)
        self.sse_write_timeouts = Counter("inferd_sse_write_timeouts", "Streams closed because their client read "
                                          "nothing for --sse-write-timeout", registry=r)
        self._gateway = None
        self._tenants = None
        self._export_known_labels()

    def _export_known_labels(self) -> None:
        """Every known label value's series at zero (a labelled family has no sample until .labels() is called)."""
        from ..config import TIERS

        for family, values in ((self.finished, FINISH_REASONS), (self.admissions, ADMISSION_OUTCOMES),
                               (self.replays, REPLAY_REASONS), (self.batch_lines, BATCH_LINE_OUTCOMES),
                               (self.refused_after_tokenizing, REFUSING_ENDPOINTS), (self.queue_requests, TIERS),
                               (self.queue_tier_tokens, TIERS), (self.tier_generated, TIERS)):
            for value in values:
                family.labels(value)

    def watch_tenants(self, tenants: Callable[[], dict]) -> None:
        """Exports each tenant's quota (tenants(): name -> Tenant, read at scrape time, so a reloaded keys file
        shows at once)."""
        if self._tenants is None:
            self.registry.register(_TenantCollector(lambda: self._known_tenants()))
        self._tenants = tenants
        self._known_tenants()

    def _known_tenants(self) -> dict:
        """The tenants, each one's usage counters exported at zero before its first request (a tenant a reloaded keys
        file adds: from the next scrape on, as this runs while one is collected)."""
        tenants = self._tenants() if self._tenants is not None else {}
        for name in tenants:
            self.tenant_tokens.labels(name)
            self.tenant_service.labels(name)
        return tenants

    def watch_gateway(self, gateway) -> None:
        """Exports what the gateway's admitted requests hold (read at scrape time): the room and leases that must all
        come back when the requests end."""
        if self._gateway is None:
            self.registry.register(_GatewayCollector(lambda: self._gateway,
                                                     lambda: self._tenants() if self._tenants is not None else {}))
        self._gateway = gateway

    def render(self, tenants: bool = True) -> bytes:
        """The exposition text; tenants=False leaves out every series labelled by tenant (who the tenants are,
        their tiers, quotas and usage), for whoever has no key to see them."""
        return generate_latest(self.registry if tenants else _WithoutTenants(self.registry))

    def observe_step(self, hello, seconds: float, nbytes: int, flops: int, drafted: int = 0,
                     accepted: int = 0) -> None:
        """One engine step of a worker (hello: its peaks)."""
        self.step_time.observe(seconds)
        if drafted:
            self.spec_drafted.inc(drafted)
            self.spec_accepted.inc(accepted)
        if seconds <= 0 or not nbytes:
            return
        self.step_bytes.inc(nbytes)
        self.step_flops.inc(flops)
        if hello is not None and hello.peak_bandwidth > 0 and hello.peak_flops > 0:
            self.step_mbu.observe(nbytes / seconds / hello.peak_bandwidth)
            self.step_mfu.observe(flops / seconds / hello.peak_flops)


class _EngineCollector:
    """The worker's state as of its latest heartbeat: gauges and the engine's own counters."""

    def __init__(self, model: str, engine_stats: Callable[[], object | None]):
        self.model = model
        self.engine_stats = engine_stats

    def describe(self):
        return []

    def collect(self):
        stats = self.engine_stats()
        if stats is None:
            return
        gauges = {"inferd_num_requests_running": ("Requests in the engine's running batch", stats.running),
                  "inferd_num_requests_waiting": ("Requests waiting in the engine", stats.waiting),
                  "inferd_kv_blocks_in_use": ("KV cache blocks referenced by requests", stats.kv_blocks_in_use),
                  "inferd_kv_blocks_total": ("KV cache blocks in the pool", stats.kv_num_blocks)}
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=["model"])
            family.add_metric([self.model], value)
            yield family
        counters = {"inferd_prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache",
                                                       stats.prefix_cache_hits),
                    "inferd_prefix_cache_query_tokens": ("Prompt tokens looked up in the prefix cache",
                                                         stats.prefix_cache_queries),
                    "inferd_preemptions": ("Requests preempted (recomputed later)", stats.num_preemptions),
                    "inferd_engine_steps": ("Engine steps run", stats.num_steps),
                    "inferd_engine_busy_seconds": ("Engine steps' wall time, summed", stats.step_seconds_total)}
        for name, (doc, value) in counters.items():
            family = CounterMetricFamily(name, doc, labels=["model"])
            family.add_metric([self.model], value)
            yield family


class _GatewayCollector:
    """Open requests (admitted, not finished), the worker room they take, per tenant what they reserved, and the
    concurrency leases the in-process limiter holds."""

    def __init__(self, gateway: Callable[[], object | None], tenants: Callable[[], dict]):
        self.gateway = gateway
        self.tenants = tenants  # the known ones: exported at zero while they hold nothing

    def describe(self):
        return []

    def collect(self):
        g = self.gateway()
        if g is None:
            return
        yield GaugeMetricFamily("inferd_gateway_open_requests", "Admitted requests not finished (waiting, running "
                                "or being moved to another worker)", value=g.num_open)
        yield GaugeMetricFamily("inferd_gateway_in_flight_sequences", "Sequences bound to a worker (or being moved "
                                "to another): the workers' room in use", value=g.num_in_flight)
        yield from _tier_families(g)
        yield GaugeMetricFamily("inferd_gateway_settlements_pending", "Quota settlements not done yet (retried "
                                "while the limiter fails)", value=g.num_settling)
        open_requests = GaugeMetricFamily("inferd_tenant_open_requests", "A tenant's admitted requests not finished",
                                          labels=["tenant"])
        reserved = GaugeMetricFamily("inferd_tenant_reserved_tokens", "Tokens a tenant's open requests reserved",
                                     labels=["tenant"])
        by_tenant = {**dict.fromkeys(self.tenants(), (0, 0)), **g.open_by_tenant}
        for tenant, (count, tokens) in sorted(by_tenant.items()):
            open_requests.add_metric([tenant], count)
            reserved.add_metric([tenant], tokens)
        yield open_requests
        yield reserved
        in_flight = getattr(g.limiter, "leases_held", None)
        if in_flight is not None:
            leases = GaugeMetricFamily("inferd_tenant_concurrency_leases", "Concurrency slots the in-process limiter "
                                       "holds for a tenant", labels=["tenant"])
            for tenant, count in sorted(in_flight().items()):
                leases.add_metric([tenant], count)
            yield leases


def _tier_families(g):
    """Per tier: its configured share, the sequences the gateway bound to workers and those beyond the tier's own
    seats there; the workers' engines' running sequences per tier, those beyond the tier's own seats (borrowed), and
    preemptions (inferd/engine/tier_shares.py)."""
    from ..config import TIERS

    shares = g.shares
    share = GaugeMetricFamily("inferd_tier_share", "A tier's nominal share of the seats (--tier-shares; absent when "
                              "strict)", labels=["tier"])
    bound = GaugeMetricFamily("inferd_tier_bound_sequences", "Sequences of a tier the gateway bound to workers",
                              labels=["tier"])
    over = GaugeMetricFamily("inferd_tier_bound_borrowed_sequences", "Sequences of a tier bound beyond its own "
                             "seats of the workers' room (lent by the other tiers)", labels=["tier"])
    seats = GaugeMetricFamily("inferd_tier_seats", "Running sequences of a tier in the workers' engines",
                              labels=["tier"])
    borrowed = GaugeMetricFamily("inferd_tier_borrowed_seats", "Running sequences of a tier beyond its own seats "
                                 "(lent by the other tiers; taken back by preemption when they need them)",
                                 labels=["tier"])
    preemptions = CounterMetricFamily("inferd_tier_preemptions", "Requests of a tier preempted by the engines "
                                      "(recomputed later)", labels=["tier"])
    running, lent, preempted = [0] * len(TIERS), [0] * len(TIERS), [0] * len(TIERS)
    for w in g.router.workers:
        stats, hello = w.latest_stats, w.hello
        if stats is None or w.dead is not None:
            continue
        for t in range(len(TIERS)):
            running[t] += stats.running_by_tier[t]
            preempted[t] += stats.preemptions_by_tier[t]
        if hello is not None:
            for t, n in enumerate(shares.borrowed(stats.running_by_tier, hello.max_num_seqs)):
                lent[t] += n
    for t, (tier, n, b) in enumerate(zip(TIERS, g.bound_by_tier(), g.borrowed_by_tier())):
        if shares.fractions is not None:
            share.add_metric([tier], shares.fractions[t])
        bound.add_metric([tier], n)
        over.add_metric([tier], b)
        seats.add_metric([tier], running[t])
        borrowed.add_metric([tier], lent[t])
        preemptions.add_metric([tier], preempted[t])
    yield from (share, bound, over, seats, borrowed, preemptions)


class _TenantCollector:
    """Each tenant's limits from the keys file: what its usage (inferd_tenant_tokens, inferd_tenant_open_requests)
    is measured against. A limit the tenant does not have is not exported."""

    LIMITS = (("rpm", "requests per rate window"), ("tpm", "tokens per rate window"),
              ("max_concurrency", "concurrent requests"))

    def __init__(self, tenants: Callable[[], dict]):
        self.tenants = tenants

    def describe(self):
        return []

    def collect(self):
        family = GaugeMetricFamily("inferd_tenant_quota", "A tenant's limit (rpm, tpm: per --rate-window; "
                                   "max_concurrency: requests at once)", labels=["tenant", "limit"])
        tier = GaugeMetricFamily("inferd_tenant_tier", "1 for a tenant's priority tier", labels=["tenant", "tier"])
        for name, tenant in sorted(self.tenants().items()):
            tier.add_metric([name, tenant.tier], 1)
            for limit, _ in self.LIMITS:
                value = getattr(tenant, limit)
                if value is not None:
                    family.add_metric([name, limit], value)
        yield family
        yield tier


WORKER_STATES = ("serving", "draining", "unresponsive", "dead")


def worker_state(w) -> str:
    """One word for a worker client: dead (lost), unresponsive (silent past the timeout), draining, or serving."""
    if w.dead is not None:
        return "dead"
    if w.unresponsive:
        return "unresponsive"
    return "draining" if w.draining else "serving"


class _WorkerCollector:
    """One series per attached worker: whether it takes work, its engine state, what the client dropped."""

    def __init__(self, workers: Callable[[], list], affinity: Callable[[], tuple[int, int]]):
        self.workers = workers
        self.affinity = affinity

    def describe(self):
        return []

    def collect(self):
        up = GaugeMetricFamily("inferd_worker_up", "1: the worker takes new work; 0: draining, unresponsive or dead",
                               labels=["worker", "version"])
        running = GaugeMetricFamily("inferd_worker_requests_running", "Requests in the worker's running batch",
                                    labels=["worker"])
        in_flight = GaugeMetricFamily("inferd_worker_streams", "Requests this gateway has in flight on the worker",
                                      labels=["worker"])
        kv = GaugeMetricFamily("inferd_worker_kv_usage", "Share of the worker's KV blocks referenced by requests",
                               labels=["worker"])
        hits = CounterMetricFamily("inferd_worker_prefix_cache_hit_tokens", "Prompt tokens served from the worker's "
                                   "prefix cache", labels=["worker"])
        queries = CounterMetricFamily("inferd_worker_prefix_cache_query_tokens", "Prompt tokens looked up in the "
                                      "worker's prefix cache", labels=["worker"])
        state = GaugeMetricFamily("inferd_worker_state", "1 for the worker's state (serving, draining, unresponsive, "
                                  "dead)", labels=["worker", "version", "state"])
        step_tokens = GaugeMetricFamily("inferd_worker_step_tokens", "Tokens the worker's batch ran in its latest "
                                        "step (decode rows + prefill chunks; 0 when idle)", labels=["worker"])
        stale = CounterMetricFamily("inferd_worker_stale_outputs", "Outputs dropped because their dispatch was given "
                                    "up (an old epoch) or their stream had ended", labels=["worker"])
        lora_held = GaugeMetricFamily("inferd_worker_lora_adapters", "LoRA adapters the worker holds in host memory",
                                      labels=["worker"])
        lora_slots = GaugeMetricFamily("inferd_worker_lora_slots_used", "LoRA adapters in the worker's model slots "
                                       "(--max-loras)", labels=["worker"])
        lora_loads = CounterMetricFamily("inferd_worker_lora_loads", "LoRA adapters written into a slot of the "
                                         "worker's model", labels=["worker"])
        lora_evictions = CounterMetricFamily("inferd_worker_lora_evictions", "LoRA adapters a slot dropped for "
                                             "another (kept in host memory)", labels=["worker"])
        for w in self.workers():
            if w.hello is None:
                continue
            name = w.hello.worker_id
            up.add_metric([name, w.hello.version], 1 if w.usable else 0)
            state.add_metric([name, w.hello.version, worker_state(w)], 1)
            in_flight.add_metric([name], w.num_streams)
            stale.add_metric([name], w.num_stale_outputs)
            s = w.latest_stats
            if s is not None:
                running.add_metric([name], s.running)
                step_tokens.add_metric([name], s.step_tokens)
                kv.add_metric([name], s.kv_blocks_in_use / s.kv_num_blocks if s.kv_num_blocks else 0.0)
                hits.add_metric([name], s.prefix_cache_hits)
                queries.add_metric([name], s.prefix_cache_queries)
                lora_held.add_metric([name], len(s.lora_adapters))
                lora_slots.add_metric([name], s.lora_slots_used)
                lora_loads.add_metric([name], s.lora_loads)
                lora_evictions.add_metric([name], s.lora_evictions)
        yield from (up, state, running, step_tokens, in_flight, kv, hits, queries, stale, lora_held, lora_slots,
                    lora_loads, lora_evictions)
        yield GaugeMetricFamily("inferd_workers_attached", "Workers attached and not lost (serving, draining or "
                                "unresponsive)", value=sum(1 for w in self.workers() if w.dead is None))
        chosen, asked = self.affinity()
        yield CounterMetricFamily("inferd_router_prefix_affinity_hits", "Dispatches sent to a worker because it was "
                                  "sent the prompt's prefix before", value=chosen)
        yield CounterMetricFamily("inferd_router_prefix_affinity_queries", "Dispatches of prompts of at least one "
                                  "full KV block", value=asked)


class _WithoutTenants:
    """A registry's view without its per-tenant series (what generate_latest reads: collect()). Every family is
    still announced (its HELP and TYPE lines name no tenant), as a labelled family with no sample yet is."""

    def __init__(self, registry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if "tenant" not in s.labels]
            yield family
