"""Engine: the step loop, in the stages of vLLM v1's and nano-vllm's:

  schedule            grammars that finished compiling join the line, speculative drafts are proposed for the sequences
                      about to decode (speculative.py), and the scheduler picks the step's batch (scheduler.py);
  execute             the forward pass (runner.py), with the constrained rows' grammar masks filled beside it
                      (grammars.py);
  sample              logit processors (logits_processors.py), the grammar masks, the seeded draw (sampler.py), the
                      drafts each request keeps (speculative.accept_drafts) and its matcher's advance by them;
  update_from_output  the one place a step changes its requests: tokens appended, KV counted and cached, stop checks,
                      requests finished (or failed), the step's stats; the outputs.

The engine implements EngineProtocol (protocol.py), what a worker drives.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from .. import kernels
from ..config import EngineConfig, resolve_dtype, resolve_kv_dtype
from ..models import batch_invariant
from ..models.config import ModelConfig
from ..telemetry.roofline import model_cost
from . import prompt_logprobs
from .cuda_graph import decode_graph_spec
from .errors import InvalidRequestError
from .grammars import Failure, Grammars, Masks, check_grammar_budgets
from .kv_cache import KVCacheManager
from .kv_groups import kv_cache_groups, split_kv_budget
from .logits_processors import apply_logit_bias, apply_penalties_and_min_tokens
from .memory import resolve_kv_cache_bytes
from .outputs import RequestOutput, TokenLogprob
from .protocol import EngineInfo, EngineSnapshot, ScheduleHook
from .request import FinishReason, Request, SamplingParams, validate_request
from .runner import ModelRunner, kv_bytes_per_block
from .sampler import Sampler
from .scheduler import Scheduler, SchedulerOutput
from .speculative import NgramProposer, accept_drafts, check_speculative
from .tier_shares import TierShares

log = logging.getLogger("inferd.engine")
GRAMMAR_POLL_S = 0.02  # an idle step waits this long for a grammar being compiled before it returns

if TYPE_CHECKING:
    from .tensor_parallel import TensorParallelGroup


@dataclass
class StepStats:
    num_steps: int = 0
    num_tokens: int = 0  # tokens run through the model
    num_sampled: int = 0
    seconds: float = 0.0
    bytes_read: int = 0  # weights + KV cache read, summed over steps (inferd/telemetry/roofline.py)
    flops: int = 0
    spec_drafted: int = 0  # speculative draft tokens verified
    spec_accepted: int = 0  # of which accepted (each one a token that cost no step of its own)
    # the last step alone: seconds, prefill tokens, decode tokens (speculative rows included), bytes read, FLOPs
    last: tuple[float, int, int, int, int] = (0.0, 0, 0, 0, 0)
    last_spec: tuple[int, int] = (0, 0)  # the last step's draft tokens verified, and accepted


class SamplingRequest(NamedTuple):
    """A request that samples this step: its rows of the step's logits (the last token's, and one per draft)."""
    request: Request
    drafts: list[int]  # the drafts its rows verify
    num_rows: int


class Sampled(NamedTuple):
    """What the sample stage made of one request's rows."""
    request: Request
    drafts: list[int]
    tokens: list[int]  # the tokens it keeps: accepted drafts, then the first sampled token that differs
    first_row: int  # its first row of the step's logits (logprobs and raw logits of its kept tokens from here)


@dataclass
class SampleOutput:
    """The sample stage's result, for update_from_output."""
    requests: list[Sampled]
    logprobs: list[TokenLogprob | None]  # per row
    raw_logits: torch.Tensor  # per row, the model's (before logit_bias, masks and penalties)
    num_rows: int
    grammar: dict[str, list[tuple[bool, bool]]]  # per constrained request: (accepted, grammar complete) per token
    failed: list[Failure]  # requests whose grammar work ran out of time this step: they end, their rows dropped
    # (request, position, entries) of the step's prompt logprobs (prompt_logprobs.py): usually none
    prompt: list = field(default_factory=list)


def _merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One request's outputs of one step (several tokens when drafts were accepted) as one output."""
    return RequestOutput(a.request_id, a.new_token_ids + b.new_token_ids, a.new_text + b.new_text, b.finished,
                         b.finish_reason, b.stop_reason, b.num_prompt_tokens, b.num_output_tokens, b.num_cached_tokens,
                         a.logprobs + b.logprobs, prompt_logprobs=a.prompt_logprobs or b.prompt_logprobs)


