"""A discrete-event simulation of workers serving a stream of requests (`inferd plan`).

Each worker runs our scheduler's policy, step by step: every running sequence that has its prompt decodes one token
(decode first), the rest of the step's token budget (`max_num_batched_tokens`) goes to prompt chunks in admission
order (chunked prefill), and waiting requests are admitted while there are fewer than `max_num_seqs` running and the
KV cache holds their prompt. A sequence that finds the KV cache full when it grows is preempted (the newest first)
and recomputed later, as the engine does. A step's duration comes from `StepModel`, which interpolates the step
times `inferd profile` measured. The gateway keeps one waiting line; a worker takes from it while it holds fewer
than `max_num_seqs + worker_queue_depth` requests, and a request goes to the least loaded worker (the router's
choice without prefix affinity). A request whose prompt and output together are more than the whole KV cache could
never run: the engine refuses it when it arrives (Engine.validate checks prompt + max_tokens against the pool, and
max_tokens is at least the output), so it is marked refused and takes no worker time.

Time only jumps: from one event (an arrival, a step's end, a worker ready, a fleet change, an autoscaler tick) to
the next. A run of steps that only decode, with nothing to admit, is taken in one jump (until the first sequence
finishes or the KV cache is full), cut short at the first step boundary after new work is sent to that worker: what
the step-by-step run would do, in one event instead of one per step, so a day of traffic takes seconds.

Tiers (each request has one: interactive, standard, batch; `WorkerConfig.tier_shares`, the `--tier-shares` of the
engine and the gateway, inferd/engine/tier_shares.py). With capacity shares:
- the engine gives a free seat (one of `max_num_seqs` running sequences) to `next_tier(running per tier, tiers with
  requests waiting in that worker)`, first come first served within a tier. When no seat is free, a waiting request
  of a tier that `may_reclaim` takes the seat of the newest running request of a tier that `may_lend` to it (the least
  important lender first), which is preempted and recomputed later, as a KV preemption is;
- a step's prompt chunks of a tier take at most max(floor(share x max_num_batched_tokens), 32) tokens while a more
  important tier has requests in that worker (decodes still go first);
- the gateway keeps one waiting line per tier (first come first served: the real one shares a tier between tenants).
  The next tier to dispatch is `next_tier(bound sequences per tier over the ready workers, tiers with waiters)`; a
  tier that no worker has room for is skipped and the next one tried. A worker of capacity C = max_num_seqs +
  worker_queue_depth has room for a tier when it holds fewer than C requests, or when that tier holds fewer than its
  own seats of C while another tier holds more than its own (the gateway's rule: the engine then reclaims).
Strict (`--tier-shares strict`): the engine serves tiers in priority order and a waiting request takes the seat of a
running one of a less important tier; prompt chunks are not capped; a worker holds up to C requests of a tier or a
more important one (the less important do not count against it), and the gateway dispatches in priority order.
A day of one tier is served as it was before tiers: first come first served. The run of decode steps in one jump
holds with tiers: it is only taken with nothing waiting in the worker, so no tier decision falls inside it.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ..config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_TIER,
    DEFAULT_WORKER_QUEUE_DEPTH,
    TIERS,
)
from ..engine.tier_shares import TierShares, tier_counts

DEFAULT_TIER_RANK = TIERS.index(DEFAULT_TIER)
# the fewest prompt tokens a step gives a tier held back by a more important one (the engine's floor: a small share
# of a small token budget still moves a prompt forward)
MIN_TIER_PROMPT_TOKENS = 32


class StepModel:
    """Step time as a function of the decode batch, its mean context and the step's prefill tokens, from the points
    of an `inferd profile` (profile.json).

    decode(B, c): piecewise linear in the batch B between the batches measured at each context, then in the context c
    between measured contexts (extrapolated linearly past the last ones). prefill(P): piecewise linear through
    (0, decode(1, c0)) and the measured prefill lengths, where c0 is the shortest measured context: a step always
    reads the weights once.
    A mixed step costs decode(B, c) plus what the prompt tokens add: measured, where the profile has mixed points
    (`inferd profile` times a decode batch B beside a P-token prompt chunk: the extra is that step less decode(B, c)
    at the same context), piecewise linear in P (from 0 at P = 0) and then in B; else estimated as
    prefill(P) - decode(1, c0).
    """

    def __init__(self, decode: dict[tuple[int, int], float], prefill: dict[int, float],
                 mixed: dict[tuple[int, int, int], float] | None = None):
        if not decode:
            raise ValueError("the profile has no decode points")
        self.contexts = sorted({c for _, c in decode})
        # per context, the batches measured there (a profile skips the largest batches where the KV cache is short)
        self.by_context = {c: sorted((b, t) for (b, cc), t in decode.items() if cc == c) for c in self.contexts}
        self._batch_xy = [([b for b, _ in points], [t for _, t in points]) for points in self.by_context.values()]
        # memos (the same arithmetic, done once): per batch, the step time at each measured context; per (batch,
        # prompt tokens), what the prompt tokens add; per prompt tokens, the prefill time
        self._rows: dict[int, list[float]] = {}
        self._extra: dict[tuple[int, int], float] = {}
        self._prefill: dict[int, float] = {}
        self.base = self.decode(1, self.contexts[0])
        lengths = sorted(prefill)
        self.prefill_x = [0] + lengths
        self.prefill_y = [self.base] + [prefill[n] for n in lengths]
        # mixed points: (batch, context, prompt tokens) -> step_s, kept as batch -> [(prompt tokens, extra s)]
        self.mixed: dict[int, list[tuple[int, float]]] = {}
        for (b, c, p), t in sorted((mixed or {}).items()):
            self.mixed.setdefault(b, [(0, 0.0)]).append((p, t - self.decode(b, c)))

    @classmethod
    def load(cls, path: str | Path) -> StepModel:
        data = json.loads(Path(path).read_text())
        decode, prefill, mixed = {}, {}, {}
        for p in data.get("points", []):
            if p.get("kind") == "decode":
                decode[(int(p["batch"]), int(p["context"]))] = float(p["step_s"])
            elif p.get("kind") == "prefill":
                # a prefill point: one sequence of `context` prompt tokens in one step
                prefill[int(p["context"]) * int(p.get("batch", 1))] = float(p["step_s"])
            elif p.get("kind") == "mixed":
                mixed[(int(p["batch"]), int(p["context"]), int(p["prefill_tokens"]))] = float(p["step_s"])
        return cls(decode, prefill, mixed)

    @staticmethod
    def _interp(xs: list[float], ys: list[float], x: float) -> float:
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)  # the segment, the last one past the end
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def decode(self, batch: int, context: float) -> float:
        if batch <= 0:
            return 0.0
        row = self._rows.get(batch)
        if row is None:
            row = self._rows[batch] = [self._interp(bs, ts, batch) for bs, ts in self._batch_xy]
        return max(self._interp(self.contexts, row, context), 1e-6)

    def step(self, batch: int, context: float, prefill_tokens: int) -> float:
        if prefill_tokens <= 0:
            return self.decode(batch, context)
        prefill = self._prefill.get(prefill_tokens)
        if prefill is None:
            prefill = self._prefill[prefill_tokens] = self._interp(self.prefill_x, self.prefill_y, prefill_tokens)
        if batch <= 0:
            return max(prefill, 1e-6)
        extra = self._extra.get((batch, prefill_tokens))
        if extra is None:
            extra = self._extra[(batch, prefill_tokens)] = self.extra(batch, prefill_tokens, prefill)
        return self.decode(batch, context) + extra

    def extra(self, batch: int, prefill_tokens: int, prefill_alone: float | None = None) -> float:
        """What prefill_tokens prompt tokens add to a step of `batch` decode rows."""
        if not self.mixed:
            alone = prefill_alone if prefill_alone is not None else \
                self._interp(self.prefill_x, self.prefill_y, prefill_tokens)
            return max(0.0, alone - self.base)
        batches = sorted(self.mixed)
        per_batch = [self._interp([p for p, _ in self.mixed[b]], [e for _, e in self.mixed[b]], prefill_tokens)
                     for b in batches]
        return max(0.0, self._interp(batches, per_batch, batch))


@dataclass
class WorkerConfig:
    """What a worker runs with (the engine's and gateway's settings of the same names)."""
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    worker_queue_depth: int = DEFAULT_WORKER_QUEUE_DEPTH
    kv_tokens: int = 2912 * 16  # the default model's pool under the default --kv-cache-bytes (2912 blocks of 16)
    tier_shares: TierShares = field(default_factory=TierShares.parse)  # --tier-shares (default: config's)


@dataclass(eq=False)
class Req:
    t: float  # arrival
    prompt: int
    output: int
    need: int = 0  # tokens to prefill before the next token: the prompt (plus what a preemption threw away)
    prefilled: int = 0
    generated: int = 0
    first_token: float | None = None
    done: float | None = None
    kv: int = 0  # KV cache tokens it holds on its worker
    refused: bool = False  # larger than the KV cache: the engine refuses it (no first token, never done)
    tier: int = DEFAULT_TIER_RANK  # its tier's rank in config.TIERS (0: interactive, the most important)

    def __post_init__(self):
        self.need = self.prompt

    def fits(self, kv_tokens: int) -> bool:
        """Whether the engine takes it: its prompt and every output token fit the whole KV cache."""
        return self.prompt + self.output <= kv_tokens

    @property
    def ttft(self) -> float:
        return self.first_token - self.t

    @property
    def tpot(self) -> float | None:
        return (self.done - self.first_token) / (self.output - 1) if self.output > 1 else None

    @property
    def e2e(self) -> float:
        return self.done - self.t


@dataclass(eq=False)
class Worker:
    wid: int
    launched: float  # when it was started (billed from here)
    ready: float  # when it takes work
    running: list = field(default_factory=list)  # in admission order
    waiting: list = field(default_factory=lambda: [deque() for _ in TIERS])  # per tier rank, in arrival order
    bound: list = field(default_factory=lambda: [0] * len(TIERS))  # requests it holds per tier (running + waiting)
    load: int = 0  # requests it holds, all tiers (the sum of bound, kept: the dispatch reads it at every event)
    busy: bool = False
    retiring: bool = False
    stopped: float | None = None
    kv_used: int = 0
    steps: int = 0
    busy_s: float = 0.0  # time spent in steps
    preemptions: int = 0
    step_token: int = 0  # the step in flight (a STEP_END with an older token was cut short: ignored)
    jump: tuple | None = None  # a run of decode steps in flight: (start, mean step_s, steps, decoding, context)

    def kv_at(self, now: float) -> int:
        """KV tokens held at `now` (kv_used is brought up to date at a step's end: within a run of decode steps,
        add the tokens of the steps already done)."""
        if self.jump is None:
            return self.kv_used
        start, dt, k, decoding, _ = self.jump
        return self.kv_used + len(decoding) * min(k, max(0, int((now - start) / dt)))


ARRIVAL, STEP_END, READY, TICK, FLEET = range(5)


class Simulation:
    """Requests (sorted by arrival) against a fleet. The fleet is set with `set_fleet` (from `on_tick`, called every
    `tick_s` with the simulation, or from a schedule of (time, workers) changes)."""

    def __init__(self, model: StepModel, config: WorkerConfig, requests: list[Req], workers: int = 1,
                 start_delay_s: float = 0.0, schedule: list[tuple[float, int]] = (), on_tick=None,
                 tick_s: float = 1.0, jumps: bool = True):
        self.model, self.config = model, config
        self.jumps = jumps  # False: every step its own event (slow; the tests compare the two)
        self.requests = requests
        self.start_delay_s = start_delay_s
        self.workers: list[Worker] = []
        self.lines: list[deque[Req]] = [deque() for _ in TIERS]  # the gateway's waiting line of each tier
        self._tiers_seen: set[int] = set()  # one tier all along: the tier rules cannot apply (the fast paths)
        self.now = 0.0
        self._steps: list = []  # (time, seq, kind, payload) of step ends
        self._control: list = []  # the same, of everything else (a worker ready, a fleet change, a tick)
        self._seq = 0
        self.on_tick, self.tick_s = on_tick, tick_s
        self._next_arrival = 0
        self.fleet_log: list[tuple[float, int]] = []  # (time, workers launched and not stopped)
        self.refused: list[Req] = []  # requests larger than the KV cache, refused on arrival
        self.set_fleet(workers, delay=0.0)
        for t, n in schedule:
            self._push(t, FLEET, n)
        if on_tick is not None:
            self._push(0.0, TICK, None)

    # ---- the fleet -----------------------------------------------------------------------------------------------
    @property
    def live(self) -> list[Worker]:
        """Workers started and not retiring (ready or still loading)."""
        return [w for w in self.workers if not w.retiring]

    def set_fleet(self, n: int, delay: float | None = None) -> None:
        live = self.live
        delay = self.start_delay_s if delay is None else delay
        for _ in range(n - len(live)):
            w = Worker(len(self.workers), self.now, self.now + delay)
            self.workers.append(w)
            self._push(w.ready, READY, w)
        if n < len(live):
            # those still loading go first, then the least loaded; a retiring worker finishes what it holds
            order = sorted(live, key=lambda w: (w.ready <= self.now, w.load, -w.wid))
            for w in order[:len(live) - n]:
                w.retiring = True
                self._maybe_stop(w)
        self._log_fleet()

    def _log_fleet(self) -> None:
        count = sum(1 for w in self.workers if w.stopped is None)
        if not self.fleet_log or self.fleet_log[-1][1] != count:
            self.fleet_log.append((self.now, count))

    def _maybe_stop(self, w: Worker) -> None:
        if w.retiring and w.stopped is None and not w.busy and not w.load:
            w.stopped = self.now
            self._log_fleet()

    def worker_seconds(self, end: float) -> float:
        return sum((w.stopped if w.stopped is not None else end) - w.launched for w in self.workers)

    # ---- events ----------------------------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload) -> None:
        self._seq += 1
        heapq.heappush(self._steps if kind == STEP_END else self._control, (t, self._seq, kind, payload))

    def run(self, until: float | None = None) -> None:
        """Until every request is done (and, with `until`, no earlier than that time)."""
        reqs = self.requests
        while True:
            arrival = reqs[self._next_arrival].t if self._next_arrival < len(reqs) else math.inf
            step = self._steps[0][0] if self._steps else math.inf
            control = self._control[0][0] if self._control else math.inf
            event = min(step, control)
            if arrival <= event:
                if arrival == math.inf:
                    return
                self.now = arrival
                r = reqs[self._next_arrival]
                self._next_arrival += 1
                if not r.fits(self.config.kv_tokens):
                    r.refused = True
                    self.refused.append(r)
                    continue
                self.lines[r.tier].append(r)
                self._tiers_seen.add(r.tier)
                self._dispatch()
                continue
            t, _, kind, payload = heapq.heappop(self._steps if step <= control else self._control)
            if kind == STEP_END and payload[-1] != payload[0].step_token:
                continue  # a jump cut short: its end was pushed again, earlier
            self.now = t
            if kind == STEP_END:
                self._step_end(*payload[:-1])
            elif kind == READY:
                if payload.stopped is None:
                    self._dispatch()
            elif kind == FLEET:
                self.set_fleet(payload, delay=0.0)
                self._dispatch()
            elif kind == TICK:
                finished = self._next_arrival >= len(reqs) and not any(self.lines) and \
                    not any(w.load for w in self.workers) and (until is None or t >= until)
                if not finished:
                    self.on_tick(self)
                    self._dispatch()
                    self._push(t + self.tick_s, TICK, None)

    def queued(self) -> list[Req]:
        """The requests waiting in the gateway, all tiers."""
        return [r for line in self.lines for r in line]

    def _has_room(self, w: Worker, tier: int, cap: int) -> bool:
        """Whether the gateway may send a request of `tier` to w (capacity cap = max_num_seqs + worker_queue_depth)."""
        fractions = self.config.tier_shares.fractions
        if fractions is None:  # strict: only this tier and the more important ones count against it
            return sum(w.bound[:tier + 1]) < cap
        shares = self.config.tier_shares  # as the gateway: over-filled only where another tier holds more than its own
        return w.load < cap or (shares.may_reclaim(w.bound, tier, cap) and shares.lendable(w.bound, tier, cap) >= 1)

    def _dispatch(self) -> None:
        lines = self.lines
        ready = [w for w in self.workers if not w.retiring and w.ready <= self.now and w.stopped is None] \
            if any(lines) else []
        cap = self.config.max_num_seqs + self.config.worker_queue_depth
        shares = self.config.tier_shares
        if ready and len(self._tiers_seen) == 1:  # one tier all along: to the least loaded worker while it has room
            (t,) = self._tiers_seen
            line = lines[t]
            while line:
                w = min(ready, key=_by_load)
                if w.load >= cap:
                    break
                w.waiting[t].append(line.popleft())
                w.bound[t] += 1
                w.load += 1
                if w.jump is not None:
                    self._cut_jump(w)
            ready = []
        while ready:
            tiers = [t for t, line in enumerate(lines) if line]
            if not tiers:
                break
            if len(tiers) > 1:
                tiers = shares.tier_order([sum(w.bound[t] for w in ready) for t in range(len(TIERS))], tiers,
                                          cap * len(ready))
            w = min(ready, key=_by_load)
            if w.load < cap:  # room for every tier: the next in order takes it
                t = tiers[0]
            else:
                for t in tiers:  # a tier no worker has room for is skipped: the next one is tried
                    room = [w for w in ready if self._has_room(w, t, cap)]
                    if room:
                        w = min(room, key=_by_load)
                        break
                else:
                    break
            w.waiting[t].append(lines[t].popleft())
            w.bound[t] += 1
            w.load += 1
            if w.jump is not None:
                self._cut_jump(w)
        for w in self.workers:
            if not w.busy and w.stopped is None and w.load:
                self._step(w)

    # ---- a worker's step -------------------------------------------------------------------------------------------
    def _step(self, w: Worker) -> None:
        c = self.config
        budget = c.max_num_batched_tokens
        shares = c.tier_shares
        decoding = [r for r in w.running if r.prefilled >= r.need]
        # the KV cache must hold one more token per decoding sequence: preempt the newest until it does
        while decoding and w.kv_used + len(decoding) > c.kv_tokens:
            self._preempt(w, w.running[-1])
            decoding = [r for r in w.running if r.prefilled >= r.need]
        waiting = w.waiting
        several = len(TIERS) - w.bound.count(0) > 1  # more than one tier in this worker: the tier rules apply
        if several and len(w.running) >= c.max_num_seqs and any(waiting):
            self._reclaim(w)
            decoding = [r for r in w.running if r.prefilled >= r.need]
        budget -= len(decoding)
        # each tier's prompt tokens this step: capped at its share while a more important tier has requests here
        prompt_left = [budget] * len(TIERS) if several else []
        if several and shares.fractions is not None:
            for t, f in enumerate(shares.fractions):
                if any(w.bound[:t]):
                    prompt_left[t] = max(int(f * c.max_num_batched_tokens), MIN_TIER_PROMPT_TOKENS)
        chunks = []
        if not several:  # one tier here: prompt chunks in admission order, admission first come first served
            for r in w.running:
                if r.prefilled < r.need and budget > 0:
                    n = min(r.need - r.prefilled, budget)
                    chunks.append((r, n))
                    budget -= n
            for line in waiting:  # the one tier waiting here, if any
                if line:
                    break
            while line and budget > 0 and len(w.running) < c.max_num_seqs \
                    and w.kv_used + line[0].need + 1 <= c.kv_tokens:
                r = line.popleft()
                w.running.append(r)
                w.kv_used += r.need
                r.kv = r.need
                n = min(r.need, budget)
                chunks.append((r, n))
                budget -= n
        for r in w.running if several else ():
            if r.prefilled < r.need and budget > 0:
                n = min(r.need - r.prefilled, budget, prompt_left[r.tier])
                if n > 0:
                    chunks.append((r, n))
                    budget -= n
                    prompt_left[r.tier] -= n
        while several and budget > 0 and len(w.running) < c.max_num_seqs:
            tiers = [t for t, q in enumerate(waiting) if q and prompt_left[t] > 0]
            if not tiers:
                break
            t = tiers[0] if len(tiers) == 1 else shares.next_tier(tier_counts(q.tier for q in w.running), tiers,
                                                                     c.max_num_seqs)
            if w.kv_used + waiting[t][0].need + 1 > c.kv_tokens:
                break  # the next one in order waits for the KV cache
            r = waiting[t].popleft()
            self._admit(w, r)
            n = min(r.need, budget, prompt_left[t])
            chunks.append((r, n))
            budget -= n
            prompt_left[t] -= n
        if not decoding and not chunks:
            return  # nothing fits now (every request fits an empty cache: run() refuses the others)
        prefill = sum(n for _, n in chunks)
        context = sum(r.need + r.generated for r in decoding) / len(decoding) if decoding else 0.0
        dt = self.model.step(len(decoding), context, prefill)
        k = 1
        if self.jumps and not chunks and not any(waiting):
            # only decodes and nothing to admit: the steps up to the first sequence's end (or a full KV cache) in one
            # event; k steps take k times the step time at their mean context (exact while the step time is linear
            # in the context, as it is between the profile's points)
            left = min(r.output - r.generated for r in decoding)
            room = (c.kv_tokens - w.kv_used) // len(decoding)
            k = max(1, min(left, room))
            if k > 1:
                dt = self.model.decode(len(decoding), context + (k - 1) / 2)
        w.busy = True
        w.steps += k
        w.busy_s += k * dt
        w.step_token += 1
        w.jump = (self.now, dt, k, decoding, context) if k > 1 else None
        self._push(self.now + k * dt, STEP_END, (w, decoding, chunks, k, w.step_token))

    @staticmethod
    def _admit(w: Worker, r: Req) -> None:
        w.running.append(r)
        w.kv_used += r.need
        r.kv = r.need

    def _preempt(self, w: Worker, victim: Req) -> None:
        """Back to the front of its tier's waiting line, its KV cache freed: recomputed when it runs again."""
        w.running.remove(victim)
        w.kv_used -= victim.kv
        victim.kv = 0
        victim.need, victim.prefilled = victim.prompt + victim.generated, 0
        w.waiting[victim.tier].appendleft(victim)
        w.preemptions += 1

    def _reclaim(self, w: Worker) -> None:
        """No seat is free: a waiting tier that may reclaim takes the seat of the newest running request of a tier
        that may lend to it (the least important lender first), as long as the KV cache holds it. Each move brings
        both tiers closer to their nominal seats (strict: moves a seat to a more important tier), so it ends."""
        c, shares = self.config, self.config.tier_shares
        held = tier_counts(r.tier for r in w.running)
        moved = True
        while moved:
            moved = False
            for t in shares.tier_order(held, [t for t, q in enumerate(w.waiting) if q], c.max_num_seqs):
                if not shares.may_reclaim(held, t, c.max_num_seqs):
                    continue
                taker = w.waiting[t][0]
                for v in reversed(range(len(TIERS))):
                    if not held[v] or not shares.may_lend(held, v, c.max_num_seqs, t):
                        continue
                    victim = next(r for r in reversed(w.running) if r.tier == v)
                    if w.kv_used - victim.kv + taker.need + 1 > c.kv_tokens:
                        continue
                    self._preempt(w, victim)
                    self._admit(w, w.waiting[t].popleft())
                    held[v] -= 1
                    held[t] += 1
                    moved = True
                    break
                if moved:
                    break

    def _cut_jump(self, w: Worker) -> None:
        """Work was sent to a worker in a run of decode steps: the run ends at the first step boundary from now
        (where a step-by-step run would admit it)."""
        start, dt, k, decoding, context = w.jump
        w.jump = None

        def took(n: int) -> float:  # the first n steps of the run
            return n * self.model.decode(len(decoding), context + (n - 1) / 2)

        n = min(k, max(1, math.ceil((self.now - start) / dt - 1e-9)))
        while n > 1 and start + took(n - 1) >= self.now:
            n -= 1
        while n < k and start + took(n) < self.now:
            n += 1
        if n >= k:
            return
        w.steps -= k - n
        w.busy_s -= k * dt - took(n)
        w.step_token += 1
        self._push(start + took(n), STEP_END, (w, decoding, [], n, w.step_token))

    def _step_end(self, w: Worker, decoding: list[Req], chunks: list, k: int) -> None:
        w.busy = False
        w.jump = None
        for r in decoding:
            if r.prefilled < r.need:  # preempted meanwhile (cannot happen inside a step; kept for safety)
                continue
            r.generated += k
            r.kv += k
            w.kv_used += k
        for r, n in chunks:
            r.prefilled += n
            if r.prefilled >= r.need:  # the prompt is in: this step also sampled its next token
                r.generated += 1
                r.kv += 1
                w.kv_used += 1
                if r.first_token is None:
                    r.first_token = self.now
        for r in [r for r in w.running if r.generated >= r.output]:
            r.done = self.now
            w.running.remove(r)
            w.bound[r.tier] -= 1
            w.load -= 1
            w.kv_used -= r.kv
            r.kv = 0
        self._maybe_stop(w)
        self._dispatch()


def _by_load(w: Worker) -> tuple[int, int]:
    """The router's order: the least loaded worker first."""
    return w.load, w.wid
