"""Scheduler: decides each step's batch under one token budget.

Order of a step: every running sequence that is decoding gets its one token first, then running prefills continue
in chunks, then waiting requests are admitted (most important priority first, FCFS inside a priority) while budget,
sequence slots and KV blocks last. The output is, as in vLLM v1, just how many tokens each request computes this
step; whether a request samples follows from whether the step reaches the end of its tokens. When a running
request cannot get a block, the least important (highest priority value), most recently admitted running request is
preempted by recompute: its blocks are freed and it waits again at its original place in line.

Priority preemption: a worker full of less important work still has room for a more important request. When the
head of the line finds no sequence slot or no KV room, running requests strictly less important than it are
preempted the same way (same victim order, same recompute path) until it fits, but only if that makes it fit:
work is never thrown away for a head that would wait anyway, and never for an equal or less important one.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .kv_cache import KVCacheManager
from .request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # computed this step, starting at request.num_computed_tokens (drafts included)
    num_draft: int = 0  # of which the last are request.draft_token_ids[:num_draft], to be verified

    @property
    def samples(self) -> bool:
        return self.request.num_computed_tokens + self.num_tokens - self.num_draft == self.request.num_tokens

    @property
    def num_logits(self) -> int:
        """Rows of this step that give logits: the last token's, and one per draft."""
        return 1 + self.num_draft if self.samples else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes first, then prefill chunks
    num_decodes: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs}) "
                "so that every running sequence can decode in every step")
        self.kv = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # sorted by (priority, arrival_seq)
        self.running: list[Request] = []  # in admission order
        self._admissions = 0
        self.num_preemptions = 0

    @staticmethod
    def _line_key(r: Request) -> tuple[int, int]:
        return (r.params.priority, r.arrival_seq)

    @staticmethod
    def _victim_key(r: Request) -> tuple[int, int]:
        """Preemption order, largest first: least important, then most recently admitted (least work lost)."""
        return (r.params.priority, r.admitted_seq)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=self._line_key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """Take a request out of the queues and give its blocks back."""
        if request.status == RequestStatus.FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason

    # ---- one step -------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[Request] = []

        def preempt(victim: Request) -> None:
            nonlocal budget
            if victim.request_id in scheduled:
                budget += scheduled.pop(victim.request_id).num_tokens
            self.running.remove(victim)
            self.kv.free(victim)
            victim.status = RequestStatus.PREEMPTED
            victim.num_preemptions += 1
            self.num_preemptions += 1
            bisect.insort(self.waiting, victim, key=self._line_key)
            preempted.append(victim)

        # running: decodes first, then continuing prefills, each in admission order
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        # speculative drafts ride on a decode only with budget beyond one token for every decode (never at the
        # cost of another sequence's decode) and only where the KV room is there without preempting anyone
        draft_budget = budget - len(decoding)
        for req in decoding:
            if not req.draft_token_ids or req.status != RequestStatus.RUNNING or draft_budget <= 0:
                continue
            k = min(len(req.draft_token_ids), draft_budget)
            if self.kv.allocate(req, 1 + k):
                scheduled[req.request_id] = ScheduledRequest(req, 1 + k, k)
                budget -= 1 + k
                draft_budget -= k
        # a more important request in prefill (running with prompt left, or the head of the line): the decodes and
        # prefill chunks of less important requests sit this step out, so that its first token does not wait for a step
        # that also runs theirs (the batch tier yields to interactive). They run again in this very step if that request
        # does not get in after all (no room), so nothing waits on a request that cannot run.
        pending = [r.params.priority for r in prefilling] + ([self.waiting[0].params.priority] if self.waiting else [])
        urgent = min(pending, default=None)
        held = [r for r in decoding + prefilling if urgent is not None and r.params.priority > urgent
                and r.request_id not in scheduled]
        if held:
            decoding = [r for r in decoding if r not in held]
            prefilling = [r for r in prefilling if r not in held]

        def run(reqs: list[Request]) -> None:
            nonlocal budget
            for req in reqs:
                if req.status != RequestStatus.RUNNING or budget == 0 or req.request_id in scheduled:
                    continue
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                while not self.kv.allocate(req, n):
                    victim = max(self.running, key=self._victim_key)
                    preempt(victim)
                    if victim is req:
                        break
                else:
                    scheduled[req.request_id] = ScheduledRequest(req, n)
                    budget -= n

        run(decoding + prefilling)

        # waiting: admit in line order while there is budget, a slot and room; a head without a slot or room takes
        # them from running requests less important than itself. Once this step preempted anything, only a head
        # strictly more important than every request preempted so far goes on: after a block shortage the cache
        # is too tight for new work of the victims' rank, and an equal one would only trade places with its peer
        # step after step (the victim itself waits behind the head that displaced it, so it is not readmitted now)
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if preempted and req.params.priority >= min(v.params.priority for v in preempted):
                break
            hits = self.kv.match_prefix(req)
            n = min(req.num_tokens - len(hits) * self.kv.block_size, budget)
            # no slot: admit() is not even tried, it would take the blocks
            if len(self.running) >= self.max_num_seqs or not self.kv.admit(req, hits, n):
                victims = self._victims_for(req, hits, budget, scheduled)
                if not victims:
                    break
                for victim in victims:
                    preempt(victim)
                continue  # the budget may have grown by the victims' tokens: size the chunk again
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            req.admitted_seq = self._admissions
            self._admissions += 1
            self.running.append(req)
            scheduled[req.request_id] = ScheduledRequest(req, n)
            budget -= n

        if held and not any(s.num_tokens > 1 and s.request.params.priority < max(r.params.priority for r in held)
                            for s in scheduled.values()):
            run(held)  # the more important prefill did not get in: the held decodes go after all
        out = SchedulerOutput(preempted=preempted)
        # one-token chunks (decodes) first, shortest context first: the runner batches their attention in groups
        # of similar length
        out.scheduled = sorted(scheduled.values(),
                               key=lambda s: (s.num_tokens != 1, s.request.num_computed_tokens if s.num_tokens == 1
                                              else 0))
        out.num_decodes = sum(1 for s in out.scheduled if s.num_tokens == 1)
        for victim in preempted:  # its drafts followed tokens it will recompute
            victim.draft_token_ids = []
        return out

    def _victims_for(self, req: Request, hits: list[int], budget: int,
                     scheduled: dict[str, ScheduledRequest]) -> list[Request]:
        """The running requests to preempt so that waiting req gets a slot and KV room for its first chunk: the
        fewest, in victim order, among those strictly less important than req. Empty when no such prefix of
        them makes room: preempting would throw their work away while req waits anyway.

        A dry run of KVCacheManager.admit() on the state after freeing the victims (fits_after_freeing, in every KV
        cache group); a victim scheduled this step gives its tokens back to the budget, so req's first chunk may
        grow."""
        candidates = sorted((r for r in self.running if r.params.priority > req.params.priority),
                            key=self._victim_key, reverse=True)
        num_cached = len(hits) * self.kv.block_size
        for k, victim in enumerate(candidates, 1):
            if victim.request_id in scheduled:
                budget += scheduled[victim.request_id].num_tokens
            n = min(req.num_tokens - num_cached, budget)
            if len(self.running) - k < self.max_num_seqs and self.kv.fits_after_freeing(req, hits, n, candidates[:k]):
                return candidates[:k]
        return []
