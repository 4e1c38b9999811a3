"""Grammars in the engine step: the structured-output component Engine.step calls (structured.py has the grammars
themselves, grammar_compile.py their compiles, grammar_budget.py the time budget of their work).

Grammars owns what a constrained request needs besides the model: its compile (requests wait here, off the
scheduler, until their grammar is ready; a replay's matcher first takes the tokens generated before), the masks of a
step's constrained rows (filled on the grammar threads while the forward pass runs, applied before sampling) and the
advance of each matcher by the tokens the step keeps. Each piece of work is charged to its request's budget; a
request over it is reported as failed (request, why, error code), never finished here: the engine ends it where it
updates every request (Engine.update_from_output, or before scheduling for a compile that failed).
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import NamedTuple

import torch

from ..config import GRAMMAR_MASK_THREADS, EngineConfig
from .grammar_budget import GrammarTooSlow, GrammarWork, Job
from .grammar_compile import GrammarCompileService
from .request import Request
from .structured import Constraint, allocate_bitmask, apply_bitmask


class Failure(NamedTuple):
    """A request the grammar work stopped: the engine ends it with this message (and error code, when it has one)."""
    request: Request
    why: str
    code: str | None = None


class Masks(NamedTuple):
    """A step's mask fills, started before its forward pass (Grammars.start_masks)."""
    bitmask: torch.Tensor
    jobs: list[Job]
    submitted: float  # time.monotonic() when the jobs were submitted
    spent: dict[str, float]  # request id -> CPU seconds its fill took (what its accept may still use of the step)


class Accepted(NamedTuple):
    """What the matchers made of a step's kept tokens."""
    results: dict[str, list[tuple[bool, bool]]]  # request id -> (accepted, grammar complete) per token it took
    failed: list[Failure]


def check_grammar_budgets(config: EngineConfig) -> None:
    """ValueError for structured outputs' budgets that cannot work (before anything loads)."""
    budgets = (config.grammar_mask_budget_ms, config.grammar_mask_budget_s, config.grammar_compile_timeout_s)
    if not all(isinstance(b, (int, float)) and 0 < b < float("inf") for b in budgets):
        raise ValueError(f"the grammar budgets must be > 0, got {budgets}")
    if not (isinstance(config.grammar_compile_processes, int) and config.grammar_compile_processes >= 1):
        raise ValueError(f"grammar_compile_processes must be at least 1, got {config.grammar_compile_processes!r}")


