"""Capacity shares between tiers (inferd/engine/tier_shares.py) in the engine's scheduler: the rule itself, each
tier's share of generated tokens with every tier backlogged, lending and taking back, the prompt-token cap on lower
tiers, borrowed rows sitting out a more important prefill, and on the micro model: preemption across tiers leaks
nothing and the preempted stream completes with the tokens of its run alone."""

from __future__ import annotations

import itertools

import pytest

from inferd.config import TIERS
from inferd.engine import KVCacheManager, Request, SamplingParams
from inferd.engine.request import FinishReason, RequestStatus
from inferd.engine.scheduler import Scheduler, tier_of
from inferd.engine.tier_shares import TierShares
from tests.parity import assert_same_output

SHARES = TierShares.parse("interactive=70,standard=25,batch=5")


# ---- the rule -------------------------------------------------------------------------------------------------
def test_parse_normalises_and_names_what_is_wrong():
    assert SHARES.fractions == pytest.approx((0.7, 0.25, 0.05))
    assert str(TierShares.parse("batch=1, interactive=3")) == "interactive=75,standard=0,batch=25"
    assert TierShares.parse("STRICT").strict and str(TierShares.parse("strict")) == "strict"
    for bad, words in [("interactive=70,premium=30", "premium"), ("interactive=x", "must be a number"),
                       ("interactive=-1", ">= 0"), ("interactive=0", "above 0"), ("interactive", "strict"),
                       ("batch=1,batch=2", "twice"), ("interactive=inf", "finite")]:
        with pytest.raises(ValueError, match=words):
            TierShares.parse(bad)


def fill(shares: TierShares, seats: int, tiers: list[int]) -> list[int]:
    held = [0] * len(TIERS)
    for _ in range(seats):
        held[shares.next_tier(held, tiers, seats)] += 1
    return held


def test_seats_follow_the_shares_and_lent_seats_go_to_the_most_important():
    assert SHARES.own_seats(20) == (14, 5, 1) and SHARES.own_seats(64) == (45, 16, 4)
    assert fill(SHARES, 20, [0, 1, 2]) == [14, 5, 1]
    assert fill(SHARES, 20, [0, 2]) == [19, 0, 1]  # standard's idle share goes to interactive, batch keeps its own
    assert fill(SHARES, 20, [1, 2]) == [0, 19, 1]
    assert fill(SHARES, 20, [2]) == [0, 0, 20]  # alone, a tier takes everything
    assert fill(SHARES, 8, [0, 1, 2])[2] == 1  # a share under one seat still has one: no tier starves
    assert fill(TierShares(None), 20, [0, 1, 2]) == [20, 0, 0]  # strict


def test_a_seat_taken_back_is_never_taken_back_again():
    """For every state of a few seats: after a reclaim move (taker within its own seats, lender keeping its own),
    the reverse move is not allowed, so two tiers cannot trade one seat step after step."""
    for seats in (4, 8, 20):
        for held in itertools.product(range(seats + 1), repeat=3):
            if sum(held) != seats:
                continue
            for taker, lender in itertools.permutations(range(3), 2):
                if SHARES.may_reclaim(held, taker, seats) and SHARES.may_lend(held, lender, seats, taker):
                    after = list(held)
                    after[taker] += 1
                    after[lender] -= 1
                    assert not (SHARES.may_reclaim(after, lender, seats)
                                and SHARES.may_lend(after, taker, seats, lender)), (seats, held, taker, lender)


