"""The batched draw (sampler.sample_rows: a topk of candidates, a full sort only for draws past them) against the
per-row draw it stands for (sample_row: a full sort of the vocabulary), and its independence of the batch."""

from __future__ import annotations

import random

import pytest
import torch

from inferd.engine import SamplingParams
from inferd.engine.sampler import SAMPLE_TOP_FIRST, filtered_sorted_probs, sample_row, sample_rows

COMBOS = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.5, top_p=0.9),
          dict(temperature=1.0, top_k=40), dict(temperature=0.8, top_k=5, top_p=0.5), dict(temperature=1.0, top_p=0.3),
          dict(temperature=1.0, top_k=SAMPLE_TOP_FIRST + 100)]


def near_boundary(logits: torch.Tensor, params: SamplingParams, u: float, within: float = 1e-5) -> bool:
    probs, _ = filtered_sorted_probs(logits, params)
    cdf = torch.cumsum(probs, dim=-1)
    return bool(((cdf - u * cdf[-1]).abs() < within).any())


@pytest.mark.parametrize("vocab,scale", [(300, 2.0), (49152, 4.0), (49152, 0.5)])
def test_the_batched_draw_is_the_per_row_draw(vocab, scale):
    """Float32 logits (no equal probabilities): every token is sample_row's, draws near 1 (past the candidates,
    the full-sort fallback) included, but for a draw within 1e-5 of a CDF boundary (the float sums' order)."""
    g = torch.Generator().manual_seed(vocab)
    rnd = random.Random(vocab)
    logits = torch.randn(len(COMBOS) * 6, vocab, generator=g) * scale
    params = [SamplingParams(max_tokens=1, **COMBOS[i % len(COMBOS)]) for i in range(len(logits))]
    us = [rnd.choice([rnd.random(), 0.999, 0.0, 0.5]) for _ in params]
    got = sample_rows(logits, params, us)
    for r, (token, p, u) in enumerate(zip(got, params, us)):
        want = sample_row(logits[r], p, u)
        assert token == want or near_boundary(logits[r], p, u), (r, p, u, token, want)


def test_a_row_draws_the_same_token_whatever_it_is_batched_with():
    """bf16-rounded logits (many exactly equal probabilities): a row alone and among others gives one token."""
    g = torch.Generator().manual_seed(3)
    rnd = random.Random(3)
    logits = (torch.randn(24, 49152, generator=g) * 3).bfloat16().float()
    params = [SamplingParams(max_tokens=1, **COMBOS[i % len(COMBOS)]) for i in range(24)]
    us = [rnd.random() for _ in params]
    together = sample_rows(logits, params, us)
    alone = [sample_rows(logits[r:r + 1], [params[r]], [us[r]])[0] for r in range(24)]
    reversed_batch = sample_rows(logits.flip(0), params[::-1], us[::-1])[::-1]
    assert together == alone == reversed_batch


def test_only_draws_past_the_candidates_take_more_of_them(monkeypatch):
    """Peaked distributions (a trained model's): draws inside the first candidates' mass are resolved there; a draw
    past them is drawn again among SAMPLE_TOP_GROWTH times as many (and equals sample_row's)."""
    import inferd.engine.sampler as sampler

    calls = []
    real = sampler.sample_rows
    monkeypatch.setattr(sampler, "sample_rows", lambda *a: calls.append(len(a[1])) or real(*a))
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(32, 49152, generator=g) * 6  # the top 256 of 49,152 hold nearly all of the mass
    params = [SamplingParams(max_tokens=1, temperature=1.0)] * 32
    mass = torch.topk(torch.softmax(logits, -1), SAMPLE_TOP_FIRST).values.sum(-1)
    us = [0.5 * float(m) for m in mass]  # inside every row's candidates
    sampler.sample_rows(logits, params, us)
    assert calls == [32]
    calls.clear()
    u = min(0.999999, float(mass[0]) + 1e-4)  # past them: one more round, for that row only
    [token] = sampler.sample_rows(logits[:1], params[:1], [u])
    assert calls == [1, 1]
    assert token == sample_row(logits[0], params[0], u) or near_boundary(logits[0], params[0], u)


def test_the_sampler_in_one_transfer_is_each_row_on_its_own(monkeypatch):
    """Sampler.sample runs greedy rows, sampled rows and logprobs on the device and reads them back in one transfer;
    a mixed batch gives each row what it gets alone: greedy the argmax, a sampled row sample_rows' token (a flat
    row's draw past the candidates included, redrawn in a second round), logprobs the row's log-softmax at its
    token and its top-n."""
    import inferd.engine.sampler as sampler

    g = torch.Generator().manual_seed(21)
    V = 4096
    logits = torch.randn(8, V, generator=g) * 5
    logits[5] = torch.randn(V, generator=g) * 0.01  # flat: a draw near 1 lands past the first candidates
    params = [SamplingParams(max_tokens=1, temperature=0, logprobs=3),
              SamplingParams(max_tokens=1, temperature=1.0, seed=1, logprobs=0),
              SamplingParams(max_tokens=1, temperature=0),
              SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9, seed=2, logprobs=5),
              SamplingParams(max_tokens=1, temperature=1.0, top_k=20, seed=3),
              SamplingParams(max_tokens=1, temperature=1.0, seed=4, logprobs=2),
              SamplingParams(max_tokens=1, temperature=0, logprobs=1),
              SamplingParams(max_tokens=1, temperature=1.3, seed=5)]
    positions = [7, 8, 9, 10, 11, 12, 13, 14]
    seeds = [p.seed or 0 for p in params]
    # the flat row's draw: chosen past its first candidates' mass
    mass = float(torch.topk(torch.softmax(logits[5], -1), SAMPLE_TOP_FIRST).values.sum())
    us = {i: sampler.uniform_draw(seeds[i], positions[i]) for i in range(8)}
    position = next(p for p in range(10_000) if sampler.uniform_draw(seeds[5], p) > mass + 1e-3)
    positions[5], us[5] = position, sampler.uniform_draw(seeds[5], position)

    redraws = []
    real = sampler.redraw
    monkeypatch.setattr(sampler, "redraw", lambda *a: redraws.append(sum(a[5])) or real(*a))
    raw = logits + 0.25 * torch.randn(8, V, generator=g)  # logprobs come from the raw logits
    tokens, logprobs = sampler.Sampler().sample(logits, params, seeds, positions, raw)
    # the flat row, and only it, took a second round (resolved there: the recursion's own redraw had none left)
    assert redraws[0] == 1 and not any(redraws[1:])
    lp = torch.log_softmax(raw, dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            assert tokens[i] == int(logits[i].argmax())
        else:
            assert tokens[i] == sample_rows(logits[i:i + 1], [p], [us[i]])[0]
        if p.logprobs is None:
            assert logprobs[i] is None
            continue
        assert logprobs[i].token_id == tokens[i] and logprobs[i].logprob == float(lp[i, tokens[i]])
        top_v, top_i = torch.topk(lp[i], p.logprobs)
        assert logprobs[i].top == list(zip(top_i.tolist(), top_v.tolist()))
