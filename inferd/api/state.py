"""ServerState: what the API process's routes and middleware share (the router, the gateway, the generation service,
metrics, keys, the Batch API's store), made by `inferd serve` / `inferd gateway` and read by every request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..config import DEFAULT_SSE_KEEPALIVE_S, DEFAULT_SSE_WRITE_TIMEOUT_S
from ..gateway.admission import Gateway
from ..gateway.router import Router
from ..gateway.tenants import KeyStore
from ..telemetry.metrics import Metrics
from .generation import GenerationService
from .refusals import not_ready
from .serving import OpenAIServing


@dataclass
class ServerState:
    router: Router
    metrics: Metrics
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    serving: OpenAIServing | None = None  # set once the tokenizer is loaded
    started: int = field(default_factory=lambda: int(time.time()))
    gateway: Gateway | None = None  # default: in-process limits and queue over `router`
    keys: KeyStore | None = None  # None: no keys file (then --api-key, or no authentication on loopback)
    sse_keepalive_s: float = DEFAULT_SSE_KEEPALIVE_S
    sse_write_timeout: float = DEFAULT_SSE_WRITE_TIMEOUT_S
    admin_key: str | None = None  # the admin API (/admin/...) is off without one
    metrics_key: str | None = None  # /metrics needs it (Bearer) when set
    draining: bool = False  # shutting down: /ready says so, new requests get 503
    rollout: object | None = None  # the RolloutController (local workers only)
    autoscaler: object | None = None  # the Autoscaler, where one runs
    dashboard: object | None = None  # the /dashboard's history of samples (api/dashboard.py); build_app makes it
    # the EmbeddingModel of each --embedding-model (api/embeddings.py), by served name, in the order given
    embeddings: dict = field(default_factory=dict)
    batches: object | None = None  # the Batch API's BatchStore (api/batches.py); None: /v1/files and /v1/batches 404
    batch_runner: object | None = None  # its BatchRunner
    generation: GenerationService | None = None  # the one path from an admitted request to a finished ticket
    lora: object | None = None  # the LoraCatalog of the served adapters (api/lora_catalog.py); None: --enable-lora off

    def __post_init__(self) -> None:
        if self.gateway is None:
            self.gateway = Gateway(self.router, metrics=self.metrics)
        if self.generation is None:
            self.generation = GenerationService(self)

    @property
    def authenticates(self) -> bool:
        return self.keys is not None or self.api_key is not None

    def require_serving(self) -> OpenAIServing:
        if self.serving is None:
            raise not_ready("the model is loading", retry_after=5)
        return self.serving

    def not_ready_reason(self) -> str | None:
        if self.draining:
            return "the server is shutting down"
        if self.serving is None:
            return "the tokenizer is loading"
        if not self.router.ready:
            return self.router.not_ready_reason
        return None