# ---- the scheduler without a model ----------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Backlog:
    """A scheduler driven without a model: every step computes the scheduled tokens and samples a token for the
    requests that reach the end of theirs; a request ends at max_tokens. Each backlogged tier keeps `depth` requests
    waiting or running (a new one arrives as one ends). Counts generated tokens per tier."""

    def __init__(self, shares: TierShares, seats: int = 20, budget: int = 64, blocks: int = 512,
                 prompt_len: int = 6, max_tokens: int = 12):
        self.clock = Clock()
        self.kv = KVCacheManager(num_blocks=blocks, block_size=4, enable_prefix_caching=False)
        self.sched = Scheduler(self.kv, seats, budget, shares, clock=self.clock)
        self.prompt_len, self.max_tokens = prompt_len, max_tokens
        self.depth = [0] * len(TIERS)
        self.generated = [0] * len(TIERS)
        self.open: list[list[Request]] = [[] for _ in TIERS]
        self.ids = itertools.count()
        self.last = None

    def add(self, tier: int, prompt_len: int | None = None) -> Request:
        i = next(self.ids)
        r = Request(f"r{i}", [(i * 7 + j) % 400 + 3 for j in range(prompt_len or self.prompt_len)],
                    SamplingParams(max_tokens=self.max_tokens, priority=tier, ignore_eos=True), arrival_seq=i)
        self.sched.add(r)
        self.open[tier].append(r)
        return r

    def backlog(self, tier: int, depth: int) -> None:
        self.depth[tier] = depth
        self.top_up()

    def top_up(self) -> None:
        for t, depth in enumerate(self.depth):
            self.open[t] = [r for r in self.open[t] if r.status != RequestStatus.FINISHED]
            while len(self.open[t]) < depth:
                self.add(t)

    def step(self):
        out = self.last = self.sched.schedule()
        samplers = {s.request.request_id for s in out.scheduled if s.samples}
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_tokens
        for s in out.scheduled:
            r = s.request
            if r.request_id in samplers:
                r.token_ids.append(5)
                self.generated[tier_of(r)] += 1
                if r.num_output_tokens >= r.params.max_tokens:
                    self.sched.finish(r, FinishReason.LENGTH)
        self.clock.now += 0.01
        self.top_up()
        return out

    def shares_of_tokens(self, steps: int) -> list[float]:
        before = list(self.generated)
        for _ in range(steps):
            self.step()
        got = [a - b for a, b in zip(self.generated, before)]
        return [g / sum(got) for g in got]


def test_three_backlogged_tiers_get_their_shares_of_generated_tokens():
    b = Backlog(SHARES)
    for t in range(3):
        b.backlog(t, 30)
    for _ in range(30):  # past the start
        b.step()
    preemptions = b.sched.num_preemptions
    got = b.shares_of_tokens(300)
    assert got == pytest.approx([0.70, 0.25, 0.05], abs=0.03), got
    assert b.sched.seats_by_tier() == [14, 5, 1]
    # in the steady state each free seat goes straight to the tier that is owed it: nothing is taken back
    assert b.sched.num_preemptions == preemptions


def test_batch_gets_its_share_and_no_more_beside_interactive_and_one_tier_alone_gets_everything():
    b = Backlog(SHARES)
    b.backlog(0, 30)
    b.backlog(2, 30)
    for _ in range(30):
        b.step()
    got = b.shares_of_tokens(300)
    assert got[2] == pytest.approx(0.05, abs=0.02) and got[0] == pytest.approx(0.95, abs=0.02), got
    alone = Backlog(SHARES)
    alone.backlog(1, 30)
    for _ in range(30):
        alone.step()
    assert alone.sched.seats_by_tier() == [0, 20, 0] and alone.shares_of_tokens(50)[1] == 1.0


def test_strict_keeps_the_old_rule_interactive_starves_standard():
    b = Backlog(TierShares(None))
    b.backlog(0, 30)
    b.backlog(1, 30)
    for _ in range(30):
        b.step()
    assert b.shares_of_tokens(200) == [1.0, 0.0, 0.0]


def test_lending_returns_within_a_step_and_the_preempted_complete_without_leaks():
    """Interactive and batch backlogged hold every seat (19 + 1); standard becomes backlogged: it holds its own 5
    seats at the first step, taken from interactive's borrowed ones by preemption; the preempted requests finish
    later, and every block comes back."""
    b = Backlog(SHARES)
    b.backlog(0, 30)
    b.backlog(2, 30)
    for _ in range(20):
        b.step()
    assert b.sched.seats_by_tier() == [19, 0, 1]
    preempted_before = list(b.sched.preemptions_by_tier)
    b.backlog(1, 30)
    b.step()
    assert b.sched.seats_by_tier() == [14, 5, 1]
    victims = b.last.preempted
    assert len(victims) == 5 and all(tier_of(v) == 0 for v in victims)  # only the borrower gave seats back
    assert [a - p for a, p in zip(b.sched.preemptions_by_tier, preempted_before)] == [5, 0, 0]
    for _ in range(40):
        b.step()
    assert all(v.status == RequestStatus.FINISHED and v.num_output_tokens == v.params.max_tokens for v in victims)
    b.depth = [0, 0, 0]
    while b.sched.has_work():
        b.step()
    b.kv.check_no_leaks()


def test_lower_tier_prompt_tokens_are_capped_while_a_more_important_tier_is_active():
    """A batch prompt of 200 tokens, budget 256: alone (interactive never seen, or not seen for the window) it
    runs in one step; while interactive is active its chunks are held to max(5% of 256, 32) = 32 tokens a step."""
    def first_chunk(interactive_seen_ago: float | None) -> int:
        b = Backlog(SHARES, budget=256)
        if interactive_seen_ago is not None:
            i = b.add(0)
            b.step()
            b.sched.finish(i, FinishReason.ABORT)
            b.clock.now += interactive_seen_ago
        r = b.add(2, prompt_len=200)
        out = b.step()
        return next(s.num_tokens for s in out.scheduled if s.request is r)

    assert first_chunk(None) == 200
    assert first_chunk(20.0) == 200  # interactive went quiet more than TIER_ACTIVE_WINDOW_S ago
    assert first_chunk(1.0) == 32


