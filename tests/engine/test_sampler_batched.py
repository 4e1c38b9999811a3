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
