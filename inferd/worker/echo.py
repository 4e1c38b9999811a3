"""`inferd worker --echo`: a worker whose engine runs no model, so that the gateway, the API process and the worker
protocol can be measured (and tested) alone.

EchoEngine implements EngineProtocol (inferd/engine/protocol.py), what the worker drives: add_request (validated like
the Engine's), abort, step, ..., info() and snapshot(). Its KV pool is nominal, never short: enough blocks for every
running slot at the full context window, those in use counted from the running requests' lengths.

What it generates: every step, each running request gets one token, the prompt's tokens in turn (cycling), and
finishes with finish_reason "length" at max_tokens (or at the context window), or "stop" on one of its
stop_token_ids (after min_tokens; so a test can end a request at a chosen length). EOS and stop strings are ignored;
logprobs, when asked for, describe a
certain model (the echoed token at logprob 0). No sleeps and no torch compute: a step costs microseconds, so whatever
time a request takes is the serving path's own.

Only the model's config is read (config.json or the GGUF header), never its weights: start-up takes well under a
second after the imports.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from dataclasses import dataclass

from ..config import TIERS, EngineConfig
from ..engine.errors import InvalidRequestError
from ..engine.outputs import RequestOutput, TokenLogprob
from ..engine.protocol import EngineInfo, EngineSnapshot, ScheduleHook
from ..engine.request import FinishReason, SamplingParams, validate_request
from ..engine.tier_shares import TierShares, tier_counts, tier_rank
from ..models.config import ModelConfig

log = logging.getLogger("inferd.worker")


def _tier(r: EchoRequest) -> int:
    return tier_rank(r.params.priority)


@dataclass(eq=False)  # identity: list.remove() on abort must not compare token lists
class EchoRequest:
    request_id: str
    token_ids: list[int]  # prompt + generated (a replayed request's prompt already holds its first outputs)
    num_prompt_tokens: int  # the original prompt: outputs echo token_ids[:num_prompt_tokens]
    params: SamplingParams
    arrival_seq: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def next_token(self) -> int:
        # output i echoes prompt token i mod the prompt's length: a replay continues exactly where it stopped
        return self.token_ids[self.num_output_tokens % self.num_prompt_tokens]


class EchoEngine:
    def __init__(self, model_config: ModelConfig, config: EngineConfig):
        self.config = config
        self.model_config = model_config
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.eos_token_ids = frozenset(model_config.eos_token_ids)  # reported in the hello, never acted on
        self.num_kv_blocks = self._blocks(self.max_model_len) * config.max_num_seqs
        self.requests: dict[str, EchoRequest] = {}
        # running is capped at max_num_seqs; the rest waits, and a free seat goes by the tier shares as in the real
        # scheduler (inferd/engine/tier_shares.py; arrival order inside a tier), a tier below its own seats taking
        # one back from a tier that borrowed (the request pauses and goes on later where it stopped). No token
        # budget, no KV shortage
        self.shares = TierShares.parse(config.tier_shares)
        self.num_preemptions = 0
        self.preemptions_by_tier = [0] * len(TIERS)
        self.running: list[EchoRequest] = []
        self.waiting: list[EchoRequest] = []
        self.num_steps = 0
        self._arrivals = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self._on_schedule: ScheduleHook | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> EchoEngine:
        """Reads the model's config.json or GGUF metadata only (the cheapest source of vocab_size and context)."""
        from ..models.loader import default_model_path, load_model_config

        return cls(load_model_config(config.model or default_model_path()), config)

    # ---- requests -------------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams, num_prompt_tokens: int | None = None
                 ) -> None:
        """The Engine's checks (same messages), less the KV pool's, which the nominal pool always passes."""
        validate_request(prompt_token_ids, params, num_prompt_tokens, self.model_config.vocab_size,
                         self.max_model_len)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, num_prompt_tokens: int | None = None) -> str:
        params = params or SamplingParams()
        self.validate(prompt_token_ids, params, num_prompt_tokens)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        orig = len(prompt_token_ids) if num_prompt_tokens is None else num_prompt_tokens
        req = EchoRequest(request_id, list(prompt_token_ids), orig, params, next(self._arrivals))
        self.requests[request_id] = req
        self.waiting.append(req)
        return request_id

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for queue in (self.running, self.waiting):
            if req in queue:
                queue.remove(req)
        self._pending_outputs.append(self._output(req, [], FinishReason.ABORT))
        return True

    def take_pending_outputs(self) -> list[RequestOutput]:
        out, self._pending_outputs = self._pending_outputs, []
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def take_failed(self) -> list[tuple[str, str, str | None]]:
        return []  # nothing fails on its own here

    def unfinished_request_ids(self) -> list[str]:
        return list(self.requests)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def failed_step_request_ids(self) -> list[str]:
        return [r.request_id for r in self.running or self.waiting]

    def on_schedule(self, hook: ScheduleHook | None) -> None:
        self._on_schedule = hook

    def close(self) -> None:
        pass

    # ---- what the worker reports ----------------------------------------------------------------------------
    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def info(self) -> EngineInfo:
        return EngineInfo(self.max_model_len, self.model_config.vocab_size, self.eos_token_ids, self.num_kv_blocks,
                          self.config.block_size)

    def snapshot(self) -> EngineSnapshot:
        in_use = sum(self._blocks(len(r.token_ids)) for r in self.running)
        return EngineSnapshot(running=len(self.running), waiting=len(self.waiting), kv_blocks_in_use=in_use,
                              kv_blocks_free=self.num_kv_blocks - in_use, kv_num_blocks=self.num_kv_blocks,
                              num_steps=self.num_steps, num_preemptions=self.num_preemptions,
                              running_by_tier=tuple(tier_counts(_tier(r) for r in self.running)),
                              preemptions_by_tier=tuple(self.preemptions_by_tier), busy=self.has_unfinished_requests())

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self.take_pending_outputs()
        if self._on_schedule is not None:  # the requests already running (those admitted now have not started)
            self._on_schedule([r.params.seed for r in self.running])
        self._admit()
        running = self.running
        if not running:
            return outputs
        self.num_steps += 1
        still_running = []
        for req in running:
            token = req.next_token()
            req.token_ids.append(token)
            stop = token in req.params.stop_token_ids and req.num_output_tokens >= req.params.min_tokens
            length = req.num_output_tokens >= req.params.max_tokens or len(req.token_ids) >= self.max_model_len
            reason = FinishReason.STOP if stop else FinishReason.LENGTH if length else None
            if reason is not None:
                del self.requests[req.request_id]
            else:
                still_running.append(req)
            outputs.append(self._output(req, [token], reason, token if stop else None))
        self.running = still_running
        return outputs

    def _admit(self) -> None:
        seats = self.config.max_num_seqs
        self.waiting.sort(key=lambda r: (r.params.priority, r.arrival_seq))
        held = tier_counts(_tier(r) for r in self.running)
        blocked: set[int] = set()
        while True:
            heads: dict[int, EchoRequest] = {}
            for r in self.waiting:
                heads.setdefault(_tier(r), r)
            t = self.shares.next_tier(held, [u for u in heads if u not in blocked], seats)
            if t is None:
                return
            if len(self.running) >= seats:
                lenders = [r for r in self.running if self.shares.may_lend(held, _tier(r), seats, t)]
                if not self.shares.may_reclaim(held, t, seats) or not lenders:
                    blocked.add(t)
                    continue
                victim = max(lenders, key=lambda r: (_tier(r), r.arrival_seq))
                self.running.remove(victim)
                self.waiting.append(victim)
                held[_tier(victim)] -= 1
                self.num_preemptions += 1
                self.preemptions_by_tier[_tier(victim)] += 1
                blocked.add(_tier(victim))  # not readmitted in the step that preempted it
            self.waiting.remove(heads[t])
            self.running.append(heads[t])
            held[t] += 1

    def _output(self, req: EchoRequest, new_ids: list[int], reason: FinishReason | None,
                stop_reason: int | None = None) -> RequestOutput:
        return RequestOutput(req.request_id, new_ids, "", reason is not None, reason.value if reason else None,
                             stop_reason,
                             req.num_prompt_tokens, req.num_output_tokens, 0, self._logprobs(req, new_ids))

    def _logprobs(self, req: EchoRequest, new_ids: list[int]) -> list[TokenLogprob]:
        """A certain model: the echoed token at logprob 0, then (for top-n) the next ids at -inf."""
        n = req.params.logprobs
        if n is None or not new_ids:
            return []
        token, vocab = new_ids[0], self.model_config.vocab_size
        top = [(token, 0.0)] + [((token + i) % vocab, float("-inf")) for i in range(1, n)]
        return [TokenLogprob(token, 0.0, top[:n])]


# ---- the process ----------------------------------------------------------------------------------------------
def run_echo_worker(config: EngineConfig, opts) -> int:
    """`inferd worker --echo`: run_worker's process (opts: WorkerRunOptions), with an EchoEngine instead of a loaded
    model."""
    from .server import serve_engine, start_worker_process

    start_worker_process(opts)
    engine = EchoEngine.from_config(config)
    log.info("echo worker: no model loaded; answers echo the prompt (vocab %d, context %d)",
             engine.model_config.vocab_size, engine.max_model_len)
    return serve_engine(engine, config, opts)