def check_batch_invariant(config: EngineConfig) -> None:
    """ValueError for what batch-invariant mode does not cover (before anything loads)."""
    if not config.batch_invariant:
        return
    if config.tensor_parallel != 1:
        raise ValueError("--batch-invariant does not support --tensor-parallel yet (the other ranks' layers would "
                         "need their row tiles too)")
    if config.quantize is not None:
        raise ValueError("--batch-invariant does not support --quantize yet (its int8 matmuls are not tiled)")
    if not config.device.startswith("cpu"):
        raise ValueError(f"--batch-invariant is verified on CPUs only, not on {config.device!r} (GPU libraries pick "
                         "their matmul kernels, split-K among them, by the batched matmuls' batch count)")


class Engine:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 dtype: torch.dtype, tokenizer=None, parallel: TensorParallelGroup | None = None):
        """With config.tensor_parallel > 1, model is rank 0's shard and parallel the other ranks (from_config
        builds both); model_config is always the whole model's."""
        if config.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be at least 1, got {config.tensor_parallel}")
        if config.tensor_parallel != 1 and (parallel is None or parallel.world_size != config.tensor_parallel):
            raise ValueError(f"tensor_parallel={config.tensor_parallel} needs a model shard and its other ranks: "
                             "build the engine with Engine.from_config")
        check_speculative(config)
        check_batch_invariant(config)
        check_grammar_budgets(config)
        self.config = config
        self.model_config = model_config
        self.dtype = dtype
        self.kv_dtype = resolve_kv_dtype(config.kv_dtype, dtype)  # the cache's storage; attention computes in dtype
        self.tokenizer = tokenizer
        if torch.device(config.device).type == "cuda":
            torch.cuda.set_device(torch.device(config.device))  # streams, events and graph pools on this card
        if hasattr(model, "ops"):  # the fused kernels where they apply (inferd/kernels)
            model.ops = kernels.select(config.device, dtype, self.kv_dtype, config.kernels)
        self.kv_cache_bytes = resolve_kv_cache_bytes(model, model_config, config, dtype, self.kv_dtype)
        per_block = kv_bytes_per_block(model_config, config.block_size, self.kv_dtype, config.tensor_parallel)
        # the KV cache groups (kv_groups.py): one, of every layer, unless the model has sliding-window layers
        self.kv_groups = split_kv_budget(
            kv_cache_groups(model_config, config.sliding_window_reclaim and config.tensor_parallel == 1),
            self.kv_cache_bytes, per_block // model_config.num_hidden_layers, config.block_size, config.max_num_seqs,
            config.max_num_batched_tokens)
        num_blocks = self.kv_groups[0].num_blocks
        if min(g.num_blocks - (g.window > 0) for g in self.kv_groups) < 1:
            raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes} is less than one KV block ({per_block} bytes) "
                             "in every KV cache group")
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        # CUDA graphs for decode (cuda_graph.py): the pool's last block is kept back for the padded rows to write to
        # (in a sliding group that block is its null block, kept back anyway)
        # (not with LoRA adapters: their rows' slots change every step, and the graphs would need them as inputs)
        graphs = None if config.enable_lora else decode_graph_spec(config, num_blocks, self.max_model_len)
        self.kv_cache = KVCacheManager([g.num_blocks - (1 if g.window else graphs is not None) for g in self.kv_groups],
                                       config.block_size, config.enable_prefix_caching,
                                       [g.window for g in self.kv_groups])
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   TierShares.parse(config.tier_shares), config.lower_tier_prefill_tokens)
        # set either way: the mode lives in the model's layers, and a model may be handed to another engine
        batch_invariant.enable(model, config.batch_invariant)
        self.parallel = parallel
        self.runner = ModelRunner(model, model_config, num_blocks, config.block_size, dtype, config.device,
                                  config.tensor_parallel, parallel, kv_dtype=self.kv_dtype, decode_graphs=graphs,
                                  batch_invariant=config.batch_invariant, groups=self.kv_groups)
        self.lora = self._lora_manager(model, model_config, config, dtype)
        self.sampler = Sampler()
        weight_bytes = model.weight_bytes() if hasattr(model, "weight_bytes") else 0
        self.cost = model_cost(model_config, weight_bytes, self.kv_dtype, torch.finfo(dtype).bits // 8,
                               config.tensor_parallel)
        self._expert_bytes = (getattr(model, "expert_bytes_touched", None) if getattr(model_config, "num_experts", 0)
                              else None)
        self.requests: dict[str, Request] = {}
        self._text: dict = {}  # request id -> TextWithStops
        self._arrivals = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        # (request id, why, error code or None) of requests the engine stopped on an error
        self._failed: list[tuple[str, str, str | None]] = []
        eos = set(model_config.eos_token_ids)
        if tokenizer is not None:
            eos.update(tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.grammars = Grammars(config, tokenizer, model_config.vocab_size, self.eos_token_ids)
        self.proposer = NgramProposer(config, self.max_model_len) if config.speculative else None
        self.stats = StepStats()
        self.last_schedule: SchedulerOutput | None = None  # the most recent step's (tests, benchmarks)
        self._in_step: SchedulerOutput | None = None  # the schedule of a step that has not returned (it raised)
        self._on_schedule: ScheduleHook | None = None

    def _lora_manager(self, model, model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype):
        if not config.enable_lora:
            return None
        if config.tensor_parallel != 1 or config.batch_invariant:
            raise ValueError("--enable-lora runs on one process and without --batch-invariant (an adapter's rows are "
                             "multiplied by slot group, not one row at a time)")
        if not hasattr(model, "layers"):
            raise ValueError("--enable-lora needs a decoder model")
        from .lora import LoraManager

        add = getattr(getattr(model, "ops", None), "lora_add", None) or kernels.reference.lora_add
        manager = LoraManager(model, model_config, config.max_loras, config.max_lora_rank, config.max_cpu_loras,
                              config.max_lora_bytes, config.lora_root, dtype, config.device, add)
        self.scheduler.admission_gate = manager.acquire
        return manager

    @classmethod
    def from_config(cls, config: EngineConfig, progress=None) -> Engine:
        """progress(done, total): called as weight tensors load."""
        from ..models.build import load_model
        from ..models.loader import default_model_path
        from ..models.quantize import check_quantization, quantize_model

        path = config.model or default_model_path()
        dtype = resolve_dtype(config.dtype, config.device)
        check_speculative(config)
        check_batch_invariant(config)
        check_grammar_budgets(config)
        check_quantization(config.quantize, dtype)  # before anything loads or starts
        resolve_kv_dtype(config.kv_dtype, dtype)  # likewise: an unknown --kv-dtype fails here
        if torch.device(config.device).type == "cuda":
            torch.cuda.set_device(torch.device(config.device))  # before anything lands on it (cuda:N, not cuda:0)
        if config.tensor_parallel != 1:
            from .tensor_parallel import load_tensor_parallel

            model, model_config, tokenizer, parallel = load_tensor_parallel(path, config, dtype, progress)
            try:
                quantize_model(model, config.quantize)  # rank 0's shard (ranks 1..N-1 quantize theirs in run_rank)
                return cls(model, model_config, config, dtype, tokenizer, parallel)
            except BaseException:
                parallel.close()
                raise
        model, model_config, tokenizer = load_model(path, dtype=dtype, device=config.device,
                                                    max_positions=config.max_model_len, progress=progress)
        quantize_model(model, config.quantize)
        return cls(model, model_config, config, dtype, tokenizer)

    def close(self) -> None:
        """Ends the other tensor-parallel ranks (their processes exit); idempotent, a no-op for one process.
        The engine cannot step after it."""
        if self.parallel is not None:
            self.parallel.close()
        self.grammars.close()

    # ---- requests -------------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams, num_prompt_tokens: int | None = None
                 ) -> None:
        """Raises InvalidRequestError for a request that must never be scheduled."""
        total = validate_request(prompt_token_ids, params, num_prompt_tokens, self.model_config.vocab_size,
                                 self.max_model_len)
        if params.lora is not None and self.lora is None:
            raise InvalidRequestError("this worker serves no LoRA adapters (start it with --enable-lora)")
        if params.constrained and self.tokenizer is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer, and this engine has none")
        short = self.kv_cache.short_of(total, self.config.max_num_batched_tokens)
        if short is not None:
            raise InvalidRequestError(
                f"the request needs {short[0]} KV blocks ({total} tokens) and the whole cache has "
                f"{short[1]}; it could never run")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, num_prompt_tokens: int | None = None) -> str:
        """Queue a request. num_prompt_tokens < len(prompt_token_ids) replays a request whose first outputs are
        the tail of prompt_token_ids (same seed: same tokens from there on)."""
        params = params or SamplingParams()
        self.validate(prompt_token_ids, params, num_prompt_tokens)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if params.seed is None:
            params = SamplingParams(**{**params.__dict__, "seed": random.getrandbits(63)})
        req = Request(request_id, list(prompt_token_ids), params, arrival_seq=next(self._arrivals),
                      num_prompt_tokens=len(prompt_token_ids) if num_prompt_tokens is None else num_prompt_tokens)
        if self.config.record_logits:
            req.debug_logits = []
        self.requests[request_id] = req
        if self.tokenizer is not None and (self.config.detokenize or params.stop):
            from ..models.tokenizer import IncrementalDetokenizer, TextWithStops
            self._text[request_id] = TextWithStops(IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids),
                                                  params.stop)
        if params.constrained:  # compiled off this thread; scheduled once its grammar is ready
            self.grammars.submit(req)
        else:
            self.scheduler.add(req)
        return request_id

    def _fail(self, req: Request, why: str, code: str | None = None) -> None:
        """Ends a request on an error of its own (its grammar): no output of its follows (take_failed)."""
        log.warning("request %s failed: %s", req.request_id, why)
        self.scheduler.finish(req, FinishReason.ABORT)
        self._forget(req)
        self._failed.append((req.request_id, why, code))

    def take_failed(self) -> list[tuple[str, str, str | None]]:
        """(request id, why, error code or None) of the requests the engine stopped on an error since the last
        call: no output of theirs follows (their clients are told by whoever serves them). Code
        "grammar_too_slow": the request's own grammar spent its time budget (the client's to fix)."""
        out, self._failed = self._failed, []
        return out

    def abort(self, request_id: str) -> bool:
        """Stop a waiting or running request now and free its blocks. False if it is unknown or finished."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self.grammars.cancel(req)  # when it waits for its grammar: its compile stops unless another request waits
        self.scheduler.finish(req, FinishReason.ABORT)
        self._pending_outputs.append(self._final_output(req, []))
        self._forget(req)
        return True

    def take_pending_outputs(self) -> list[RequestOutput]:
        """Outputs produced outside a step (aborts), normally returned by the next step()."""
        out, self._pending_outputs = self._pending_outputs, []
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self.grammars.awaiting)

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self._text.pop(req.request_id, None)

    def _final_output(self, req: Request, new_ids: list[int], text: str = "",
                      logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        return RequestOutput(req.request_id, new_ids, text, req.is_finished,
                             req.finish_reason.value if req.finish_reason else None, req.stop_reason,
                             req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens, logprobs or [],
                             prompt_logprobs=prompt_logprobs.take(req) if new_ids else None)

    # ---- the worker's view (EngineProtocol, protocol.py) -----------------------------------------------------
    def unfinished_request_ids(self) -> list[str]:
        return list(self.requests)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.grammars.awaiting)

    def failed_step_request_ids(self) -> list[str]:
        sched, self._in_step = self._in_step, None
        if sched is not None:
            return [s.request.request_id for s in sched.scheduled]
        # it failed before scheduling: the step would have run the running requests, or else admitted waiters
        return [r.request_id for r in self.scheduler.running or self.scheduler.waiting]

    def on_schedule(self, hook: ScheduleHook | None) -> None:
        self._on_schedule = hook

    def info(self) -> EngineInfo:
        return EngineInfo(self.max_model_len, self.model_config.vocab_size, self.eos_token_ids,
                          self.kv_cache.num_blocks, self.kv_cache.block_size)

    def snapshot(self) -> EngineSnapshot:
        kv, scheduler, stats = self.kv_cache, self.scheduler, self.stats
        # with several KV cache groups (sliding windows), the fullest one's blocks: it is the one that runs out
        pool = max(kv.pools, key=lambda p: 1 - p.num_free / p.num_blocks)
        free = pool.num_free
        _, prefill, decode, nbytes, flops = stats.last
        return EngineSnapshot(running=len(scheduler.running), waiting=len(scheduler.waiting),
                              kv_blocks_in_use=pool.num_blocks - free, kv_blocks_free=free,
                              kv_num_blocks=pool.num_blocks,
                              prefix_cache_hits=kv.stats.hits, prefix_cache_queries=kv.stats.queries,
                              num_preemptions=scheduler.num_preemptions, num_steps=stats.num_steps,
                              running_by_tier=tuple(scheduler.seats_by_tier()),
                              preemptions_by_tier=tuple(scheduler.preemptions_by_tier),
                              busy=self.has_unfinished_requests(), last_prefill_tokens=prefill,
                              last_decode_tokens=decode, last_bytes=nbytes, last_flops=flops,
                              last_draft_tokens=stats.last_spec[0], last_accepted_tokens=stats.last_spec[1],
                              **self._lora_snapshot())

    def _lora_snapshot(self) -> dict:
        if self.lora is None:
            return {}
        return dict(lora_adapters=tuple(self.lora.held()), lora_slots_used=len(self.lora.loaded()),
                    lora_loads=self.lora.loads, lora_evictions=self.lora.evictions)

    # ---- the step: schedule -> execute -> sample -> update_from_output ----------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self.take_pending_outputs()
        self._in_step = None
        sched = self._in_step = self.last_schedule = self.schedule()
        if not sched:
            if self.grammars.awaiting:  # nothing else to run: wait a little for a compile rather than spin
                self.grammars.wait_for_compile(GRAMMAR_POLL_S)
            self._in_step = None
            return outputs
        started = time.perf_counter()
        if self._on_schedule is not None:
            self._on_schedule([s.request.params.seed for s in sched.scheduled])
        # (request, draft tokens, logits rows) of every request that samples, read before num_computed_tokens moves
        samplers = [SamplingRequest(s.request, s.request.draft_token_ids[:s.num_draft], s.num_logits)
                    for s in sched.scheduled if s.samples]
        masks, logits, prompt = self.execute(sched, samplers)
        sampled = self.sample(samplers, logits, masks)
        sampled.prompt = prompt
        outputs += self.update_from_output(sched, sampled, started)
        self._in_step = None
        return outputs

    def schedule(self) -> SchedulerOutput:
        """Requests whose grammar is ready join the line (those whose compile failed end), the sequences about to
        decode get their drafts, and the scheduler picks the step's batch."""
        if self.grammars.awaiting:
            ready, failed = self.grammars.take_compiled()
            for failure in failed:
                self._fail(*failure)
            for req in ready:
                self.scheduler.add(req)
        if self.lora is not None:
            for req, why in self.lora.unavailable(self.scheduler.waiting):
                self._fail(req, why, "adapter_unavailable")
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        return self.scheduler.schedule()

    def execute(self, sched: SchedulerOutput, samplers: list[SamplingRequest]) -> tuple[Masks | None, torch.Tensor,
                                                                                        list]:
        """The forward pass: float32 logits, one row per sampled position (a request verifying k drafts has k + 1,
        at positions num_tokens .. num_tokens + k), and the step's prompt logprobs (prompt_logprobs.py). The
        constrained rows' masks are filled on the grammar threads meanwhile (None when no row has a grammar)."""
        masks = self.grammars.start_masks(samplers)
        if self.lora is not None:
            self.lora.begin_step([s.request for s in sched.scheduled], [s.num_tokens for s in sched.scheduled])
        try:
            prompt_rows = prompt_logprobs.plan(sched)
            if not prompt_rows:
                return masks, self.runner.execute(sched), []
            keep = [r.row + k for r in prompt_rows for k in range(r.count)]
            logits, hidden = self.runner.execute_keeping(sched, keep)
            return masks, logits, prompt_logprobs.compute(self.runner.model.compute_logits, hidden, prompt_rows)
        finally:
            if self.lora is not None:
                self.lora.end_step()

    def sample(self, samplers: list[SamplingRequest], logits: torch.Tensor, masks: Masks | None) -> SampleOutput:
        """logit_bias, the grammar masks, penalties and min_tokens, then the draw (a function of the request's seed
        and the position, never of the batch); each request keeps its accepted drafts and the token after them, and
        its matcher (if any) takes those. Changes no request's tokens: update_from_output does."""
        row_reqs = [r for r, _, n in samplers for _ in range(n)]
        positions = [r.num_tokens + j for r, _, n in samplers for j in range(n)]
        apply_logit_bias(logits, row_reqs)
        failed = self.grammars.apply_masks(logits, masks) if masks is not None else []
        raw_logits = apply_penalties_and_min_tokens(logits, row_reqs, self.eos_token_ids)
        tokens, logprobs = self.sampler.sample(logits, [r.params for r in row_reqs],
                                               [r.params.seed for r in row_reqs], positions, raw_logits)
        sampled, row = [], 0
        for req, drafts, n in samplers:
            sampled.append(Sampled(req, drafts, accept_drafts(tokens[row:row + n], drafts), row))
            row += n
        grammar: dict[str, list[tuple[bool, bool]]] = {}
        if masks is not None:  # the constrained rows' matchers take the kept tokens (grammar threads, within budgets)
            dropped = {f.request.request_id for f in failed}
            accepted = self.grammars.accept([(s.request, s.tokens, len(s.drafts) + 1) for s in sampled
                                             if s.request.constraint is not None
                                             and s.request.request_id not in dropped], masks.spent)
            grammar = accepted.results
            failed += accepted.failed
        return SampleOutput(sampled, logprobs, raw_logits, len(row_reqs), grammar, failed)

    def update_from_output(self, sched: SchedulerOutput, out: SampleOutput, started: float) -> list[RequestOutput]:
        """The one place a step changes its requests: KV computed, tokens appended (drafts accepted), grammars and
        stop conditions checked, requests finished or failed, full blocks cached; then the step's stats. Returns
        the step's outputs, one per request that sampled."""
        for failure in out.failed:  # their grammar work ran out of time: they end, their rows are dropped
            self._fail(*failure)
        stats = self.stats
        drafted_before, accepted_before = stats.spec_drafted, stats.spec_accepted
        stats.num_steps += 1
        stats.num_tokens += sched.num_tokens
        queries = [s.num_tokens for s in sched.scheduled]
        contexts = [s.request.num_computed_tokens + s.num_tokens for s in sched.scheduled]
        # an MoE model's experts: only those the step's tokens picked were read (its blocks counted them)
        experts = self._expert_bytes(sched.num_tokens) if self._expert_bytes is not None else 0
        step_bytes, step_flops = self.cost.step(queries, contexts, out.num_rows, experts)
        for req, position, entries in out.prompt:
            prompt_logprobs.collect(req, position, entries)
        for s in sched.scheduled:
            s.request.num_computed_tokens += s.num_tokens - s.num_draft  # accepted drafts are added below
            if not s.request.is_finished:  # its full blocks, before a token ends it (max_tokens 1 published none)
                self.kv_cache.cache_full_blocks(s.request)
        outputs = []
        for req, drafts, tokens, first_row in out.requests:
            if out.failed and req.is_finished:  # failed above: its rows are dropped
                continue
            verdicts = out.grammar.get(req.request_id)
            merged = None
            for j, token in enumerate(tokens):
                if req.debug_logits is not None:
                    req.debug_logits.append(out.raw_logits[first_row + j].clone())
                req.token_ids.append(token)
                stats.num_sampled += 1
                grammar_done = False
                if req.constraint is not None:
                    ok, grammar_done = verdicts[j]
                    if not ok:
                        self._fail(req, f"the sampled token {token} does not follow the request's grammar")
                        break
                step_out = self._after_token(req, token, out.logprobs[first_row + j], grammar_done)
                merged = step_out if merged is None else _merge_outputs(merged, step_out)
                if req.is_finished or j == len(tokens) - 1:
                    break
                req.num_computed_tokens += 1  # draft j was right: its KV, written this step, is valid
                stats.spec_accepted += 1
            stats.spec_drafted += len(drafts)
            req.draft_token_ids = []
            if merged is not None:
                outputs.append(merged)
        seconds = time.perf_counter() - started
        stats.seconds += seconds
        stats.bytes_read += step_bytes
        stats.flops += step_flops
        decodes = sum(s.num_tokens for s in sched.scheduled if s.num_tokens == 1 or s.num_draft)
        stats.last = (seconds, sched.num_tokens - decodes, decodes, step_bytes, step_flops)
        stats.last_spec = (stats.spec_drafted - drafted_before, stats.spec_accepted - accepted_before)
        return outputs

    def _after_token(self, req: Request, token: int, logprob: TokenLogprob | None,
                     grammar_done: bool = False) -> RequestOutput:
        reason, stop_reason = None, None
        if grammar_done:  # the grammar is complete (its matcher accepted a stop token)
            reason, stop_reason = FinishReason.STOP, token
        elif not req.params.ignore_eos and token in self.eos_token_ids:
            reason, stop_reason = FinishReason.STOP, token
        elif token in req.params.stop_token_ids:
            reason, stop_reason = FinishReason.STOP, token
        elif req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        text = ""
        state = self._text.get(req.request_id)
        if state is not None:
            text, matched = state.add([token], final=reason is not None)
            if matched is not None and reason is None:
                reason, stop_reason = FinishReason.STOP, matched
        if reason is not None:
            self.scheduler.finish(req, reason, stop_reason)
            self._forget(req)
        return self._final_output(req, [token], text, [logprob] if logprob else None)

    # ---- offline use ----------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[Request]:
        """Run prompts to completion; returns the finished requests in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done = {i: self.requests[i] for i in ids}
        while self.has_unfinished_requests():
            self.step()
        return [done[i] for i in ids]


