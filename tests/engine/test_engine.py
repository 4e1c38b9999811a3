"""Engine mechanics on a micro model: validation, abort, stop conditions, seeded sampling and replay."""

from __future__ import annotations

import asyncio

import pytest
import torch

from inferd.engine import AsyncEngine, InvalidRequestError, SamplingParams
from inferd.engine.sampler import filtered_sorted_probs, sample_row, uniform_draw
from tests.parity import assert_sampling_match, greedy_divergence, row_diff, scale_of, top2_gap

PROMPT = [5, 17, 99, 23, 42, 7, 300, 11, 64, 128, 3, 9]


def run(engine):
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("prompt,params,match", [
    ([], SamplingParams(), "empty"),
    (PROMPT, SamplingParams(max_tokens=0), "max_tokens"),
    (PROMPT, SamplingParams(max_tokens=-3), "max_tokens"),
    (PROMPT, SamplingParams(top_p=0.0), "top_p"),
    (PROMPT, SamplingParams(top_p=1.5), "top_p"),
    (PROMPT, SamplingParams(temperature=-1), "temperature"),
    (PROMPT, SamplingParams(temperature=float("nan")), "temperature"),
    (PROMPT, SamplingParams(top_k=-2), "top_k"),
    (PROMPT, SamplingParams(logprobs=21), "logprobs"),
    (PROMPT, SamplingParams(stop=[""]), "stop"),
    ([1, 2, 512], SamplingParams(), "vocabulary"),
    ([1, -1], SamplingParams(), "vocabulary"),
    (PROMPT, SamplingParams(stop_token_ids=[512]), "stop token id"),
    (PROMPT, SamplingParams(stop_token_ids=[-1], min_tokens=2), "stop token id"),
    (list(range(1, 250)), SamplingParams(max_tokens=16), "context window"),  # 249 + 16 > 256
    (list(range(1, 300)), SamplingParams(max_tokens=1), "context window"),
])
def test_bad_input_is_refused_before_scheduling(micro, prompt, params, match):
    engine = micro.engine()
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished_requests() and not engine.requests
    engine.kv_cache.check_no_leaks()


def test_request_larger_than_the_pool_is_refused(micro):
    engine = micro.engine(blocks=4)  # 64 tokens in all
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        engine.add_request(list(range(1, 60)), SamplingParams(max_tokens=10))
    rid = engine.add_request(list(range(1, 50)), SamplingParams(max_tokens=10))  # 59 tokens fits
    run(engine)
    assert rid not in engine.requests
    engine.kv_cache.check_no_leaks()


def test_duplicate_request_id_is_refused(micro):
    engine = micro.engine()
    engine.add_request(PROMPT, SamplingParams(), request_id="x")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request(PROMPT, SamplingParams(), request_id="x")
    engine.abort("x")
    engine.kv_cache.check_no_leaks()


def test_abort_running_and_waiting_gives_blocks_back(micro):
    engine = micro.engine(max_num_seqs=1)
    running = engine.add_request(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    waiting = engine.add_request(PROMPT[:5], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.requests[running].block_ids and not engine.requests[waiting].block_ids
    assert engine.abort(running) and engine.abort(waiting)
    assert not engine.abort(running)  # already gone
    outs = engine.step()
    assert {o.request_id for o in outs} == {running, waiting}
    assert all(o.finished and o.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()
    engine.kv_cache.check_no_leaks()


def test_max_tokens_stop_tokens_and_eos(micro):
    engine = micro.engine()
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    [full] = engine.generate([PROMPT], greedy)
    assert full.num_output_tokens == 12 and full.finish_reason.value == "length"
    out = full.output_token_ids
    # a stop token id ends the request at its first occurrence (the stop token is the last output)
    stop_tok = out[5]
    [stopped] = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                         stop_token_ids=[stop_tok]))
    first = out.index(stop_tok)
    assert stopped.output_token_ids == out[:first + 1]
    assert stopped.finish_reason.value == "stop" and stopped.stop_reason == stop_tok
    # EOS ends a request unless ignore_eos: make EOS the greedy choice by declaring it the model's EOS
    engine.eos_token_ids = frozenset({out[0]})
    [eos] = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0))
    assert eos.output_token_ids == out[:1] and eos.stop_reason == out[0]
    [ign] = engine.generate([PROMPT], greedy)
    assert ign.output_token_ids == out
    engine.kv_cache.check_no_leaks()


