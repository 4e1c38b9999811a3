"""Engine: the step loop. schedule -> run the model -> sample -> update requests and emit per-step outputs."""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..config import (GRAMMAR_MASK_THREADS, MAX_NUM_DRAFT, SPECULATIVE_METHODS, EngineConfig, resolve_dtype,
                      resolve_kv_dtype)
from .. import kernels
from ..models import batch_invariant
from ..models.config import ModelConfig
from .kv_cache import KVCacheManager
from .request import FinishReason, InvalidRequestError, Request, SamplingParams, validate_request
from .cuda_graph import DecodeGraphs, wants_decode_graphs
from .memory import resolve_kv_cache_bytes
from .runner import ModelRunner, kv_bytes_per_block
from .outputs import RequestOutput
from .sampler import PenaltyState, Sampler, TokenLogprob, apply_penalties_batch
from ..telemetry.roofline import model_cost
from .scheduler import Scheduler
from .speculative import NgramIndex, propose_ngram
from .grammar_budget import GrammarTooSlow, GrammarWork, Job
from .grammar_compile import GrammarCompileService
from .structured import Constraint, allocate_bitmask, apply_bitmask

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


class _Masks(NamedTuple):
    """A step's mask fills, started before its forward pass (Engine._start_masks)."""
    bitmask: torch.Tensor
    jobs: list[Job]
    submitted: float  # time.monotonic() when the jobs were submitted
    spent: dict[str, float]  # request id -> CPU seconds its fill took (what its accept may still use of the step)


def _merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One request's outputs of one step (several tokens when drafts were accepted) as one output."""
    return RequestOutput(a.request_id, a.new_token_ids + b.new_token_ids, a.new_text + b.new_text, b.finished,
                         b.finish_reason, b.stop_reason, b.num_prompt_tokens, b.num_output_tokens, b.num_cached_tokens,
                         a.logprobs + b.logprobs)


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


def check_grammar_budgets(config: EngineConfig) -> None:
    """ValueError for structured outputs' budgets that cannot work (before anything loads)."""
    budgets = (config.grammar_mask_budget_ms, config.grammar_mask_budget_s, config.grammar_compile_timeout_s)
    if not all(isinstance(b, (int, float)) and 0 < b < float("inf") for b in budgets):
        raise ValueError(f"the grammar budgets must be > 0, got {budgets}")
    if not (isinstance(config.grammar_compile_processes, int) and config.grammar_compile_processes >= 1):
        raise ValueError(f"grammar_compile_processes must be at least 1, got {config.grammar_compile_processes!r}")


