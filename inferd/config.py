"""Every limit and default of inferd, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_BLOCK_SIZE = 16
DEFAULT_KV_CACHE_BYTES = 1 << 30  # 1 GiB: ~22k tokens of SmolLM2's KV in fp32, ~44k in bf16, ~91k in float8
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # of the whole card (weights, KV pool, steps) when the pool is sized from it
DEFAULT_MAX_NUM_SEQS = 64  # running sequences per step
# token budget of one step (decodes + prefill chunks). 256, not 512: when many prompts arrive at once (a closed loop
# of 16 or 32 streams on a 2-core CPU, docs/benchmarks.md), smaller prefill chunks let the first of them start
# decoding a step sooner; TTFT p50 at c=16 340-388 ms against 432-520, at c=32 439-469 against 774-819, output
# tok/s equal or higher. Per step the weights are read once, so much smaller chunks (128) cost throughput.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256
SPECULATIVE_METHODS = ("ngram",)  # `--speculative`: prompt lookup (inferd/engine/speculative.py)
DEFAULT_NUM_DRAFT = 4  # `--num-draft`: draft tokens verified per step per sequence
DEFAULT_NGRAM_MIN = 2  # `--ngram-min`: shortest suffix looked up (1 proposes on any repeated token)
DEFAULT_NGRAM_MAX = 4  # `--ngram-max`: longest suffix looked up
# `--speculative-max-batch`: a step with more decoding sequences than this verifies no drafts; once a step is
# compute-bound, extra rows cost their full price and rejected drafts are pure loss (vLLM: disable_by_batch_size)
DEFAULT_SPECULATIVE_MAX_BATCH = 8
MAX_NUM_DRAFT = 16  # the most `--num-draft` may ask for
TENSOR_PARALLEL_TIMEOUT_S = 300.0  # an all-reduce that waits this long for another rank fails

# worker protocol (inferd/worker)
MAX_FRAME_BYTES = 16 << 20  # 16 MiB: a prompt at the longest context window is well under 2 MiB of JSON
DEFAULT_HEARTBEAT_INTERVAL = 0.5  # seconds between two heartbeats from a worker
DEFAULT_HEARTBEAT_TIMEOUT = 2.0  # seconds without any frame after which a client declares its worker dead
# a new connection to a worker must finish the challenge-response handshake within this, or it is closed (by the
# worker; and by the gateway's client, which a worker trickling its hello byte by byte would otherwise hold forever)
WORKER_HANDSHAKE_TIMEOUT_S = 5.0
MAX_HANDSHAKE_FRAME_BYTES = 1024  # an `auth` message is ~200 bytes: nobody unauthenticated makes a worker buffer more
# connections still in their handshake at once (a connection flood costs a worker this many threads at most, each for
# WORKER_HANDSHAKE_TIMEOUT_S at most)...
MAX_PENDING_HANDSHAKES = 64
# ... of which one peer address may hold this many (beyond it, or beyond the total, the oldest pending handshake is
# closed to make room: to keep a gateway out, a flood would have to close its handshake, one round trip, before it ends)
MAX_PENDING_HANDSHAKES_PER_ADDRESS = 8
# after the handshake every frame is sealed (AES-GCM, inferd/worker/sealing.py); each direction's key is ratcheted
# after sealing this many bytes, far under GCM's bound for one key (TLS 1.3 allows ~2^38 bytes)
SEAL_REKEY_BYTES = 1 << 32
# where a gateway may connect to a worker found in the Redis registry (--worker-allow): loopback and the private
# ranges a cluster's pods use. Not link-local (cloud metadata endpoints) nor public addresses: a forged registration
# cannot point a gateway at them
DEFAULT_WORKER_ALLOW = ("127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                        "fc00::/7")
WORKER_SECRET_ENV = "INFERD_WORKER_SECRET"  # the shared secret of workers and gateways (or --worker-secret[-file])
REDIS_PASSWORD_ENV = "INFERD_REDIS_PASSWORD"  # goes into every --redis / --register URL that carries no password
# never passed on to serve's own workers (they use no Redis)
CLIENT_SECRET_ENVS = ("INFERD_API_KEY", "INFERD_ADMIN_KEY", "INFERD_METRICS_KEY", REDIS_PASSWORD_ENV)
MAX_HELLO_STRING = 256  # the longest worker id, model name or version a worker may announce

# the API server (inferd/api)
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
MAX_REQUEST_BODY_BYTES = 8 << 20  # 8 MiB: a 32k-token prompt as JSON token ids is ~250 KB, as text ~150 KB
MAX_N = 16  # choices per request (`n`)
MAX_PROMPTS_PER_REQUEST = 64  # a /v1/completions batch (`prompt` as a list of prompts)
MAX_CHOICES_PER_REQUEST = 128  # prompts x n
MAX_LOGPROBS = 20  # `logprobs` (completions) and `top_logprobs` (chat)
MAX_STOP_STRINGS = 16  # entries of `stop`
MAX_STOP_TOKEN_IDS = 64  # entries of `stop_token_ids` (each must also be in the vocabulary)
MAX_STOP_STRING_CHARS = 1024  # the text held back while it could still become a stop string
MAX_IDENTIFIER_CHARS = 256  # `model`, `user`, a message's `name` and other client-chosen identifiers
MAX_CACHE_SALT_CHARS = 360  # a request's prefix-cache salt ("tenant:" or "group:" + a name, "|lora:" + a digest)
MAX_STRUCTURED_CHARS = 64 << 10  # a JSON schema, regex, choice list, grammar or tool set as its constraint's text
MAX_LOGIT_BIAS_ENTRIES = 1024  # entries of `logit_bias` (OpenAI: token id -> bias in [-100, 100])
MAX_TOOLS = 128  # functions in `tools`
# a Responses API request's `metadata` (OpenAI's limits: it is echoed in every response and stream event)
MAX_METADATA_ENTRIES = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
GRAMMAR_CACHE_BYTES = 256 << 20  # compiled grammars a worker keeps (xgrammar's cache, least recently used out)
# structured outputs' time budgets (inferd/engine/grammar_budget.py, grammar_compile.py): an ambiguous grammar of a few
# dozen characters (root ::= x*, x ::= "a" | "aa" | x x) costs its matcher ~n^3 per token, and a large one can
# compile for seconds; honest ones cost far less (on a 2-core CPU: a nested JSON schema's mask + accept 0.4 ms a
# token on average, 4.5 ms at worst; a schema or 128 tools compile in 0.2-0.4 s)
# `--grammar-mask-budget-ms`: one request's grammar work (mask fill + token accept) per sampled row of a step; past it
# the request ends with `grammar_too_slow` and the step no longer waits for it (10x the worst honest cost seen)
GRAMMAR_MASK_BUDGET_MS_PER_STEP = 50.0
# `--grammar-mask-budget-s`: one request's grammar work over its whole life (a plateau just under the step budget
# would otherwise tax every step of its neighbours for as long as it runs; 8k honest tokens cost ~3.5 s)
GRAMMAR_MASK_BUDGET_S = 10.0
GRAMMAR_MASK_THREADS = 4  # threads that fill masks (beside the forward pass) and accept tokens
# `--grammar-compile-timeout`: a compile that used this much CPU time is killed with its process and its requests end
# with `grammar_too_slow` (15x the slowest honest compile measured above). CPU time, as the masks' budgets: compiles
# run at a lower priority than the steps, and on a busy host an honest one can wait long for a core
GRAMMAR_COMPILE_TIMEOUT_S = 5.0
GRAMMAR_COMPILE_WALL_FACTOR = 6.0  # ... and one starved of CPU is killed after this many times that in wall time
# `--grammar-compile-processes`: compiles that run at once, each in a process of its own (killed on timeout or when
# every request waiting for it was aborted), so one slow compile never holds the others
GRAMMAR_COMPILE_PROCESSES = 2
GRAMMAR_COMPILE_START_TIMEOUT_S = 120.0  # a compile process that is not ready after this (importing xgrammar) failed
# embeddings (inferd/engine/embedding.py, inferd/models/encoder.py and pooling.py, inferd/api/embeddings.py)
MAX_EMBEDDING_INPUTS = 2048  # inputs in one /v1/embeddings request (OpenAI's limit)
DEFAULT_EMBED_MAX_WAIT_MS = 5.0  # `--embed-max-wait-ms`: how long the oldest input waits for others to batch with
DEFAULT_EMBED_MAX_BATCH_TOKENS = 8192  # `--embed-max-batch-tokens`: tokens one embedding step takes at most
# an embedding input of more characters than max_model_len x this is refused before it is tokenized: it cannot fit
# (a token of more characters is rare outside runs of one symbol)
EMBED_MAX_CHARS_PER_TOKEN = 16
# the Batch API (inferd/api/batches.py, batch_input.py, batch_runner.py); a batch line's size is bounded like an
# HTTP body (--max-body-bytes)
MAX_FILE_BYTES = 200 << 20  # an uploaded file (OpenAI's limit for batch input: 200 MB)
MAX_FILES_PER_TENANT = 1000  # files a tenant may keep (outputs included); delete to make room
MAX_BATCH_LINES = 50_000  # requests in one batch input file (OpenAI's limit)
MAX_ACTIVE_BATCHES_PER_TENANT = 16  # batches a tenant may have validating, running, finalizing or cancelling
MAX_BATCH_WINDOW_S = 7 * 24 * 3600  # the longest completion_window
DEFAULT_BATCH_CONCURRENCY = 16  # `--batch-concurrency`: the most batch lines in flight (adapts below it)
BATCH_RETRY_S = 1.0  # a line the service was too busy for runs again after this, doubled at each busy answer ...
BATCH_RETRY_MAX_S = 30.0  # ... up to this (or the answer's Retry-After, capped here): a refusal costs little
BATCH_STORAGE_PER_TENANT = 1 << 30  # `--batch-storage-per-tenant`: bytes of files (inputs and outputs) a tenant keeps
BATCH_RETENTION_S = 30 * 24 * 3600.0  # `--batch-retention`: a finished batch and its output files go after this
BATCH_SWEEP_INTERVAL_S = 60.0  # the retention sweep runs this often (or at half the retention, if shorter)
BATCH_VALIDATIONS = 2  # input files validated at once (each a thread reading up to MAX_FILE_BYTES)
BUSY_BATCH_CONCURRENCY = 1  # batch lines started while interactive/standard requests run or wait
BATCH_BUSY_COOLDOWN_S = 2.0  # ... and until this long after the last of them: then the batch takes the idle capacity
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "harmony")  # `--tool-call-parser` (inferd/api/tools.py)
REASONING_PARSERS = ("deepseek_r1", "qwen3", "harmony")  # `--reasoning-parser` (inferd/api/reasoning.py, harmony.py)
# a chat request's `chat_template_kwargs` (variables for the chat template, e.g. enable_thinking): the template
# renders them on the API process's threads, so their size is bounded as the messages' are: this many characters as
# JSON (a few flags and short strings are tens of characters) and this many levels of nesting
CHAT_TEMPLATE_KWARGS_MAX_CHARS = 16 << 10
CHAT_TEMPLATE_KWARGS_MAX_DEPTH = 8
# text that could still open a tool call is held back from the stream at most this long (a call's head is ~60
# characters; past this, whitespace runs included, it is text)
TOOL_CALL_MAX_HEAD_CHARS = 512
# `--http-keep-alive`: a kept-alive connection must send its next request head within this (uvicorn's default, 5 s,
# races clients whose pools keep connections longer)
HTTP_KEEP_ALIVE_S = 75.0
WORKER_START_TIMEOUT_S = 600.0  # loading a model: seconds before a worker that printed no READY is given up
WORKER_RESTART_BACKOFF_S = (0.5, 30.0)  # first and longest pause before a crashed worker is started again

# the gateway (inferd/gateway): quotas, the waiting line, admission
TIERS = ("interactive", "standard", "batch")  # priority tiers, most important first (tier_rank = index)
DEFAULT_TIER = "standard"
# `--tier-shares`: each tier's nominal share of a worker's seats (running sequences) and of a step's prompt tokens;
# a tier below its share lends the rest and takes it back at the next step (inferd/engine/tier_shares.py).
# "strict" serves tiers in strict priority instead
DEFAULT_TIER_SHARES = "interactive=70,standard=25,batch=5"
# `--lower-tier-prefill-tokens`: while a more important tier has work (or had some within TIER_ACTIVE_WINDOW_S: it
# may arrive), a tier computes at most its share of a step's token budget in prompt tokens, and at least this many:
# an interactive request that arrives mid-step waits for that step, so a step holding batch prefill stays short
DEFAULT_LOWER_TIER_PREFILL_TOKENS = 32
TIER_ACTIVE_WINDOW_S = 10.0
# LoRA adapters (`--enable-lora`: inferd/engine/lora.py). A worker runs at most DEFAULT_MAX_LORAS adapters in one
# step (each a slot of stacked weights in the model: memory max_loras x max_lora_rank x the projections' sizes);
# more stay in host memory, at most DEFAULT_MAX_CPU_LORAS, and are read from disk again past that
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 16  # vLLM's default; ranks 8-64 are what fine-tunes use
DEFAULT_MAX_CPU_LORAS = 32
DEFAULT_MAX_LORA_BYTES = 512 << 20  # an adapter's weights file: rank 64 on every projection of an 8B model is ~340 MB
MAX_SERVED_LORAS = 1024  # adapters one server lists (each a model a request may name)
MAX_WORKER_LORA_NAMES = 4096  # adapter names a worker's heartbeat may list (more: read as none)
DEFAULT_RATE_WINDOW_S = 60.0  # token buckets refill their whole capacity over this many seconds
DEFAULT_QUEUE_TIMEOUT_S = {"interactive": 10.0, "standard": 30.0, "batch": 300.0}  # deadline to start, per tier
MAX_QUEUE_TIMEOUT_S = 3600.0  # the most a request header may ask to wait
DEFAULT_MAX_QUEUE_REQUESTS = 1024  # requests waiting in the queue, all tiers together
DEFAULT_MAX_QUEUE_TOKENS = 4_000_000  # reserved tokens (prompt + max_tokens) of the waiting requests
DEFAULT_SSE_KEEPALIVE_S = 5.0  # a stream waiting for its first token gets a ": keep-alive" comment this often
DEFAULT_WORKER_QUEUE_DEPTH = 4  # requests a worker may hold beyond its batch slots (so its GPU never idles)
# requests waiting in one worker's engine (several gateways may each fill their room on it); past it a new one is
# refused retryably (the gateway sends it to another worker)
ENGINE_MAX_WAITING = 256
# `--tenant-queue-share`: the most of the waiting line (requests and reserved tokens) one tenant may hold, so that
# one tenant cannot fill it (over it: 429 queue_share_exceeded); a server without a keys file has one tenant: 1.0
DEFAULT_TENANT_QUEUE_SHARE = 0.5
# the longest `x-inferd-queue-timeout` a request of each tier may ask for (a longer one is capped to it)
MAX_QUEUE_TIMEOUT_BY_TIER_S = {"interactive": 60.0, "standard": 600.0, "batch": 3600.0}
SETTLE_RETRY_S = (0.1, 5.0)  # first and longest pause between two tries to settle a lease while the limiter fails
SETTLE_GIVE_UP_S = 600.0  # a settlement still failing after this is dropped (the lease then expires by itself)
# `--sse-write-timeout`: a stream whose client reads nothing for this long (a write cannot complete) is closed; its
# request was already released when the worker's last output arrived
DEFAULT_SSE_WRITE_TIMEOUT_S = 30.0
# tokenizing happens off the event loop for prompts of more characters than this (shorter ones take microseconds)
TOKENIZE_INLINE_MAX_CHARS = 2048
TOKENIZE_THREADS = 2  # threads that tokenize long inputs off the event loop (prompts and embedding inputs together)
# the live dashboard (/dashboard, inferd/api/dashboard.py): the API process samples its own metrics this often and
# keeps this much history; the page shows percentiles and rates over a window it picks (DASHBOARD_WINDOWS_S)
DASHBOARD_SAMPLE_S = 2.0
DASHBOARD_WINDOWS_S = (60.0, 300.0, 900.0)
DEFAULT_DASHBOARD_WINDOW_S = 300.0
DASHBOARD_RATE_S = 10.0  # tokens/s and the like: over the last this many seconds
DASHBOARD_TREND_S = 30.0  # each point of the latency-over-time chart: percentiles over the trailing this many seconds
# uvicorn's limits (the API process)
# `--limit-concurrency`: requests in progress (past it: 503, /health and /ready excepted) and open connections (past
# it a new connection closes the oldest idle one)
DEFAULT_LIMIT_CONCURRENCY = 4096
MAX_REQUEST_HEADER_BYTES = 64 << 10  # a request's line and headers together (h11; httptools' own bound is 80 KiB)
NEW_CONNECTION_IDLE_TIMEOUT_S = 10.0  # a connection that sends no complete request head within this is closed
# `--http-body-timeout`: a request body gets this many seconds, plus one per HTTP_MIN_BODY_RATE bytes received (a
# body trickled a byte at a time held a connection, and a place under --limit-concurrency, without end): then 408
DEFAULT_HTTP_BODY_TIMEOUT_S = 30.0
HTTP_MIN_BODY_RATE = 64 << 10  # bytes/s: a client uploading at least this fast never hits the body deadline
# `--http-idle-per-address`: idle connections (none of their requests in progress) one client address may keep; past
# it its oldest idle one is closed (a proxy in front shares one address: keep it well above its connection pool)
DEFAULT_HTTP_IDLE_PER_ADDRESS = 128
HTTP_LINGER_S = 2.0  # a connection closed before its request body was read discards what still arrives this long
HTTP_OVERLOAD_RETRY_AFTER_S = 1  # Retry-After of the 503 past --limit-concurrency
KEYS_POLL_S = 1.0  # how often `inferd serve --keys FILE` looks whether the file changed (SIGHUP: at once)
# a concurrency slot in Redis expires after this unless renewed: the gateway renews the leases of its running requests
# every REDIS_LEASE_RENEW_S, so a gateway that died gives its slots back within REDIS_LEASE_S
REDIS_LEASE_S = 15.0
REDIS_LEASE_RENEW_S = 5.0
REDIS_SOCKET_TIMEOUT_S = 2.0  # a Redis that does not answer within this fails the call (503 limiter_unavailable)
REDIS_RETRY_AFTER_S = 2  # Retry-After while the limits store is unavailable
FAIRNESS_PROMPT_WEIGHT = 1.0  # VTC: service charged per prompt token
FAIRNESS_OUTPUT_WEIGHT = 2.0  # VTC: service charged per generated token

# the autoscaler (inferd/cluster/autoscaler.py)
DEFAULT_MIN_WORKERS = 1  # `--min-workers`: never fewer
DEFAULT_MAX_WORKERS = 8  # `--max-workers`: never more
DEFAULT_TARGET_UTILIZATION = 0.8  # plan to run workers at this share of `--worker-capacity`
DEFAULT_SCALE_DOWN_COOLDOWN_S = 300.0  # the need must stay lower this long before workers are stopped
DEFAULT_QUEUE_DRAIN_S = 10.0  # the waiting line's reserved tokens should be served within this many seconds
DEFAULT_KV_HIGH_WATER = 0.9  # mean KV use above this (with enough compute) asks for one more worker
DEFAULT_WARM_LEAD_S = 0.0  # the warm schedule is read this many seconds ahead (to have workers loaded in time)

# the cluster (inferd/cluster, inferd/gateway/router.py, inferd/worker)
DEFAULT_MODEL_VERSION = "v1"  # a worker's model version when none is given (rollouts route by version)
DEFAULT_SHUTDOWN_GRACE_S = 5.0  # SIGTERM: running streams get this long to finish, then move to another worker
DEFAULT_REPLAY_TIMEOUT_S = 30.0  # a stream whose worker died waits this long for another worker, then `worker_lost`
MAX_REPLAYS_PER_REQUEST = 8  # a request that loses this many workers ends with `worker_lost` (a poison request)
WORKER_REGISTRATION_TTL_S = 5.0  # a worker registered in Redis (--register) vanishes this long after its last beat
WORKER_DISCOVERY_POLL_S = 1.0  # how often `inferd gateway --redis` looks for registered workers
WORKER_RECONNECT_BACKOFF_S = (0.2, 5.0)  # first and longest pause before a gateway reconnects to a remote worker
WORKER_STABLE_CONNECTION_S = 10.0  # a connection to a remote worker that lived this long resets the back-off
PREFIX_AFFINITY_MAX_BLOCKS = 4096  # per worker: prompt-prefix block hashes the router remembers (LRU)
PREFIX_AFFINITY_MIN_BLOCKS = 1  # full blocks a prompt must share with a worker's cache to prefer that worker
DEFAULT_AUTOSCALE_WINDOW_S = 30.0  # the autoscaler's token arrival rate is measured over this window
DEFAULT_CANARY_PERCENT = 10.0  # a rollout's share of new requests for the new version, percent
DEFAULT_ROLLOUT_MIN_REQUESTS = 20  # canary requests finished before a rollout is promoted or rolled back
DEFAULT_ROLLOUT_MAX_ERROR_RATE_INCREASE = 0.05  # rollback when the canary's error rate is this much above the old
DEFAULT_ROLLOUT_MAX_LATENCY_RATIO = 1.5  # rollback when its median TTFT or TPOT is this many times the old one's
# a canary is promoted only after running this long (a rollback does not wait: min_requests with errors suffice)
DEFAULT_ROLLOUT_MIN_SECONDS = 30.0
ROLLOUT_MAX_LATENCY_SAMPLES = 2048  # TTFT/TPOT samples kept per version during a rollout (the most recent)


@dataclass
class EngineConfig:
    model: str | None = None  # a HF folder or a .gguf file; None = the default SmolLM2 GGUF
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # the KV cache's storage dtype, one of KV_DTYPES: "auto" = the activation dtype. A narrower one holds more tokens
    # in kv_cache_bytes (bf16 under fp32: 2x; float8_e4m3fn: 2x under bf16, 4x under fp32); attention dequantizes
    # the blocks it reads to the activation dtype and computes there. On SmolLM2 bf16 KV is lossless, float8 is not
    # (mean KL ~0.05 against bf16, docs/benchmarks.md)
    kv_dtype: str = "auto"
    device: str = "cpu"
    block_size: int = DEFAULT_BLOCK_SIZE
    # the KV pool's bytes (per device); None: DEFAULT_KV_CACHE_BYTES on a CPU, and on CUDA what the card has left
    # after the weights and a profiled step, within gpu_memory_utilization of the card (inferd/engine/memory.py)
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # capacity shares between tiers (inferd/engine/tier_shares.py), or "strict" priority
    tier_shares: str = DEFAULT_TIER_SHARES
    lower_tier_prefill_tokens: int = DEFAULT_LOWER_TIER_PREFILL_TOKENS
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    # incremental text on every output (offline use, the CLI); a worker sends token ids only and leaves text to the
    # API process, so it turns this off (a request with stop strings is still detokenized, to find them)
    detokenize: bool = True
    record_logits: bool = False  # keep every sampled row's logits on the request (tests, debugging)
    # processes (devices) each decoder layer is split over, Megatron style (inferd/models/parallel.py); with N > 1
    # each device holds 1/N of the KV heads, so kv_cache_bytes (per device) holds N times the tokens
    tensor_parallel: int = 1
    # None, or "int8": weight-only int8 (inferd/models/quantize.py), every Linear with per-output-channel scales;
    # needs 16-bit activations (refused with float32). Weights take half the bytes of bf16; on a CPU it is faster for
    # single-sequence decoding and slower for batched steps (the measurements are in quantize.py's docstring)
    quantize: str | None = None
    # decode steps replayed as CUDA graphs, captured at start for a ladder of batch sizes (inferd/engine/cuda_graph.py);
    # only on CUDA (and one process): ignored on a CPU and under tensor parallelism
    cuda_graphs: bool = True
    # a sequence's logits independent of its batch and of prefill vs decode (inferd/models/batch_invariant.py): exact
    # replays in bf16 too, at a cost (docs/benchmarks.md)
    batch_invariant: bool = False
    # the step's operators (inferd/kernels): auto = the fused CPU kernels where they build and apply, else the torch
    # references; fused = refuse to start without them; reference = the plain torch ops (what tests compare against)
    kernels: str = "auto"
    # the CUDA graphs' static-shape decode path without capturing graphs, on any device (CPU checks of that path:
    # tests, bench/gpu_check.py --dry-run); off in serving
    static_decode: bool = False
    # sliding-window layers (Gemma 2/3, Mistral, gpt-oss) give back the KV blocks that left their window, in KV cache
    # groups of their own (inferd/engine/kv_groups.py); off: every layer keeps every position, as a model without
    # sliding layers does (tests compare the two). Always off under tensor parallelism (its ranks keep one group)
    sliding_window_reclaim: bool = True
    # None, or "ngram": speculative decoding by prompt lookup (inferd/engine/speculative.py); outputs are those of
    # plain decoding (greedy and seeded sampling alike), steps that accept drafts emit several tokens
    speculative: str | None = None
    num_draft: int = DEFAULT_NUM_DRAFT
    ngram_min: int = DEFAULT_NGRAM_MIN
    ngram_max: int = DEFAULT_NGRAM_MAX
    speculative_max_batch: int = DEFAULT_SPECULATIVE_MAX_BATCH
    # structured outputs' time budgets (the GRAMMAR_* limits above)
    grammar_mask_budget_ms: float = GRAMMAR_MASK_BUDGET_MS_PER_STEP
    grammar_mask_budget_s: float = GRAMMAR_MASK_BUDGET_S
    grammar_compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S
    grammar_compile_processes: int = GRAMMAR_COMPILE_PROCESSES
    # LoRA adapters per request (inferd/engine/lora.py): off by default (the slots cost memory and every step a
    # check); adapters are named by the gateway with each request and read from disk on first use
    enable_lora: bool = False
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_cpu_loras: int = DEFAULT_MAX_CPU_LORAS
    max_lora_bytes: int = DEFAULT_MAX_LORA_BYTES
    lora_root: str | None = None  # adapters are read only from under this folder when set


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


# `auto` on a CPU, whatever the CPU has: "bfloat16" or "float32" (so that the suite can run as if on the other kind
# of machine: bf16 is what `make serve` runs on AVX-512 BF16 / AMX machines, fp32 on AVX2-only ones)
AUTO_DTYPE_ENV = "INFERD_AUTO_DTYPE"


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """auto: bf16 where the device computes it natively (CUDA with bf16, CPUs with AVX-512 BF16 or AMX), else fp32;
    on a CPU, $INFERD_AUTO_DTYPE (bfloat16 or float32) decides instead when set. On a CPU without native bf16,
    bf16 matmuls are emulated and run ~100x slower than fp32."""
    import torch  # here, not at the top: the gateway and `inferd keys` read this module without needing torch

    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name in names:
        return names[name]
    if name != "auto":
        raise ValueError(f"unknown dtype {name!r} (choose auto, float32, bfloat16 or float16)")
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16
    forced = os.environ.get(AUTO_DTYPE_ENV, "").strip().lower()
    if forced:
        if forced not in ("bfloat16", "bf16", "float32", "fp32"):
            raise ValueError(f"${AUTO_DTYPE_ENV} must be bfloat16 or float32, got {forced!r}")
        return names[forced]
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


KV_DTYPES = ("auto", "bfloat16", "float16", "float8_e4m3fn")  # `--kv-dtype`


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype under activations in dtype: auto = dtype. float8_e4m3fn is stored unscaled (as
    vLLM's fp8 cache without calibrated scales): values past +-448 saturate, and SmolLM2's keys and values stay far
    below that. ValueError for a name not in KV_DTYPES."""
    import torch

    if name not in KV_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r} (choose {', '.join(KV_DTYPES)})")
    return dtype if name == "auto" else getattr(torch, name)