def test_seeded_sampling_is_reproducible_across_batches_and_replay(micro):
    params = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    solo_engine = micro.engine(record_logits=True)
    [solo] = solo_engine.generate([PROMPT], params)
    # the same request inside a busy, chunked batch with other seeds; their prompts are shorter and they outlast
    # it, so it has the longest context of the batch and every decode of it (sorted shortest context first) is
    # sampled on a later row than the solo run's row 0: a draw that followed the row, not the position, would differ
    busy = micro.engine(max_num_batched_tokens=16, max_num_seqs=8, record_logits=True)
    others = [SamplingParams(max_tokens=44, temperature=1.0, seed=s, ignore_eos=True) for s in range(5)]
    rids = [busy.add_request(p, sp) for p, sp in zip([list(range(10 + s, 14 + s)) for s in range(5)] + [PROMPT],
                                                      others + [params])]
    seeded = busy.requests[rids[-1]]
    rows = []  # the rows the seeded request's decodes were sampled on (decodes come first, one row each)
    while busy.has_unfinished_requests():
        busy.step()
        scheduled = [s.request for s in busy.last_schedule.scheduled]
        if seeded in scheduled and busy.last_schedule.scheduled[scheduled.index(seeded)].num_tokens == 1:
            rows.append(scheduled.index(seeded))
    assert len(rows) == params.max_tokens - 1 and min(rows) > 0, rows  # its first token comes from its prefill
    n = len(PROMPT)
    assert_sampling_match(seeded.output_token_ids, solo.output_token_ids, solo.debug_logits, params, 1234, n,
                          diff_at=lambda i: row_diff(seeded.debug_logits[i], solo.debug_logits[i]))
    # replay from a prefix of its own output: the continuation is the same
    for k in (1, 17, 39):
        replay_engine = micro.engine(record_logits=True)
        rid = replay_engine.add_request(PROMPT + solo.output_token_ids[:k], params, num_prompt_tokens=n)
        req = replay_engine.requests[rid]
        run(replay_engine)
        assert req.num_output_tokens == 40 and len(req.debug_logits) == 40 - k
        assert_sampling_match(req.output_token_ids[k:], solo.output_token_ids[k:], solo.debug_logits[k:],
                              params, 1234, n + k,
                              diff_at=lambda i, req=req, k=k: row_diff(req.debug_logits[i], solo.debug_logits[k + i]))
    # a different seed gives a different sample
    [other] = micro.engine().generate([PROMPT], SamplingParams(**{**params.__dict__, "seed": 4321}))
    assert other.output_token_ids != solo.output_token_ids


@pytest.mark.parametrize("seed", [0, 1234, 2**63 - 1])
def test_a_seeds_draws_over_positions_are_uniform_and_its_own(seed):
    """uniform_draw(seed, position) over positions 0..N-1 is one uniform sample per position: distinct numbers whose
    empirical CDF stays within 1.95/sqrt(N) of the uniform one (the Kolmogorov-Smirnov bound a true uniform sample
    exceeds with probability 0.001; the draws are a fixed function, so this passes or fails for good), adjacent
    positions uncorrelated; another seed draws other numbers."""
    n = 2000
    us = [uniform_draw(seed, p) for p in range(n)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert len(set(us)) == n
    ks = max(max((i + 1) / n - u, u - i / n) for i, u in enumerate(sorted(us)))
    assert ks < 1.95 / n ** 0.5, ks
    lag1 = sum((a - 0.5) * (b - 0.5) for a, b in zip(us, us[1:])) / (n - 1) * 12  # correlation; sd 1/sqrt(n)
    assert abs(lag1) < 4 / n ** 0.5, lag1
    other = [uniform_draw(seed ^ 1, p) for p in range(n)]
    assert not set(us) & set(other)  # equal 53-bit draws by chance: probability below n^2 / 2^53


def test_unseeded_requests_sample_with_seeds_of_their_own(micro):
    """Two requests without a seed, same prompt, temperature 1: each gets its own seed, so their samples differ.
    They are equal with probability sum over sequences s of P(s)^2 <= max_s P(s): on this model the likeliest
    64-token continuations measured (the greedy path; 20 samples) have P(s) < 1e-30."""
    params = SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True)
    a, b = micro.engine().generate([PROMPT, PROMPT], params)
    assert a.params.seed is not None and a.params.seed != b.params.seed  # 63 random bits each
    assert a.output_token_ids != b.output_token_ids


