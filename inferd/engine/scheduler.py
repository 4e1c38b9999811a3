"""Scheduler: decides each step's batch under one token budget.

Order of a step: every running sequence that is decoding gets its one token first, then running prefills continue
in chunks, then waiting requests are admitted (most important priority first, FCFS inside a priority) while budget,
sequence slots and KV blocks last. The output is, as in vLLM v1, just how many tokens each request computes this
step; whether a request samples follows from whether the step reaches the end of its tokens. When a running
request cannot get a block, the least important (highest priority value), most recently admitted running request is
preempted by recompute: its blocks are freed and it waits again at its original place in line.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .kv_cache import KVCacheManager
from .request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # computed this step, starting at request.num_computed_tokens

    @property
    def samples(self) -> bool:
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


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
        for req in decoding + prefilling:
            if req.status != RequestStatus.RUNNING or budget == 0:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, n):
                victim = max(self.running, key=lambda r: (r.params.priority, r.admitted_seq))
                preempt(victim)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = ScheduledRequest(req, n)
                budget -= n

        # waiting: admit in line order while there is budget, a slot and room
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits = self.kv.match_prefix(req)
            n = min(req.num_tokens - len(hits) * self.kv.block_size, budget)
            if not self.kv.admit(req, hits, n):
                break
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            req.admitted_seq = self._admissions
            self._admissions += 1
            self.running.append(req)
            scheduled[req.request_id] = ScheduledRequest(req, n)
            budget -= n

        out = SchedulerOutput(preempted=preempted)
        # one-token chunks (decodes) first, shortest context first: the runner batches their attention in groups
        # of similar length
        out.scheduled = sorted(scheduled.values(),
                               key=lambda s: (s.num_tokens != 1, s.request.num_computed_tokens if s.num_tokens == 1
                                              else 0))
        out.num_decodes = sum(1 for s in out.scheduled if s.num_tokens == 1)
        return out