class Grammars:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._service: GrammarCompileService | None = None  # built with the first constrained request
        self._work: GrammarWork | None = None  # ... and the threads of its masks and accepts
        self.awaiting: list[Request] = []  # constrained requests whose grammar is being compiled
        self._replays: dict[str, Job] = {}  # request id -> the replay of its earlier tokens through its matcher

    @property
    def started(self) -> bool:
        """Whether any constrained request came (before that no step has grammar work)."""
        return self._service is not None

    def compiler(self) -> GrammarCompileService:
        if self._service is None:
            cfg = self.config
            self._service = GrammarCompileService(self.tokenizer.hf, self.vocab_size, sorted(self.eos_token_ids),
                                                  cfg.grammar_compile_processes, cfg.grammar_compile_timeout_s)
            self._work = GrammarWork(GRAMMAR_MASK_THREADS)
        return self._service

    def close(self) -> None:
        if self._service is not None:
            self._service.close()
            self._work.close()

    # ---- compiles: requests wait here until their grammar is ready ----------------------------------------------
    def submit(self, req: Request) -> None:
        """Starts the compile of a constrained request's grammar (off this thread); it waits here meanwhile."""
        req.grammar_future = self.compiler().submit(*req.params.structured)
        self.awaiting.append(req)

    def cancel(self, req: Request) -> bool:
        """Forgets a request aborted while it waits for its grammar (its compile stops unless another request waits
        for it); False when it was not waiting here."""
        if req not in self.awaiting:
            return False
        self.awaiting.remove(req)
        self._replays.pop(req.request_id, None)
        self._service.cancel(req.grammar_future)
        return True

    def wait_for_compile(self, timeout: float) -> None:
        """Until a compile in flight ends, at most timeout seconds (an idle step waits rather than spins)."""
        concurrent.futures.wait([r.grammar_future for r in self.awaiting], timeout=timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def take_compiled(self) -> tuple[list[Request], list[Failure]]:
        """The awaiting requests whose grammar is ready (to be scheduled), and those whose compile failed or ran out of
        time. A replay's matcher first accepts the tokens generated before it, on a grammar thread, within the
        request's whole budget."""
        ready: list[Request] = []
        failed: list[Failure] = []
        still = []
        for req in self.awaiting:
            future = req.grammar_future
            replay = self._replays.get(req.request_id)
            if not future.done():
                if replay is not None and replay.clock is not None and replay.cpu_used() > replay.budget_s:
                    self._replays.pop(req.request_id)  # its thread finishes alone
                    req.grammar_seconds += replay.cpu_used()
                    failed.append(Failure(req, self._too_slow_message(req, "replaying its earlier tokens"),
                                          GrammarTooSlow.code))
                else:
                    still.append(req)
                continue
            req.grammar_future = None
            try:
                if req.constraint is None:  # its compile
                    constraint = Constraint(future.result())
                    if req.output_token_ids:  # a replay
                        req.constraint = constraint
                        self._replay(req)
                        still.append(req)
                        continue
                    req.constraint = constraint
                else:  # the replay of its earlier tokens
                    ok = future.result()
                    req.grammar_seconds += self._replays.pop(req.request_id).seconds
                    if not ok:
                        raise ValueError("the tokens generated before the replay do not follow the grammar")
            except GrammarTooSlow as e:
                failed.append(Failure(req, str(e), GrammarTooSlow.code))
                continue
            except Exception as e:
                failed.append(Failure(req, f"the request's grammar could not be used: {e}"))
                continue
            ready.append(req)
        self.awaiting = still
        return ready, failed

    def _replay(self, req: Request) -> None:
        """A replay's new matcher takes the tokens generated before, on a grammar thread, within the request's
        whole budget (checked by take_compiled)."""
        job = Job(req, functools.partial(req.constraint.advance, req.output_token_ids),
                  self.config.grammar_mask_budget_s)
        self._work.start([job])
        self._replays[req.request_id] = job
        req.grammar_future = job.future

    # ---- the step: masks before sampling, the matchers' advance after -----------------------------------------
    def start_masks(self, samplers: list[tuple[Request, list[int], int]]) -> Masks | None:
        """Starts the fills of the constrained rows' masks on the grammar threads (the forward pass runs meanwhile);
        None when no row has a grammar. samplers: (request, its drafts verified, its rows) of each request that
        samples, in row order. A request verifying k drafts has k + 1 rows: row j's mask is its grammar's after
        drafts[:j] (accepted on the matcher for the fill, then rolled back), so drafts that break the grammar are
        rejected and the output is the one the request would have had without drafts."""
        if self._service is None:
            return None
        jobs = []
        rows = 0
        for req, drafts, n in samplers:
            if req.constraint is not None:
                jobs.append(Job(req, functools.partial(_fill_rows, req.constraint, rows, drafts[:n - 1]),
                                n * self.config.grammar_mask_budget_ms / 1000))
            rows += n
        if not jobs:
            return None
        bitmask = allocate_bitmask(rows, self.vocab_size)  # row r of the bitmask masks logits row r
        for job in jobs:
            job.fn = functools.partial(job.fn, bitmask)
        return Masks(bitmask, jobs, self._work.start(jobs), {})

    @torch.inference_mode()
    def apply_masks(self, logits: torch.Tensor, masks: Masks) -> list[Failure]:
        """Waits for the fills (each within its request's budget) and applies the masks; a request whose fill ran
        out of time is returned, to end with grammar_too_slow (its rows are left unmasked, and dropped)."""
        self._work.wait(masks.jobs, masks.submitted)
        masked: list[int] = []
        failed: list[Failure] = []
        for job in masks.jobs:
            masks.spent[job.owner.request_id] = job.seconds
            failure = self._over_budget(job, "filling its token mask")
            if failure is None:
                masked.extend(job.result)
            else:
                failed.append(failure)
        apply_bitmask(logits, masks.bitmask, masked)
        return failed

    def accept(self, kept: list[tuple[Request, list[int]]], spent: dict[str, float]) -> Accepted:
        """Each constrained request's kept tokens through its matcher, in parallel, each within what its budget of
        the step has left after its fill (kept: (request, the tokens the step keeps) of each constrained request
        still running, rows it had: budget per row)."""
        jobs = []
        step_budget_s = self.config.grammar_mask_budget_ms / 1000
        for req, tokens, rows in kept:
            budget = max(rows * step_budget_s - spent.get(req.request_id, 0.0), 0.0)
            jobs.append(Job(req, functools.partial(_accept_tokens, req.constraint, tokens), budget))
        self._work.wait(jobs, self._work.start(jobs))
        results, failed = {}, []
        for job in jobs:
            failure = self._over_budget(job, "accepting its sampled token", spent.get(job.owner.request_id, 0.0))
            if failure is None:
                results[job.owner.request_id] = job.result
            else:
                failed.append(failure)
        return Accepted(results, failed)

    def _over_budget(self, job: Job, what: str, before: float = 0.0) -> Failure | None:
        """Charges the job's seconds to its request; its failure (grammar_too_slow) when it ran past its budget of
        the step, or the request's grammar work past its whole budget."""
        req = job.owner
        req.grammar_seconds += job.seconds
        if job.too_slow or job.seconds > job.budget_s:
            step_ms = (before + job.seconds) * 1000
            return Failure(req, self._too_slow_message(req, what, step_ms), GrammarTooSlow.code)
        if req.grammar_seconds > self.config.grammar_mask_budget_s:
            return Failure(req, self._too_slow_message(req, what), GrammarTooSlow.code)
        return None

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


def _accept_tokens(constraint: Constraint, tokens: list[int]) -> list[tuple[bool, bool]]:
    """The matcher takes a request's kept tokens (speculative.accept_drafts) in order, up to the first it refuses or
    the one that completes the grammar: [(accepted, grammar complete)] per token taken. Runs on a grammar thread;
    tokens past where the request ends for another reason (length, a stop string) change nothing, since it ends."""
    out = []
    for token in tokens:
        ok = constraint.accept(token)
        done = ok and constraint.terminated
        out.append((ok, done))
        if not ok or done:
            break
    return out