def test_inverse_cdf_sampling_follows_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    params = SamplingParams(temperature=1.0)
    probs = torch.softmax(logits, 0)
    n = 4000
    counts = torch.zeros(5)
    for i in range(n):
        counts[sample_row(logits, params, (i + 0.5) / n)] += 1
    assert torch.allclose(counts / n, probs, atol=2 / n)  # a uniform grid of draws: exact up to rounding
    # top_k=2 keeps the two most likely, renormalised
    counts.zero_()
    for i in range(n):
        counts[sample_row(logits, SamplingParams(temperature=1.0, top_k=2), (i + 0.5) / n)] += 1
    p2 = torch.softmax(logits[:2], 0)
    assert counts[2:].sum() == 0 and torch.allclose(counts[:2] / n, p2, atol=2 / n)
    # top_p keeps the smallest set whose mass reaches p
    kept = (filtered_sorted_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))[0] > 0).sum()
    assert int(kept) == int((torch.cumsum(probs.sort(descending=True).values, 0) < 0.7).sum()) + 1


def test_top_k_1_and_tiny_top_p_are_greedy(micro):
    engine = micro.engine()
    [g] = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    [k1] = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3,
                                                    ignore_eos=True))
    [p0] = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6, seed=4,
                                                    ignore_eos=True))
    assert g.output_token_ids == k1.output_token_ids == p0.output_token_ids


def test_logprobs(micro):
    engine = micro.engine()
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0, logprobs=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    lps = [lp for o in outs for lp in o.logprobs]
    assert len(lps) == 3
    for lp in lps:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy: the sampled token is the top one
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_async_engine_streams_and_aborts_on_early_exit(micro):
    engine = micro.engine()
    aengine = AsyncEngine(engine)

    async def main():
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        streamed = []
        async for out in aengine.generate(PROMPT, params):
            streamed += out.new_token_ids
        # two concurrent streams, one left early
        got = []

        async def early():
            gen = aengine.generate(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
            async for out in gen:
                got.append(out)
                if len(got) == 3:
                    abandoned.append(engine.requests[out.request_id])
                    break
            await gen.aclose()  # what a server does when the client goes away
        await asyncio.gather(early(), aengine_collect(aengine, PROMPT[:4]))
        with pytest.raises(InvalidRequestError):
            async for _ in aengine.generate([], params):
                pass
        return streamed

    abandoned = []

    async def aengine_collect(ae, prompt):
        return [o async for o in ae.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True))]

    try:
        streamed = asyncio.run(main())
        [ref] = micro.engine().generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        assert streamed == ref.output_token_ids
        # the abandoned request is aborted by the step thread; wait for it through the command queue
        done = asyncio.run(_until(lambda: not engine.has_unfinished_requests()))
        assert done
        [req] = abandoned
        assert req.finish_reason.value == "abort" and req.num_output_tokens < 200
        engine.kv_cache.check_no_leaks()
    finally:
        aengine.shutdown()


async def _until(cond, tries: int = 500) -> bool:
    for _ in range(tries):
        if cond():
            return True
        await asyncio.sleep(0.01)
    return False


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    from inferd.engine.sampler import apply_penalties

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, generator=g) * 3
    prompt, output = [1, 5, 9, 9], [12, 5, 40]
    ours = logits.clone()
    apply_penalties(ours, prompt, output, SamplingParams(repetition_penalty=1.3))
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.clone().unsqueeze(0))[0]
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, logits)


