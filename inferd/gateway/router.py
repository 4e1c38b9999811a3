"""Router: the attached workers, where their prompts' prefixes are cached, and a request's stream from the worker it
was bound to.

Workers attach when their connection is up and detach when it dies; `on_change` callbacks (the gateway's dispatch)
run when one attaches or becomes usable again. Which worker a request goes to is the gateway's decision
(inferd/gateway/admission.py: only a worker with room, of the request's model version); among those, `rank` prefers
the worker whose prefix cache holds the longest prefix of the prompt, then the one with the least outstanding work.

Prefix affinity: for each worker the router remembers (LRU, bounded) the block hashes of the prompts it sent there,
with the engine's own content hash chain (inferd/engine/kv_cache.py `hash_prompt_blocks`), so a prompt that shares a
system prompt with earlier ones goes where those blocks are probably still cached. It is a guess (the worker may have
evicted them); the worker's prefix-cache hit counters say how good the guess was.

Every dispatch carries a fresh epoch (see the worker protocol), so that outputs a worker sends for a dispatch the
router gave up on are dropped.
"""

from __future__ import annotations

import itertools
import re
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable

from ..config import PREFIX_AFFINITY_MAX_BLOCKS, PREFIX_AFFINITY_MIN_BLOCKS
from ..engine.kv_cache import hash_prompt_blocks
from ..engine.request import SamplingParams
from ..worker.client import WorkerClient
from ..worker.protocol import WorkerHello, WorkerOutput, WorkerStats


class NoWorkerAvailable(Exception):
    """No worker can take a request now (none attached yet, or all are down): a 503 with Retry-After."""

    def __init__(self, reason: str, retry_after: int = 1):
        super().__init__(reason)
        self.retry_after = retry_after


