"""Priority preemption under `--tier-shares strict` (the old rule, kept): a more important waiting request takes the
slot or the KV room of less important running work (recompute), never of equal or more important work, and only
when that actually lets it in. Victims finish with exactly the tokens of their run alone. The shares' rule is
tests/engine/test_tier_shares.py."""

from __future__ import annotations

import pytest

from inferd.engine import KVCacheManager, Request, SamplingParams
from inferd.engine.request import FinishReason, RequestStatus
from inferd.engine.scheduler import Scheduler
from inferd.engine.tier_shares import STRICT, TierShares
from tests.parity import assert_same_output

RUNNING, PREEMPTED, WAITING = RequestStatus.RUNNING, RequestStatus.PREEMPTED, RequestStatus.WAITING


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + i * 11) % 500 + 3 for i in range(n)]


def params(priority: int, max_tokens: int = 16, seed: int | None = None) -> SamplingParams:
    if seed is None:  # greedy
        return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, priority=priority)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True,
                          priority=priority)


def add(engine, rid: str, tokens: list[int], sp: SamplingParams) -> Request:
    engine.add_request(tokens, sp, request_id=rid)
    return engine.requests[rid]  # the engine forgets finished requests: keep the object


def run(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def assert_same_as_alone(micro, engine_kw: dict, reqs: list[Request]) -> None:
    for r in reqs:
        assert r.is_finished and r.finish_reason.value == "length", r.request_id
        alone_engine = micro.engine(**engine_kw, record_logits=True, tier_shares=STRICT)
        [alone] = alone_engine.generate([r.prompt_token_ids], r.params)
        # by the exactness rule: a preempted request recomputes its context by prefill, in another float order
        assert_same_output(r, alone, r.params, f"{r.request_id} (preempted {r.num_preemptions}x)")


# ---- the engine on the micro model ----------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_important_request_preempts_for_a_sequence_slot(micro, sampling):
    seeds = {"a": 11, "b": 22, "h": 33} if sampling == "seeded" else dict.fromkeys("abh")
    kw = dict(max_num_seqs=2)
    engine = micro.engine(**kw, record_logits=True, tier_shares=STRICT)
    a = add(engine, "a", prompt(1, 12), params(2, 20, seeds["a"]))
    engine.step()
    b = add(engine, "b", prompt(2, 9), params(2, 20, seeds["b"]))
    for _ in range(3):
        engine.step()
    assert a.status == b.status == RUNNING and a.admitted_seq < b.admitted_seq
    b_outputs = b.num_output_tokens
    assert b_outputs > 0  # the victim has generated tokens that its recompute must reproduce
    h = add(engine, "h", prompt(3, 7), params(0, 12, seeds["h"]))
    engine.step()
    sched = engine.scheduler
    assert h.status == RUNNING and h in sched.running and h.num_output_tokens == 1
    assert sched.num_preemptions == 1 and engine.last_schedule.preempted == [b]  # the most recently admitted
    assert b.status == PREEMPTED and b.num_preemptions == 1 and not b.block_ids and sched.waiting == [b]
    assert b.num_output_tokens == b_outputs  # preempted before it sampled this step
    assert a.status == RUNNING and a.num_preemptions == 0
    run(engine)
    assert sched.num_preemptions == 1  # the victim waited its turn and did not preempt back
    assert_same_as_alone(micro, kw, [a, b, h])
    engine.kv_cache.check_no_leaks()


def test_important_request_preempts_for_kv_room(micro):
    kw = dict(blocks=4)  # 64 tokens: two requests of 17 + 15 tokens (2 blocks each) fill it
    engine = micro.engine(**kw, record_logits=True, tier_shares=STRICT)
    a = add(engine, "a", prompt(4, 17), params(2, 15))
    b = add(engine, "b", prompt(5, 17), params(2, 15))
    for _ in range(3):
        engine.step()
    assert a.status == b.status == RUNNING and a.admitted_seq < b.admitted_seq
    assert engine.kv_cache.num_free_blocks == 0
    h = add(engine, "h", prompt(6, 10), params(0, 6))  # one block
    engine.step()
    sched = engine.scheduler
    assert len(sched.running) < sched.max_num_seqs  # it was the room, not a slot
    assert h.status == RUNNING and engine.last_schedule.preempted == [b] and sched.num_preemptions == 1
    assert b.status == PREEMPTED and b.num_preemptions == 1 and a.status == RUNNING
    run(engine)
    assert sched.num_preemptions == 1
    assert_same_as_alone(micro, kw, [a, b, h])
    engine.kv_cache.check_no_leaks()


@pytest.mark.parametrize("limit", ["slots", "kv"])
def test_equal_priority_never_preempts_for_admission(micro, limit):
    kw = dict(max_num_seqs=2) if limit == "slots" else dict(blocks=4)
    engine = micro.engine(**kw, record_logits=True, tier_shares=STRICT)
    a = add(engine, "a", prompt(7, 17), params(1, 15))
    b = add(engine, "b", prompt(8, 17), params(1, 15))
    engine.step()
    c = add(engine, "c", prompt(9, 5), params(1, 4))
    while a.status == RUNNING and b.status == RUNNING:  # until one of them finishes, c waits
        assert c.status == WAITING and engine.scheduler.waiting == [c]
        engine.step()
    run(engine)
    assert engine.scheduler.num_preemptions == 0
    assert_same_as_alone(micro, kw, [a, b, c])
    engine.kv_cache.check_no_leaks()


@pytest.mark.parametrize("limit", ["slots", "kv"])
def test_more_important_request_is_never_preempted_for_a_less_important_one(micro, limit):
    kw = dict(max_num_seqs=2) if limit == "slots" else dict(blocks=4)
    engine = micro.engine(**kw, record_logits=True, tier_shares=STRICT)
    a = add(engine, "a", prompt(10, 17), params(0, 15))
    b = add(engine, "b", prompt(11, 17), params(0, 15))
    engine.step()
    c = add(engine, "c", prompt(12, 5), params(2, 4))
    while a.status == RUNNING and b.status == RUNNING:
        assert c.status == WAITING
        engine.step()
    run(engine)
    assert engine.scheduler.num_preemptions == 0
    engine.kv_cache.check_no_leaks()


def test_the_victim_is_the_least_important_not_the_latest(micro):
    """Running: a (priority 2, admitted first) and b (priority 1, admitted last). A priority-0 request could take
    either slot; it takes a's, the least important, although b is the most recently admitted."""
    kw = dict(max_num_seqs=2)
    engine = micro.engine(**kw, record_logits=True, tier_shares=STRICT)
    a = add(engine, "a", prompt(13, 11), params(2, 20))
    engine.step()
    b = add(engine, "b", prompt(14, 8), params(1, 20))
    engine.step()
    assert a.admitted_seq < b.admitted_seq
    h = add(engine, "h", prompt(15, 6), params(0, 10))
    engine.step()
    assert engine.last_schedule.preempted == [a] and h.status == b.status == RUNNING
    run(engine)
    assert engine.scheduler.num_preemptions == 1  # a waited for a slot, it did not take one back
    assert_same_as_alone(micro, kw, [a, b, h])
    engine.kv_cache.check_no_leaks()


def test_no_preemption_when_it_would_not_make_room(micro):
    """A priority-0 request holds 3 of 4 blocks, a priority-2 one the last. A priority-1 request that needs 2
    blocks would not fit even with the priority-2 one gone: that one keeps running, nothing is preempted."""
    engine = micro.engine(blocks=4, tier_shares=STRICT)
    a = add(engine, "a", prompt(16, 40), params(0, 8))
    b = add(engine, "b", prompt(17, 5), params(2, 8))
    engine.step()
    assert engine.kv_cache.num_free_blocks == 0
    h = add(engine, "h", prompt(18, 20), params(1, 4))
    while a.status == RUNNING:
        engine.step()
        assert h.status == WAITING and engine.scheduler.num_preemptions == 0
    assert b.num_preemptions == 0
    run(engine)
    assert engine.scheduler.num_preemptions == 0
    engine.kv_cache.check_no_leaks()


# ---- the scheduler alone: the step after a block shortage, shared blocks ------------------------------------
def sched_step(sched: Scheduler, token: int = 7):
    """What Engine.step does to the requests, without a model: compute the scheduled tokens, sample one token."""
    out = sched.schedule()
    samplers = [s.request for s in out.scheduled if s.samples]
    for s in out.scheduled:
        s.request.num_computed_tokens += s.num_tokens
    for r in samplers:
        r.token_ids.append(token)
    for s in out.scheduled:
        sched.kv.cache_full_blocks(s.request)
    return out


def make_req(rid: str, tokens: list[int], priority: int, arrival: int) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=32, priority=priority), arrival_seq=arrival)