def test_presence_and_frequency_penalties_count_only_the_output():
    from inferd.engine.sampler import apply_penalties

    logits = torch.zeros(16)
    apply_penalties(logits, [3, 3, 4], [4, 7, 7, 7], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    expected = torch.zeros(16)
    expected[4] = -(0.5 + 0.25 * 1)
    expected[7] = -(0.5 + 0.25 * 3)
    assert torch.equal(logits, expected)  # token 3 is only in the prompt: untouched


def test_batched_penalties_from_incremental_state_are_the_per_row_ones():
    """The engine applies penalties to all rows at once from each request's PenaltyState, brought up to date with
    the tokens added since its last step: bit for bit apply_penalties on each row's whole history, step after
    step, a replayed request (num_prompt_tokens short of its prompt: earlier outputs count as output) included."""
    from inferd.engine.sampler import PenaltyState, apply_penalties, apply_penalties_batch

    g = torch.Generator().manual_seed(4)
    V = 300
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(frequency_penalty=0.7),
              SamplingParams(presence_penalty=-0.4, frequency_penalty=0.2, repetition_penalty=0.8)]
    histories = [torch.randint(0, V, (40,), generator=g).tolist() for _ in params]
    num_prompt = [12, 20, 5]  # the third: a replay whose prompt held 9 earlier outputs after its 5 prompt tokens
    states = [PenaltyState(V, torch.device("cpu")) for _ in params]
    for length in (20, 21, 22, 30, 40):  # the tokens each step has seen (prompt, then outputs as they come)
        logits = torch.randn(5, V, generator=g) * 4
        rows = [0, 2, 4]  # rows 1 and 3 ask for no penalty
        expected = logits.clone()
        for row, p, h, n in zip(rows, params, histories, num_prompt):
            apply_penalties(expected[row], h[:n], h[n:length], p)
        for state, h, n in zip(states, histories, num_prompt):
            state.update(h[:length], n)
        apply_penalties_batch(logits, rows, states, params)
        assert torch.equal(logits, expected), length


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                         ("repetition_penalty", 0.0), ("min_tokens", -1), ("min_tokens", 99)])
def test_bad_penalties_are_refused(micro, field, value):
    engine = micro.engine()
    with pytest.raises(InvalidRequestError, match=field):
        engine.add_request(PROMPT, SamplingParams(max_tokens=10, **{field: value}))


def test_min_tokens_blocks_eos_and_stop_ids(micro):
    engine = micro.engine(record_logits=True)
    [full] = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    out = full.output_token_ids
    engine.eos_token_ids = frozenset({out[0]})  # EOS would be the greedy first token
    [req] = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, min_tokens=4))
    assert req.num_output_tokens >= 4 and out[0] not in req.output_token_ids[:4]
    # the recorded (raw) logits still show EOS as the model's choice at the first position
    assert int(req.debug_logits[0].argmax()) == out[0]
    [stop] = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, min_tokens=3,
                                                      stop_token_ids=[out[0]]))
    assert out[0] not in stop.output_token_ids[:3]
    engine.kv_cache.check_no_leaks()


def test_penalised_request_replays_identically(micro):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=1.0,
                            presence_penalty=0.5, repetition_penalty=1.2)
    engine = micro.engine(record_logits=True)
    [orig] = engine.generate([PROMPT], params)
    [plain] = engine.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert orig.output_token_ids != plain.output_token_ids  # the penalties changed something
    k = 10
    rid = engine.add_request(PROMPT + orig.output_token_ids[:k], params, num_prompt_tokens=len(PROMPT))
    req = engine.requests[rid]
    run(engine)
    from inferd.engine.sampler import apply_penalties

    def penalised_gap(i: int) -> float:  # the sampler chose from the penalised logits
        row = orig.debug_logits[i].clone()
        apply_penalties(row, PROMPT, orig.output_token_ids[:i], params)
        return top2_gap(row)

    # the k tokens given as already generated are kept; the rest by the exactness rule (raw logits, penalised gaps)
    assert req.output_token_ids[:k] == orig.output_token_ids[:k]
    greedy_divergence(req.output_token_ids[k:], orig.output_token_ids[k:], lambda i: penalised_gap(k + i),
                      lambda i: row_diff(req.debug_logits[i], orig.debug_logits[k + i]), "penalised replay",
                      scale_at=lambda i: scale_of(orig.debug_logits[k + i]))
    assert req.num_output_tokens == orig.num_output_tokens


def test_step_limits_hold_every_step(micro):
    engine = micro.engine(max_num_seqs=3, max_num_batched_tokens=20)
    for i in range(6):
        engine.add_request([5 + i] * (10 + 7 * i), SamplingParams(max_tokens=6, ignore_eos=True))
    seen_full = False
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.scheduler.running) <= 3
        assert engine.last_schedule.num_tokens <= 20
        seen_full |= len(engine.scheduler.running) == 3 and bool(engine.scheduler.waiting)
    assert seen_full  # the cap was actually reached while others waited
    engine.kv_cache.check_no_leaks()


def test_inconsistent_engine_limits_are_refused(micro):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        micro.engine(max_num_seqs=32, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="less than one KV block"):
        micro.engine(blocks=0)


def test_cli_sizes_parse():
    import argparse

    from inferd.cli.types import parse_bytes

    assert parse_bytes("1073741824") == 1 << 30
    assert parse_bytes("512M") == 512 << 20 and parse_bytes("2G") == 2 << 30 and parse_bytes("1.5GiB") == 3 << 29
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")