def check_speculative(config: EngineConfig) -> None:
    """ValueError for speculative settings that can't run (before anything loads)."""
    if config.speculative is None:
        return
    if config.speculative not in SPECULATIVE_METHODS:
        raise ValueError(f"unknown speculative method {config.speculative!r} (choose {', '.join(SPECULATIVE_METHODS)})")
    if not 1 <= config.num_draft <= MAX_NUM_DRAFT:
        raise ValueError(f"num_draft must be in [1, {MAX_NUM_DRAFT}], got {config.num_draft}")
    if not 1 <= config.ngram_min <= config.ngram_max:
        raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {config.ngram_min} and {config.ngram_max}")
    if config.speculative_max_batch < 1:
        raise ValueError(f"speculative_max_batch must be at least 1, got {config.speculative_max_batch}")


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
        num_blocks = self.kv_cache_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes} is less than one KV block ({per_block} bytes)")
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        # CUDA graphs for decode (cuda_graph.py): the pool's last block is kept back for the padded rows to write to
        static = config.static_decode and num_blocks > 1  # the same path uncaptured (a CPU check of it)
        # batch-invariant steps never take the graphs' padded static path
        decode_graphs = (wants_decode_graphs(config) or static) and num_blocks > 1 and not config.batch_invariant
        self.kv_cache = KVCacheManager(num_blocks - decode_graphs, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, model_config, num_blocks, config.block_size, dtype, config.device,
                                  config.tensor_parallel, parallel, kv_dtype=self.kv_dtype)
        if decode_graphs:
            graphs = DecodeGraphs(self.runner, config.max_num_seqs, self.max_model_len, scratch_block=num_blocks - 1)
            self.runner.decode_graphs = graphs if static and not wants_decode_graphs(config) else graphs.capture()
        # set either way: the mode lives in the model's layers, and a model may be handed to another engine
        batch_invariant.enable(model, config.batch_invariant)
        self.runner.batch_invariant = config.batch_invariant
        self.sampler = Sampler()
        weight_bytes = model.weight_bytes() if hasattr(model, "weight_bytes") else 0
        self.cost = model_cost(model_config, weight_bytes, self.kv_dtype, torch.finfo(dtype).bits // 8,
                               config.tensor_parallel)
        self.requests: dict[str, Request] = {}
        self._text: dict = {}  # request id -> TextWithStops
        self._arrivals = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self._grammars: GrammarCompileService | None = None  # built with the first constrained request
        self._grammar_work: GrammarWork | None = None  # ... and the threads of its masks and accepts
        self._awaiting_grammar: list[Request] = []  # constrained requests whose grammar is being compiled
        self._replays: dict[str, Job] = {}  # request id -> the replay of its earlier tokens through its matcher
        # (request id, why, error code or None) of requests the engine stopped on an error
        self._failed: list[tuple[str, str, str | None]] = []
        eos = set(model_config.eos_token_ids)
        if tokenizer is not None:
            eos.update(tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.stats = StepStats()
        self.last_schedule = None  # the most recent step's SchedulerOutput (tests, metrics)

    @classmethod
    def from_config(cls, config: EngineConfig, progress=None) -> "Engine":
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
        if self.runner.parallel is not None:
            self.runner.parallel.close()
        if self._grammars is not None:
            self._grammars.close()
            self._grammar_work.close()

    # ---- requests -------------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams, num_prompt_tokens: int | None = None
                 ) -> None:
        """Raises InvalidRequestError for a request that must never be scheduled."""
        total = validate_request(prompt_token_ids, params, num_prompt_tokens, self.model_config.vocab_size,
                                 self.max_model_len)
        if params.constrained and self.tokenizer is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer, and this engine has none")
        need = self.kv_cache.blocks_needed(total)
        if need > self.kv_cache.num_blocks:
            raise InvalidRequestError(
                f"the request needs {need} KV blocks ({total} tokens) and the whole cache has "
                f"{self.kv_cache.num_blocks}; it could never run")

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
            req.grammar_future = self._grammar_compiler().submit(*params.structured)
            self._awaiting_grammar.append(req)
        else:
            self.scheduler.add(req)
        return request_id

    def _grammar_compiler(self) -> GrammarCompileService:
        if self._grammars is None:
            cfg = self.config
            self._grammars = GrammarCompileService(self.tokenizer.hf, self.model_config.vocab_size,
                                                   sorted(self.eos_token_ids), cfg.grammar_compile_processes,
                                                   cfg.grammar_compile_timeout_s)
            self._grammar_work = GrammarWork(GRAMMAR_MASK_THREADS)
        return self._grammars

    def _admit_compiled(self) -> None:
        """Constrained requests whose grammar has compiled join the scheduler (a replay's matcher first accepts
        the tokens generated before it, on a grammar thread, within the request's whole budget); a compile that
        failed or ran out of time fails its request."""
        still = []
        for req in self._awaiting_grammar:
            future = req.grammar_future
            replay = self._replays.get(req.request_id)
            if not future.done():
                if replay is not None and replay.clock is not None and replay.cpu_used() > replay.budget_s:
                    self._replays.pop(req.request_id)  # its thread finishes alone
                    req.grammar_seconds += replay.cpu_used()
                    self._fail(req, self._too_slow_message(req, "replaying its earlier tokens"), GrammarTooSlow.code)
                else:
                    still.append(req)
                continue
            req.grammar_future = None
            try:
                if req.constraint is None:  # its compile
                    constraint = Constraint(future.result())
                    if req.output_token_ids:  # a replay
                        req.constraint = constraint
                        self._replay_grammar(req)
                        still.append(req)
                        continue
                    req.constraint = constraint
                else:  # the replay of its earlier tokens
                    ok = future.result()
                    req.grammar_seconds += self._replays.pop(req.request_id).seconds
                    if not ok:
                        raise ValueError("the tokens generated before the replay do not follow the grammar")
            except GrammarTooSlow as e:
                self._fail(req, str(e), GrammarTooSlow.code)
                continue
            except Exception as e:
                self._fail(req, f"the request's grammar could not be used: {e}")
                continue
            self.scheduler.add(req)
        self._awaiting_grammar = still

    def _replay_grammar(self, req: Request) -> None:
        """A replay's new matcher takes the tokens generated before, on a grammar thread, within the request's
        whole budget (checked by _admit_compiled)."""
        job = Job(req, functools.partial(req.constraint.advance, req.output_token_ids),
                  self.config.grammar_mask_budget_s)
        self._grammar_work.start([job])
        self._replays[req.request_id] = job
        req.grammar_future = job.future

    def _fail(self, req: Request, why: str, code: str | None = None) -> None:
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
        if req in self._awaiting_grammar:
            self._awaiting_grammar.remove(req)
            self._replays.pop(request_id, None)
            self._grammars.cancel(req.grammar_future)  # its compile stops unless another request waits for it
        self.scheduler.finish(req, FinishReason.ABORT)
        self._pending_outputs.append(self._final_output(req, []))
        self._forget(req)
        return True

    def take_pending_outputs(self) -> list[RequestOutput]:
        """Outputs produced outside a step (aborts), normally returned by the next step()."""
        out, self._pending_outputs = self._pending_outputs, []
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._awaiting_grammar)

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self._text.pop(req.request_id, None)

    def _final_output(self, req: Request, new_ids: list[int], text: str = "",
                      logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        return RequestOutput(req.request_id, new_ids, text, req.is_finished,
                             req.finish_reason.value if req.finish_reason else None, req.stop_reason,
                             req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens, logprobs or [])

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self.take_pending_outputs()
        if self._awaiting_grammar:
            self._admit_compiled()
        if self.config.speculative:
            self._propose_drafts()
        sched = self.last_schedule = self.scheduler.schedule()
        if not sched:
            if self._awaiting_grammar:  # nothing else to run: wait a little for a compile rather than spin
                concurrent.futures.wait([r.grammar_future for r in self._awaiting_grammar], timeout=GRAMMAR_POLL_S,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
            return outputs
        t0 = time.perf_counter()
        drafted_before, accepted_before = self.stats.spec_drafted, self.stats.spec_accepted
        # (request, draft tokens, logits rows) of every request that samples, read before num_computed_tokens moves
        samplers = [(s.request, s.request.draft_token_ids[:s.num_draft], s.num_logits)
                    for s in sched.scheduled if s.samples]
        # the grammar masks are filled on their threads while the model runs (nothing to do without a grammar)
        masks = self._start_masks(samplers) if self._grammars is not None else None
        logits = self.runner.execute(sched)
        # one logits row per sampled position: a request verifying k drafts has k + 1 of them, at positions
        # num_tokens .. num_tokens + k (the sampler's draw depends on the position, never on the batch)
        row_reqs = [r for r, _, n in samplers for _ in range(n)]
        positions = [r.num_tokens + j for r, _, n in samplers for j in range(n)]
        self._bias(logits, samplers)
        if masks is not None:
            self._apply_masks(logits, masks)
        raw_logits = self._process_logits(logits, row_reqs)
        tokens, logprobs = self.sampler.sample(logits, [r.params for r in row_reqs],
                                               [r.params.seed for r in row_reqs], positions, raw_logits)
        # the constrained rows' matchers take the sampled tokens (on the grammar threads, within their budgets)
        accepted = self._accept_tokens(samplers, tokens, masks.spent) if masks is not None else None
        stats = self.stats
        stats.num_steps += 1
        stats.num_tokens += sched.num_tokens
        queries = [s.num_tokens for s in sched.scheduled]
        contexts = [s.request.num_computed_tokens + s.num_tokens for s in sched.scheduled]
        step_bytes, step_flops = self.cost.step(queries, contexts, len(row_reqs))
        for s in sched.scheduled:
            s.request.num_computed_tokens += s.num_tokens - s.num_draft  # accepted drafts are added below
        row = 0
        for req, drafts, num_logits in samplers:
            if accepted is not None and req.is_finished:  # its grammar ran out of time (failed above): rows dropped
                row += num_logits
                continue
            out = None
            for j in range(num_logits):
                token = tokens[row + j]
                if req.debug_logits is not None:
                    req.debug_logits.append(raw_logits[row + j].clone())
                req.token_ids.append(token)
                stats.num_sampled += 1
                grammar_done = False
                if req.constraint is not None:
                    ok, grammar_done = accepted[req.request_id][j]
                    if not ok:
                        self._fail(req, f"the sampled token {token} does not follow the request's grammar")
                        break
                step_out = self._after_token(req, token, logprobs[row + j], grammar_done)
                out = step_out if out is None else _merge_outputs(out, step_out)
                if req.is_finished or j == len(drafts) or token != drafts[j]:
                    break
                req.num_computed_tokens += 1  # draft j was right: its KV, written this step, is valid
                stats.spec_accepted += 1
            stats.spec_drafted += len(drafts)
            req.draft_token_ids = []
            row += num_logits
            if out is not None:
                outputs.append(out)
        for s in sched.scheduled:
            if not s.request.is_finished:
                self.kv_cache.cache_full_blocks(s.request)
        seconds = time.perf_counter() - t0
        stats.seconds += seconds
        stats.bytes_read += step_bytes
        stats.flops += step_flops
        decodes = sum(s.num_tokens for s in sched.scheduled if s.num_tokens == 1 or s.num_draft)
        stats.last = (seconds, sched.num_tokens - decodes, decodes, step_bytes, step_flops)
        stats.last_spec = (stats.spec_drafted - drafted_before, stats.spec_accepted - accepted_before)
        return outputs

    def _propose_drafts(self) -> None:
        """Prompt-lookup drafts for the running sequences about to decode. None for a request whose logits are
        changed by what it generated (penalties, min_tokens still blocking EOS: its draft rows would need the drafts
        as outputs), nor in a step with more decoding sequences than speculative_max_batch."""
        cfg = self.config
        decoding = [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        if len(decoding) > cfg.speculative_max_batch:
            for r in decoding:
                r.draft_token_ids = []
            return
        for r in decoding:
            room = min(cfg.num_draft, r.params.max_tokens - r.num_output_tokens - 1,
                       self.max_model_len - r.num_tokens - 1)
            if room < 1 or r.params.has_penalties or r.num_output_tokens < r.params.min_tokens:
                r.draft_token_ids = []
                continue
            if r.spec_state is None:
                r.spec_state = NgramIndex()
            r.draft_token_ids = propose_ngram(r.token_ids, r.spec_state, room, cfg.ngram_min, cfg.ngram_max)

    @torch.inference_mode()
    def _bias(self, logits: torch.Tensor, samplers: list[tuple[Request, list[int], int]]) -> None:
        """logit_bias, in place (before the grammar masks, penalties, logprobs and the draw)."""
        bias_rows, bias_cols, bias_vals = [], [], []
        row = 0
        for req, drafts, n in samplers:
            if req.params.logit_bias:
                for j in range(n):
                    for token, bias in req.params.logit_bias:
                        bias_rows.append(row + j)
                        bias_cols.append(token)
                        bias_vals.append(float(bias))
            row += n
        if bias_rows:
            dev = logits.device
            logits.index_put_((torch.tensor(bias_rows, device=dev), torch.tensor(bias_cols, device=dev)),
                              torch.tensor(bias_vals, dtype=logits.dtype, device=dev), accumulate=True)

    # ---- grammars in the step (grammar_budget.py) -----------------------------------------------------------
    def _start_masks(self, samplers: list[tuple[Request, list[int], int]]) -> _Masks | None:
        """Starts the fills of the constrained rows' masks on the grammar threads (the forward pass runs meanwhile);
        None when no row has a grammar. A request verifying k drafts has k + 1 rows: row j's mask is its grammar's
        after drafts[:j] (accepted on the matcher for the fill, then rolled back), so drafts that break the grammar
        are rejected and the output is the one the request would have had without drafts."""
        jobs = []
        rows = 0
        for req, drafts, n in samplers:
            if req.constraint is not None:
                jobs.append(Job(req, functools.partial(_fill_rows, req.constraint, rows, drafts[:n - 1]),
                                n * self.config.grammar_mask_budget_ms / 1000))
            rows += n
        if not jobs:
            return None
        bitmask = allocate_bitmask(rows, self.model_config.vocab_size)  # row r of the bitmask masks logits row r
        for job in jobs:
            job.fn = functools.partial(job.fn, bitmask)
        return _Masks(bitmask, jobs, self._grammar_work.start(jobs), {})

    @torch.inference_mode()
    def _apply_masks(self, logits: torch.Tensor, masks: _Masks) -> None:
        """Waits for the fills (each within its request's budget) and applies the masks; a request whose fill ran
        out of time ends with grammar_too_slow (its rows are left unmasked and dropped)."""
        self._grammar_work.wait(masks.jobs, masks.submitted)
        masked: list[int] = []
        for job in masks.jobs:
            masks.spent[job.owner.request_id] = job.seconds
            if self._within_budget(job, "filling its token mask"):
                masked.extend(job.result)
        apply_bitmask(logits, masks.bitmask, masked)

    def _accept_tokens(self, samplers: list[tuple[Request, list[int], int]], tokens: list[int],
                       spent: dict[str, float]) -> dict[str, list[tuple[bool, bool]]]:
        """Each constrained request's sampled tokens through its matcher, in parallel, each within what its budget of
        the step has left after its fill: request id -> [(accepted, grammar complete)] per token taken."""
        jobs = []
        row = 0
        step_budget_s = self.config.grammar_mask_budget_ms / 1000
        for req, drafts, n in samplers:
            if req.constraint is not None and not req.is_finished:
                budget = max(n * step_budget_s - spent.get(req.request_id, 0.0), 0.0)
                jobs.append(Job(req, functools.partial(_accept_rows, req.constraint, tokens[row:row + n], drafts),
                                budget))
            row += n
        self._grammar_work.wait(jobs, self._grammar_work.start(jobs))
        return {job.owner.request_id: job.result for job in jobs
                if self._within_budget(job, "accepting its sampled token", spent.get(job.owner.request_id, 0.0))}

    def _within_budget(self, job: Job, what: str, before: float = 0.0) -> bool:
        """Charges the job's seconds to its request; False (and the request failed with grammar_too_slow) when it
        ran past its budget of the step, or the request's grammar work past its whole budget."""
        req = job.owner
        req.grammar_seconds += job.seconds
        if job.too_slow or job.seconds > job.budget_s:
            step_ms = (before + job.seconds) * 1000
            self._fail(req, self._too_slow_message(req, what, step_ms), GrammarTooSlow.code)
            return False
        if req.grammar_seconds > self.config.grammar_mask_budget_s:
            self._fail(req, self._too_slow_message(req, what), GrammarTooSlow.code)
            return False
        return True

    def _too_slow_message(self, req: Request, what: str, step_ms: float | None = None) -> str:
        cfg = self.config
        if step_ms is not None:
            spent = (f"{step_ms:.0f} ms in one step, over its budget of {cfg.grammar_mask_budget_ms:g} ms per token "
                     "(GRAMMAR_MASK_BUDGET_MS_PER_STEP, --grammar-mask-budget-ms)")
        else:
            spent = (f"{req.grammar_seconds:.2f} s in all, over its budget of {cfg.grammar_mask_budget_s:g} s "
                     "(GRAMMAR_MASK_BUDGET_S, --grammar-mask-budget-s)")
        return (f"the request's grammar is too slow: {what} took {spent} after {req.num_output_tokens} tokens; "
                "use a less ambiguous grammar")

    @torch.inference_mode()
    def _process_logits(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Penalties and min_tokens, in place on the rows that ask for them. Returns the raw logits (a copy when
        any row changed): logprobs and recorded logits are those of the model, as in vLLM."""
        # min_tokens does not apply to constrained rows: their grammar decides where the output may end
        rows = [i for i, r in enumerate(reqs) if r.params.has_penalties
                or (r.num_output_tokens < r.params.min_tokens and r.constraint is None)]
        if not rows:
            return logits
        raw = logits.clone()
        penalised = [i for i in rows if reqs[i].params.has_penalties]
        if penalised:  # batched, from each request's state on the device (brought up to date, not rebuilt)
            states = []
            for i in penalised:
                req = reqs[i]
                if req.penalty_state is None:
                    req.penalty_state = PenaltyState(logits.shape[1], logits.device)
                req.penalty_state.update(req.token_ids, req.num_prompt_tokens)
                states.append(req.penalty_state)
            apply_penalties_batch(logits, penalised, states, [reqs[i].params for i in penalised])
        for i in rows:
            req = reqs[i]
            if req.num_output_tokens < req.params.min_tokens and req.constraint is None:
                blocked = list(req.params.stop_token_ids) + ([] if req.params.ignore_eos else list(self.eos_token_ids))
                if blocked:
                    logits[i, blocked] = float("-inf")
        return raw

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


def _fill_rows(constraint: Constraint, first: int, drafts: list[int], bitmask: torch.Tensor) -> list[int]:
    """Fills bitmask row `first` from the matcher, and row first + j + 1 after drafts[:j + 1] (rolled back after);
    returns the rows filled. Runs on a grammar thread."""
    constraint.fill(bitmask, first)
    rows = [first]
    accepted = 0
    for j, token in enumerate(drafts):  # row first + j + 1 follows drafts[:j + 1]
        if not constraint.accept(token):
            break  # row first + j cannot sample this draft: the rows after it are never used
        accepted += 1
        if constraint.terminated:
            break
        constraint.fill(bitmask, first + j + 1)
        rows.append(first + j + 1)
    constraint.rollback(accepted)
    return rows


def _accept_rows(constraint: Constraint, tokens: list[int], drafts: list[int]) -> list[tuple[bool, bool]]:
    """The matcher takes a request's sampled tokens as the step will keep them: token j + 1 only when token j was
    draft j (then draft j's row was right). [(accepted, grammar complete)] per token taken. Runs on a grammar
    thread; tokens past where the request ends for another reason (length, a stop string) change nothing, since it
    ends."""
    out = []
    for j, token in enumerate(tokens):
        ok = constraint.accept(token)
        done = ok and constraint.terminated
        out.append((ok, done))
        if not ok or done or j == len(drafts) or token != drafts[j]:
            break
    return out
