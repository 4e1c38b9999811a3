"""EngineProtocol: the contract between a worker and the engine it drives (inferd/worker/engine_loop.py, server.py).

The model's Engine (engine.py), the embedding engine (embedding.py) and the echo engine (inferd/worker/echo.py)
implement it; the worker calls nothing else on them, so it never reads an engine's scheduler, KV cache or private
state: what it reports about the engine comes from info() (once, for the hello) and snapshot() (between steps, for
heartbeats and each step's outputs message). Without torch: the echo worker and the API process import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .outputs import RequestOutput
from .request import SamplingParams


@dataclass(frozen=True)
class EngineInfo:
    """What does not change while the engine runs (the worker's hello)."""
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    kv_num_blocks: int
    kv_block_size: int
    task: str = "generate"  # or "embed"
    embedding_dim: int = 0  # an embedding model's vector size
    served_name: str | None = None  # the model's name when the engine knows it better than its path does


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine between two steps: its queues and KV pool, its step count, and what the latest step did."""
    running: int = 0
    waiting: int = 0  # in the scheduler's line (not counting requests whose grammar is compiling)
    kv_blocks_in_use: int = 0  # referenced by a request
    kv_blocks_free: int = 0  # free or evictable (cached, unreferenced): what can be handed out now
    kv_num_blocks: int = 0
    prefix_cache_hits: int = 0  # prompt tokens served from the prefix cache
    prefix_cache_queries: int = 0  # prompt tokens looked up
    num_preemptions: int = 0
    num_steps: int = 0
    running_by_tier: tuple[int, ...] = (0, 0, 0)  # running sequences per tier rank (config.TIERS)
    preemptions_by_tier: tuple[int, ...] = (0, 0, 0)  # requests of each tier preempted so far
    busy: bool = False  # has unfinished requests
    # the latest step: prefill and decode tokens it ran (speculative rows count as decode), bytes read and FLOPs
    # (inferd/telemetry/roofline.py), draft tokens verified and accepted
    last_prefill_tokens: int = 0
    last_decode_tokens: int = 0
    last_bytes: int = 0
    last_flops: int = 0
    last_draft_tokens: int = 0
    last_accepted_tokens: int = 0
    # LoRA adapters (inferd/engine/lora.py): the names held in host memory (a request for them needs no disk read),
    # how many sit in a slot, and the slot loads and evictions so far
    lora_adapters: tuple[str, ...] = ()
    lora_slots_used: int = 0
    lora_loads: int = 0
    lora_evictions: int = 0


ScheduleHook = Callable[[list[int | None]], None]  # the sampling seeds of the requests a step runs


class EngineProtocol(Protocol):
    """Not thread-safe: one thread (the worker's engine loop) calls all of these."""

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, num_prompt_tokens: int | None = None) -> str:
        """Queues a request (InvalidRequestError for one that must never run)."""
        ...

    def abort(self, request_id: str) -> bool:
        """Stops a request now (its final output comes with take_pending_outputs); False if unknown or finished."""
        ...

    def step(self) -> list[RequestOutput]:
        """Runs one step; its outputs, after those produced since the last one (aborts)."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def take_pending_outputs(self) -> list[RequestOutput]:
        """Outputs produced outside a step (aborts), normally returned by the next step()."""
        ...

    def take_failed(self) -> list[tuple[str, str, str | None]]:
        """(request id, why, error code or None) of the requests the engine stopped on an error of their own since
        the last call (no output of theirs follows)."""
        ...

    def unfinished_request_ids(self) -> list[str]: ...

    def num_waiting(self) -> int:
        """Requests queued and not yet running, those whose grammar is compiling included (the worker's line)."""
        ...

    def failed_step_request_ids(self) -> list[str]:
        """Called once a step raised: the requests that step ran (its schedule's; when it raised before scheduling
        or before it began, the running ones, or the waiting ones when none ran). Forgets that step."""
        ...

    def on_schedule(self, hook: ScheduleHook | None) -> None:
        """hook(seeds) runs in every step once the step knows which requests it runs, with their sampling seeds; it
        may raise, failing the step (fault injection: inferd/worker/faults.py)."""
        ...

    def info(self) -> EngineInfo: ...

    def snapshot(self) -> EngineSnapshot: ...

    def close(self) -> None:
        """Ends whatever the engine started (processes, threads); idempotent."""
        ...
