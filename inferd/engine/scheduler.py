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

That is `--tier-shares strict`. By default the tiers (a request's priority is its tier rank) share the seats
(running sequences) by inferd/engine/tier_shares.py: a free seat goes to the tier furthest below its own seats, then
to the most important tier that waits; a tier below its own seats takes one back from a tier that borrowed (the same
preemption by recompute); a tier whose head cannot be placed does not stop the others. Step tokens are shared too:
while a more important tier has work (or had some within TIER_ACTIVE_WINDOW_S), a tier's prompt tokens per step are
held to its share of the budget (at least lower_tier_prefill_tokens), and the rows a tier holds beyond its own seats
sit out the step of a more important tier's prefill, so an arriving interactive request never waits behind a long
step of borrowed work.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import DEFAULT_LOWER_TIER_PREFILL_TOKENS, TIER_ACTIVE_WINDOW_S, TIERS
from .kv_cache import KVCacheManager
from .request import FinishReason, Request, RequestStatus
from .tier_shares import TierShares, tier_counts, tier_rank


def tier_of(r: Request) -> int:
    """The request's tier rank (its priority, clamped to the tiers there are)."""
    return tier_rank(r.params.priority)


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

    @property
    def num_prompt_logits(self) -> int:
        """Rows of this step, before the sampled one, whose final hidden states give prompt logprobs: every row of
        a prefill chunk of a request that asks for them, while its chunk covers positions before its prompt's
        last (prompt_logprobs.py)."""
        r = self.request
        if not r.wants_prompt_logprobs or r.num_computed_tokens >= r.num_prompt_tokens - 1:
            return 0
        return self.num_tokens - self.num_logits


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
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 tier_shares: TierShares | None = None,
                 lower_tier_prefill_tokens: int = DEFAULT_LOWER_TIER_PREFILL_TOKENS,
                 clock: Callable[[], float] = time.monotonic):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs}) "
                "so that every running sequence can decode in every step")
        self.kv = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.shares = tier_shares if tier_shares is not None else TierShares.parse()
        self.lower_tier_prefill_tokens = lower_tier_prefill_tokens
        self.clock = clock
        self.waiting: list[Request] = []  # sorted by (priority, arrival_seq)
        self.running: list[Request] = []  # in admission order
        self._admissions = 0
        self.num_preemptions = 0
        self.preemptions_by_tier = [0] * len(TIERS)
        self._last_active = [-math.inf] * len(TIERS)  # per tier: when it last had a request here (clock)
        # admission_gate(request, running) -> may it run now (the LoRA manager's slot for its adapter: engine/lora.py);
        # a refused request waits in its place and the line behind it goes on
        self.admission_gate: Callable[[Request, list[Request]], bool] | None = None

    def seats_by_tier(self) -> list[int]:
        """Running sequences per tier."""
        return tier_counts(tier_of(r) for r in self.running)

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
        if self.shares.strict:
            return self._schedule_strict()
        return self._schedule_shared()

    def _schedule_strict(self) -> SchedulerOutput:
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
            self.preemptions_by_tier[tier_of(victim)] += 1
            bisect.insort(self.waiting, victim, key=self._line_key)
            preempted.append(victim)

        # running: decodes first, then continuing prefills, each in admission order
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        # speculative drafts ride on a decode only with budget beyond one token for every decode (never at the
        # cost of another sequence's decode) and only where the KV room is there without preempting anyone
        budget = self._schedule_drafts(decoding, budget, scheduled)
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
        i = 0
        while i < len(self.waiting) and budget > 0:
            req = self.waiting[i]
            if preempted and req.params.priority >= min(v.params.priority for v in preempted):
                break
            if self.admission_gate is not None and not self.admission_gate(req, self.running):
                i += 1  # its LoRA adapter has no slot now: it waits, the requests behind it go on
                continue
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
            self.waiting.pop(i)
            req.status = RequestStatus.RUNNING
            req.admitted_seq = self._admissions
            self._admissions += 1
            self.running.append(req)
            scheduled[req.request_id] = ScheduledRequest(req, n)
            budget -= n

        if held and not any(s.num_tokens > 1 and s.request.params.priority < max(r.params.priority for r in held)
                            for s in scheduled.values()):
            run(held)  # the more important prefill did not get in: the held decodes go after all
        return self._output(scheduled, preempted)

    def _schedule_drafts(self, decoding: list[Request], budget: int, scheduled: dict[str, ScheduledRequest]) -> int:
        """Schedules the decodes that carry drafts (decode + drafts); returns the budget left."""
        draft_budget = budget - len(decoding)
        for req in decoding:
            if not req.draft_token_ids or req.status != RequestStatus.RUNNING or draft_budget <= 0:
                continue
            k = min(len(req.draft_token_ids), draft_budget)
            if self.kv.allocate(req, 1 + k):
                scheduled[req.request_id] = ScheduledRequest(req, 1 + k, k)
                budget -= 1 + k
                draft_budget -= k
        return budget

    def _schedule_shared(self) -> SchedulerOutput:
        """One step under capacity shares (the module's docstring). Membership is by identity (id sets): a
        Request compares by value, and this runs every step over up to max_num_seqs + the waiting line."""
        shares, seats = self.shares, self.max_num_seqs
        assert shares.fractions is not None
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[Request] = []
        held = [0] * len(TIERS)
        for r in self.running:
            held[tier_of(r)] += 1
        line: list[list[Request]] = [[] for _ in TIERS]  # the waiting line per tier, in line order
        for r in self.waiting:
            line[tier_of(r)].append(r)
        now = self.clock()
        for t in range(len(TIERS)):
            if held[t] or line[t]:
                self._last_active[t] = now
        # prompt tokens each tier may still compute this step: its share of the budget while a more important tier
        # is active (has work, or had within the window: it may arrive), else no bound
        active = [now - t <= TIER_ACTIVE_WINDOW_S for t in self._last_active]
        prefill_left = [budget] * len(TIERS)
        for t, fraction in enumerate(shares.fractions):
            if any(active[:t]):
                prefill_left[t] = max(math.floor(fraction * budget), self.lower_tier_prefill_tokens)
        victim_tiers: set[int] = set()  # tiers of the requests preempted this step
        shortage = False  # a running request found no block this step

        def preempt(victim: Request) -> None:
            nonlocal budget
            if victim.request_id in scheduled:
                budget += scheduled.pop(victim.request_id).num_tokens
            self.running = [r for r in self.running if r is not victim]
            self.kv.free(victim)
            victim.status = RequestStatus.PREEMPTED
            victim.num_preemptions += 1
            self.num_preemptions += 1
            self.preemptions_by_tier[tier_of(victim)] += 1
            held[tier_of(victim)] -= 1
            victim_tiers.add(tier_of(victim))
            bisect.insort(self.waiting, victim, key=self._line_key)
            preempted.append(victim)

        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        budget = self._schedule_drafts(decoding, budget, scheduled)
        # the rows a tier holds beyond its own seats (its latest admitted) sit out the step of a more important
        # tier's prefill (running with prompt left, or waiting), and run after all if that prefill does not get in
        pending = [tier_of(r) for r in prefilling] + [t for t in range(len(TIERS)) if line[t]]
        urgent = min(pending, default=None)
        held_rows: list[Request] = []
        if urgent is not None:
            own = shares.own_seats(seats)
            for t in range(urgent + 1, len(TIERS)):
                if held[t] > own[t]:
                    rows = sorted((r for r in self.running if tier_of(r) == t), key=lambda r: r.admitted_seq)
                    held_rows += [r for r in rows[own[t]:] if r.request_id not in scheduled]
        if held_rows:
            out_ids = {id(r) for r in held_rows}
            decoding = [r for r in decoding if id(r) not in out_ids]
            prefilling = [r for r in prefilling if id(r) not in out_ids]

        def run(reqs: list[Request]) -> None:
            nonlocal budget, shortage
            for req in reqs:
                if req.status != RequestStatus.RUNNING or budget == 0 or req.request_id in scheduled:
                    continue
                t = tier_of(req)
                left = req.num_tokens - req.num_computed_tokens
                n = min(left, budget) if left == 1 else min(left, budget, prefill_left[t])
                if n <= 0:
                    continue
                while not self.kv.allocate(req, n):
                    # a block shortage: the victim is the newest of a tier that holds more than its own seats,
                    # least important first; failing that, as strict
                    victim = max(self.running, key=lambda r: (shares.may_lend(held, tier_of(r), seats, t),
                                                              r.params.priority, r.admitted_seq))
                    shortage = True
                    preempt(victim)
                    if victim is req:
                        break
                else:
                    scheduled[req.request_id] = ScheduledRequest(req, n)
                    budget -= n
                    if left > 1:
                        prefill_left[t] -= n

        run(decoding + prefilling)

        # waiting: the next seat goes to the tier the shares name (FCFS inside a tier); a tier whose head gets no
        # seat, no KV room or no prompt tokens this step is passed over, the others go on. A tier preempted this
        # step is not admitted again in it (it would trade places), and after a block shortage only tiers below
        # their own seats are
        blocked: set[int] = set()
        next_in_line = [0] * len(TIERS)
        admitted: set[int] = set()
        while budget > 0:
            t = shares.next_tier(held, [u for u in range(len(TIERS))
                                        if next_in_line[u] < len(line[u]) and u not in blocked], seats)
            if t is None:
                break
            req = line[t][next_in_line[t]]
            if prefill_left[t] <= 0 or t in victim_tiers or (shortage and not shares.may_reclaim(held, t, seats)):
                blocked.add(t)
                continue
            if self.admission_gate is not None and not self.admission_gate(req, self.running):
                next_in_line[t] += 1  # its LoRA adapter has no slot now: it waits, the rest of its tier goes on
                continue
            hits = self.kv.match_prefix(req)
            n = min(req.num_tokens - len(hits) * self.kv.block_size, budget, prefill_left[t])
            if len(self.running) >= seats or not self.kv.admit(req, hits, n):
                victims = self._victims_to_reclaim(req, hits, budget, scheduled, held)
                if not victims:
                    blocked.add(t)
                    continue
                for victim in victims:
                    preempt(victim)
                continue  # the budget may have grown by the victims' tokens: size the chunk again
            next_in_line[t] += 1
            admitted.add(id(req))
            req.status = RequestStatus.RUNNING
            req.admitted_seq = self._admissions
            self._admissions += 1
            self.running.append(req)
            held[t] += 1
            scheduled[req.request_id] = ScheduledRequest(req, n)
            budget -= n
            prefill_left[t] -= n
        if admitted:
            self.waiting = [r for r in self.waiting if id(r) not in admitted]

        if held_rows and not any(s.num_tokens > 1 and tier_of(s.request) < max(tier_of(r) for r in held_rows)
                                 for s in scheduled.values()):
            run(held_rows)  # no more important prefill got in: the held rows go after all
        return self._output(scheduled, preempted)

    def _victims_to_reclaim(self, req: Request, hits: list[int], budget: int,
                            scheduled: dict[str, ScheduledRequest], held: list[int]) -> list[Request]:
        """Under shares: the running requests to preempt so that waiting req gets a seat and KV room for its first
        chunk, taken from tiers that hold more than their own (least important first, newest first), and only while
        req's tier stays within its own. What is short decides what is counted: seats when every seat is taken,
        else KV blocks (a tier's share of the pool, so that a few long sequences of one tier cannot hold the whole
        cache against a tier below its share). Empty when that cannot make room."""
        shares, seats, t = self.shares, self.max_num_seqs, tier_of(req)
        assert shares.fractions is not None
        seat_short = len(self.running) >= seats
        if seat_short:
            if not shares.may_reclaim(held, t, seats):
                return []
            after = list(held)
        else:
            pool = self.kv.pools[0].num_blocks
            after = [0] * len(TIERS)
            for r in self.running:
                after[tier_of(r)] += len(r.block_ids)
            if after[t] >= shares.fractions[t] * pool:
                return []
        chosen: list[Request] = []
        num_cached = len(hits) * self.kv.block_size

        def lends(r: Request) -> bool:
            v = tier_of(r)
            if seat_short:
                return shares.may_lend(after, v, seats, t)
            return v != t and after[v] - len(r.block_ids) >= shares.fractions[v] * pool

        chosen_ids: set[int] = set()
        if not any(v != t and (after[v] > 0 if not seat_short else shares.may_lend(after, v, seats, t))
                   for v in range(len(TIERS))):
            return []  # no tier can lend: spare the scan of the running requests
        while True:
            lenders = [r for r in self.running if id(r) not in chosen_ids and lends(r)]
            if not lenders:
                return []
            victim = max(lenders, key=lambda r: (tier_of(r), r.admitted_seq))
            chosen.append(victim)
            chosen_ids.add(id(victim))
            after[tier_of(victim)] -= 1 if seat_short else len(victim.block_ids)
            if victim.request_id in scheduled:
                budget += scheduled[victim.request_id].num_tokens
            n = min(req.num_tokens - num_cached, budget)
            if len(self.running) - len(chosen) < seats and self.kv.fits_after_freeing(req, hits, n, chosen):
                return chosen

    @staticmethod
    def _output(scheduled: dict[str, ScheduledRequest], preempted: list[Request]) -> SchedulerOutput:
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