def test_borrowed_rows_sit_out_a_more_important_prefill_and_own_seats_do_not():
    b = Backlog(SHARES)
    b.backlog(2, 10)  # batch alone borrows 9 seats beyond its own one
    for _ in range(3):
        b.step()
    assert b.sched.seats_by_tier() == [0, 0, 10]
    oldest_batch = min(b.sched.running, key=lambda r: r.admitted_seq)
    i = b.add(0, prompt_len=8)
    out = b.step()
    assert {s.request.request_id for s in out.scheduled} == {i.request_id, oldest_batch.request_id}
    out = b.step()
    assert len(out.scheduled) == 11  # the next step: everyone decodes


def test_a_tier_below_its_share_takes_kv_room_back_from_a_tier_over_its_share():
    """Two batch sequences hold the whole KV pool (free seats remain): an interactive request, far below its share
    of the pool, preempts the newer one."""
    b = Backlog(SHARES, blocks=8, prompt_len=14, max_tokens=4)
    x, y = b.add(2), b.add(2)
    b.step()
    assert b.kv.num_free_blocks == 0
    i = b.add(0, prompt_len=6)
    out = b.step()
    assert out.preempted == [y] and i.status == RequestStatus.RUNNING and x.status == RequestStatus.RUNNING


# ---- the engine on the micro model ----------------------------------------------------------------------------
def test_preemption_across_tiers_leaks_nothing_and_the_preempted_stream_completes_exactly(micro):
    """Four seats (own: interactive 3, standard 1, batch 1): batch fills them, then a standard request takes its
    own seat back from batch's borrowed ones. The victim completes with the tokens (and logits, by the exactness
    rule) of its run alone; no block is left behind."""
    kw = dict(max_num_seqs=4)
    engine = micro.engine(**kw, record_logits=True)
    batch = []
    for k in range(4):
        sp = SamplingParams(max_tokens=14, temperature=0.9, seed=100 + k, ignore_eos=True, priority=2)
        engine.add_request([(k * 31 + j) % 500 + 3 for j in range(9)], sp, request_id=f"b{k}")
        batch.append(engine.requests[f"b{k}"])
    for _ in range(4):
        engine.step()
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, priority=1)
    engine.add_request([11, 12, 13, 14, 15], sp, request_id="s")
    s = engine.requests["s"]
    engine.step()
    assert s.status == RequestStatus.RUNNING and engine.last_schedule.preempted == [batch[3]]
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_cache.check_no_leaks()
    for r in batch + [s]:
        assert r.is_finished and r.num_output_tokens == r.params.max_tokens
        [alone] = micro.engine(**kw, record_logits=True).generate([r.prompt_token_ids], r.params)
        assert_same_output(r, alone, r.params, f"{r.request_id} (preempted {r.num_preemptions}x)")
    assert batch[3].num_preemptions == 1


# ---- what comes from outside: the flag, and a worker's per-tier figures --------------------------------------------
def test_a_bad_tier_shares_flag_is_a_usage_error_and_a_good_one_is_written_out():
    import argparse

    from inferd.cli.types import tier_shares_arg

    assert tier_shares_arg(" batch=1 , interactive=3 ") == "interactive=75,standard=0,batch=25"
    assert tier_shares_arg("strict") == "strict"
    with pytest.raises(argparse.ArgumentTypeError, match="premium"):
        tier_shares_arg("premium=10")


def test_a_workers_per_tier_figures_of_the_wrong_shape_are_read_as_zeros():
    from inferd.worker.protocol import WorkerStats

    good = WorkerStats.from_wire({"running_by_tier": [3, 2, 1], "preemptions_by_tier": [0, 4, 7]})
    assert good.running_by_tier == [3, 2, 1] and good.preemptions_by_tier == [0, 4, 7]
    for bad in ([1, 2], [1, 2, 3, 4], [1, -2, 3], [1, "2", 3], [True, 0, 0], "123", None, [1.5, 0, 0]):
        stats = WorkerStats.from_wire({"running_by_tier": bad, "preemptions_by_tier": bad})
        assert stats.running_by_tier == [0, 0, 0] and stats.preemptions_by_tier == [0, 0, 0], bad