@pytest.mark.parametrize("head_priority", [2, 1])
def test_after_a_block_shortage_only_a_more_important_head_is_admitted(head_priority):
    """r (priority 0) needs a new block, which preempts v (priority 2) and leaves one block free. A waiting head
    of v's priority must not take it in the same step (the old rule: a step that preempted for blocks admits no
    work of that rank); a more important head may, it would have preempted v itself."""
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, tier_shares=TierShares(None))
    r = make_req("r", list(range(10, 18)), 0, arrival=0)
    v = make_req("v", list(range(20, 28)), 2, arrival=5)
    sched.add(r)
    sched.add(v)
    sched_step(sched)
    assert kv.num_free_blocks == 0 and r.num_tokens == 9  # r's next token starts a third block
    w = make_req("w", [1, 2, 3], head_priority, arrival=1)  # ahead of v in line either way
    sched.add(w)
    out = sched_step(sched)
    assert out.preempted == [v]
    assert kv.num_free_blocks == (0 if head_priority == 1 else 1)
    scheduled = [s.request for s in out.scheduled]
    if head_priority == 2:
        assert scheduled == [r] and sched.waiting == [w, v]
    else:
        assert w in scheduled and w.status == RUNNING and sched.waiting == [v]
    assert sched.num_preemptions == 1