class PrefixIndex:
    """Block hashes a worker was sent, most recent last, at most max_blocks."""

    def __init__(self, max_blocks: int = PREFIX_AFFINITY_MAX_BLOCKS):
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def matched(self, hashes: list[bytes]) -> int:
        """How many leading blocks of the prompt this worker was sent before."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n


class Router:
    def __init__(self) -> None:
        self.workers: list[WorkerClient] = []
        self._reason = "the model is loading"  # why no worker is attached
        self._epochs = itertools.count(1)
        self.on_change: list[Callable[[], None]] = []
        self._prefixes: dict[WorkerClient, PrefixIndex] = {}
        self.affinity_hits = 0  # dispatches that went to a worker chosen for its cached prefix
        self.affinity_queries = 0  # dispatches of prompts with at least one full block

    def attach(self, client: WorkerClient) -> None:
        self.workers.append(client)
        self._prefixes[client] = PrefixIndex()
        client.on_recover.append(self._changed)
        self._changed()

    def incompatibility(self, hello: WorkerHello) -> str | None:
        """Why a worker may not join the ones attached (None: it may): it must speak the same vocabulary and stop on
        the same tokens as the model this gateway tokenizes for (the first worker's). Its hello is already
        validated field by field (WorkerHello.from_wire)."""
        first = self.hello
        if first is None:
            return None
        if hello.vocab_size != first.vocab_size:
            return f"it serves a vocabulary of {hello.vocab_size} tokens, the others {first.vocab_size}"
        if sorted(hello.eos_token_ids) != sorted(first.eos_token_ids):
            return f"its end-of-sequence tokens {hello.eos_token_ids} differ from the others' {first.eos_token_ids}"
        return None

    def detach(self, client: WorkerClient, reason: str) -> None:
        if client in self.workers:
            self.workers.remove(client)
        self._prefixes.pop(client, None)
        self._reason = reason

    def _changed(self) -> None:
        for callback in self.on_change:
            callback()

    @property
    def not_ready_reason(self) -> str:
        """Why no worker can take a request (meaningful when not ready)."""
        dead = [w.dead for w in self.workers if w.dead is not None]
        if dead and len(dead) == len(self.workers):
            return f"the worker died ({dead[0]}) and is being restarted"
        if self.workers and all(w.draining for w in self.workers if w.dead is None):
            return "every worker is shutting down"
        if self.workers and all(w.unresponsive for w in self.workers if w.dead is None):
            return "every worker is unresponsive"
        return self._reason

    @not_ready_reason.setter
    def not_ready_reason(self, reason: str) -> None:
        self._reason = reason

    @property
    def ready(self) -> bool:
        return any(w.usable for w in self.workers)

    @property
    def hello(self) -> WorkerHello | None:
        """What the workers serve (model, context window: the same for every version)."""
        return next((w.hello for w in self.workers if w.hello is not None), None)

    def versions(self) -> dict[str, int]:
        """Model version -> number of usable workers serving it."""
        out: dict[str, int] = {}
        for w in self.workers:
            if w.usable and w.version is not None:
                out[w.version] = out.get(w.version, 0) + 1
        return out

    def latest_stats(self) -> WorkerStats | None:
        """Every worker's latest heartbeat stats, summed."""
        stats = [w.latest_stats for w in self.workers if w.latest_stats is not None and w.dead is None]
        if not stats:
            return None
        if len(stats) == 1:
            return stats[0]
        fields = [name for name in WorkerStats.__dataclass_fields__ if name != "draining"]
        return WorkerStats(**{name: _sum([getattr(s, name) for s in stats]) for name in fields},
                           draining=all(s.draining for s in stats))

    # ---- choosing a worker ----------------------------------------------------------------------------------
    def prompt_hashes(self, prompt: list[int], salt: str = "") -> list[bytes]:
        """The prompt's block hashes as a worker computes them (salt: the request's prefix-cache salt)."""
        hello = self.hello
        return hash_prompt_blocks(prompt, hello.kv_block_size, salt) if hello is not None else []

    def rank(self, candidates: list[WorkerClient], load: Callable[[WorkerClient], float],
             hashes: list[bytes], adapter: str | None = None) -> WorkerClient:
        """The best of candidates: for a LoRA adapter's request, those that hold the adapter if any does (no disk
        read, no host copy: its heartbeat lists it); then the longest cached prefix (at least
        PREFIX_AFFINITY_MIN_BLOCKS blocks), then the least load; ties go to the smallest worker id (deterministic:
        never the order in which workers happened to attach)."""
        def key(w: WorkerClient):
            return load(w), _worker_order(w)

        if adapter is not None:
            holders = [w for w in candidates if w.latest_stats is not None and adapter in w.latest_stats.lora_adapters]
            candidates = holders or candidates

        if hashes:
            self.affinity_queries += 1
            best, best_blocks = None, PREFIX_AFFINITY_MIN_BLOCKS - 1
            for w in candidates:
                index = self._prefixes.get(w)
                n = index.matched(hashes) if index is not None else 0
                if n > best_blocks or (n == best_blocks and best is not None and key(w) < key(best)):
                    best, best_blocks = w, n
            if best is not None:
                self.affinity_hits += 1
                return best
        return min(candidates, key=key)

    def remember(self, worker: WorkerClient, hashes: list[bytes]) -> None:
        index = self._prefixes.get(worker)
        if index is not None and hashes:
            index.add(hashes)

    def pick(self) -> WorkerClient:
        live = [w for w in self.workers if w.usable]
        if not live:
            raise NoWorkerAvailable(f"no worker is available: {self.not_ready_reason}")
        return min(live, key=lambda w: (w.num_streams, _worker_order(w)))

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       worker: WorkerClient | None = None, num_prompt_tokens: int | None = None
                       ) -> AsyncGenerator[WorkerOutput, None]:
        """The request's outputs, step by step, from `worker` (default: pick()). Raises NoWorkerAvailable before
        anything was sent, else what WorkerClient.generate raises. Leaving the iteration early aborts the request in
        the worker. num_prompt_tokens: a replay (the tail of prompt_token_ids is output already sent)."""
        worker = worker if worker is not None else self.pick()
        stream = worker.generate(request_id, prompt_token_ids, params, num_prompt_tokens, epoch=next(self._epochs))
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()


def _worker_order(w: WorkerClient) -> tuple:
    """A stable order among workers: by id, numbers compared as numbers (worker-2 before worker-10)."""
    wid = w.hello.worker_id if w.hello is not None else ""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", wid))


def _sum(values: list):
    """A field summed over workers: numbers add, per-tier lists add element by element, lists of names (the LoRA
    adapters held) join."""
    if values and isinstance(values[0], list) and any(isinstance(v, str) for vs in values for v in vs):
        return sorted(set().union(*values))
    if values and isinstance(values[0], list):
        return [sum(column) for column in zip(*values)]
    return sum(values)