def test_blocks_shared_with_more_important_work_do_not_count_as_room():
    """b (priority 2) shares its first two blocks with a (priority 0): preempting b frees one block only, so a
    priority-1 request that needs two is not let in by preempting b."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, tier_shares=TierShares(None))
    shared = list(range(30, 38))
    a = make_req("a", shared + [40], 0, arrival=0)
    sched.add(a)
    sched_step(sched)  # a: 3 blocks, the first two published in the prefix cache
    b = make_req("b", shared + [41], 2, arrival=1)
    sched.add(b)
    sched_step(sched)
    assert b.status == RUNNING and b.num_cached_tokens == 8 and kv.num_free_blocks == 0
    assert len(b.block_ids) == 3  # two shared with a, one of its own
    h = make_req("h", [1, 2, 3, 4, 5], 1, arrival=2)  # 2 blocks
    sched.add(h)
    out = sched_step(sched)
    assert not out.preempted and sched.num_preemptions == 0 and sched.waiting == [h]
    # with one block less to find, preempting b does let it in
    h2 = make_req("h2", [1, 2, 3], 1, arrival=3)
    sched.finish(h, FinishReason.ABORT)
    sched.add(h2)
    out = sched_step(sched)
    assert out.preempted == [b] and h2.status == RUNNING


def test_less_important_work_sits_out_the_step_of_a_more_important_prefill():
    """b (priority 2, a batch line) decodes; a (priority 0) arrives: a's prefill runs alone in the next step (its
    first token does not wait for a step that also runs b), then both decode together."""
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, tier_shares=TierShares(None))
    b = make_req("b", list(range(20, 28)), 2, arrival=0)
    sched.add(b)
    sched_step(sched)
    assert [s.request for s in sched_step(sched).scheduled] == [b]  # decoding
    a = make_req("a", list(range(40, 52)), 0, arrival=1)
    sched.add(a)
    out = sched_step(sched)
    assert [(s.request, s.num_tokens) for s in out.scheduled] == [(a, 12)] and not out.preempted
    assert sorted(s.request.request_id for s in sched_step(sched).scheduled) == ["a", "b"]
    # equal priorities keep decode-first: a decode is never held for a peer's prefill
    c = make_req("c", list(range(60, 70)), 2, arrival=2)
    sched.add(c)
    assert sorted(s.request.request_id for s in sched_step(sched).scheduled) == ["a", "b", "c"]


def test_held_work_runs_when_the_more_important_request_cannot_get_in():
    """A more important head that no preemption can let in (its prompt needs more blocks than the pool frees)
    waits, and the less important decode it held back runs in the same step: nothing waits on a request that
    cannot run."""
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, tier_shares=TierShares(None))
    b = make_req("b", list(range(20, 28)), 2, arrival=0)
    sched.add(b)
    sched_step(sched)
    big = make_req("big", list(range(100, 120)), 0, arrival=1)  # 5 blocks: never fits
    sched.add(big)
    out = sched_step(sched)
    assert [s.request for s in out.scheduled] == [b] and sched.waiting == [big] and not out.preempted
