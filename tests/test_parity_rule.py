"""The exactness rule itself (tests/parity.py), on made-up rows whose numbers are known: what it accepts and what it
must refuse. The parity tests prove it on models (a wrong model fails: tests/engine/test_parity_tiny.py); these pin
each clause, so a rule loosened by accident (`make mutants` does it on purpose) fails here first."""

from __future__ import annotations

import pytest
import torch

from inferd.engine import SamplingParams
from inferd.engine.sampler import uniform_draw
from parity import BF16, FP32, assert_same_rows, assert_sampling_match, greedy_divergence, near_cdf_boundary

N = 16


def rows(n: int = N, gap: float = 1.0) -> list[torch.Tensor]:
    """n positions over a 4-token vocabulary at scale 1: token 0 leads token 1 by gap."""
    return [torch.tensor([1.0, 1.0 - gap, -0.5, -1.0]) for _ in range(n)]


def shifted(base: list[torch.Tensor], at: int, by: float) -> list[torch.Tensor]:
    out = [r.clone() for r in base]
    out[at][0] += by
    return out


def test_equal_rows_pass():
    ref = rows()
    assert assert_same_rows([0] * N, ref, [0] * N, ref) == N


def test_logits_beyond_the_bound_fail_even_when_every_token_matches():
    ref = rows()
    assert assert_same_rows([0] * N, shifted(ref, 5, 0.9e-5), [0] * N, ref) == N  # under 1e-5 at scale 1
    with pytest.raises(AssertionError, match="beyond the float32 bound"):
        assert_same_rows([0] * N, shifted(ref, 5, 2e-5), [0] * N, ref)


def test_the_bound_scales_with_the_row():
    ref = [r * 10 for r in rows()]  # scale 10: tolerance 1e-4
    assert assert_same_rows([0] * N, shifted(ref, 3, 5e-5), [0] * N, ref) == N
    with pytest.raises(AssertionError, match="beyond the float32 bound"):
        assert_same_rows([0] * N, shifted(ref, 3, 2e-4), [0] * N, ref)


def test_a_divergence_is_accepted_only_at_a_near_tie_under_the_bound():
    ours = [0] * 10 + [1] + [0] * (N - 11)
    near = rows(gap=5e-6)
    assert assert_same_rows(ours, near, [0] * N, near) == 10
    # every earlier position as far apart as the bound allows: the old rule's allowance (max(1e-3, 10x that)) would
    # have excused a gap of 5e-5; this one does not
    wide = rows(gap=5e-5)
    ours_rows = [r.clone() for r in wide]
    for r in ours_rows[:10]:
        r[0] += 0.9e-5
    with pytest.raises(AssertionError, match="no near-tie"):
        assert_same_rows(ours, ours_rows, [0] * N, wide)


def test_the_position_where_they_part_is_compared_too():
    ours = [0] * 10 + [1] + [0] * (N - 11)
    near = rows(gap=5e-6)
    with pytest.raises(AssertionError, match="beyond the float32 bound"):
        assert_same_rows(ours, shifted(near, 10, 1e-3), [0] * N, near)


def test_each_output_matches_a_minimum_first():
    near = rows(gap=5e-6)
    early = [0] * 3 + [1] + [0] * (N - 4)
    with pytest.raises(AssertionError, match="before the 8 positions"):
        assert_same_rows(early, near, [0] * N, near)
    assert assert_same_rows([0] * 8 + [1] * (N - 8), near, [0] * N, near) == 8
    assert assert_same_rows([1], near[:1], [0], near[:1], min_compared=0) == 0
    # shorter outputs: all of their positions are the minimum
    assert assert_same_rows([0] * 4, near, [0] * 4, near) == 4


def test_bf16_has_its_own_bound():
    ref = rows()
    assert assert_same_rows([0] * N, shifted(ref, 2, 3e-2), [0] * N, ref, bound=BF16) == N
    with pytest.raises(AssertionError, match="beyond the bfloat16 bound"):
        assert_same_rows([0] * N, shifted(ref, 2, 5e-2), [0] * N, ref, bound=BF16)
    assert FP32.rel < BF16.rel


def test_callbacks_are_required():
    with pytest.raises(TypeError):
        greedy_divergence([0], [0], lambda i: 1.0)  # no logits to compare: no rule


def two_token_logits(p0: float) -> torch.Tensor:
    return torch.log(torch.tensor([p0, 1.0 - p0]))


def test_seeded_sampling_parts_only_near_a_cdf_boundary():
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=3)
    start, n = 20, 16
    # two tokens, the likelier first: the CDF's one inner boundary is the likelier token's probability, so a position
    # whose draw u lies in (0.55, 0.75) can have that boundary put near u or far from it
    at = next(j for j in range(8, n) if 0.55 < uniform_draw(3, start + j) < 0.75)
    u = uniform_draw(3, start + at)
    near = [two_token_logits(0.5)] * n
    near[at] = two_token_logits(u + 2e-4)  # the boundary 2e-4 from the draw
    assert near_cdf_boundary(near[at], params, 3, start + at)
    a, b = [0] * n, [0] * at + [1] + [0] * (n - at - 1)
    zero = dict(diff_at=lambda i: 0.0)
    assert assert_sampling_match(a, b, near, params, 3, start, **zero) == at
    far = list(near)
    far[at] = two_token_logits(u + 0.2)
    with pytest.raises(AssertionError, match="far from any CDF boundary"):
        assert_sampling_match(a, b, far, params, 3, start, **zero)
    with pytest.raises(AssertionError, match="beyond the float32 bound"):
        assert_sampling_match(a, b, near, params, 3, start, diff_at=lambda i: 1e-3 if i == 4 else 0.0)
    k = next(j for j in range(8) if 0.55 < uniform_draw(3, start + j) < 0.75)  # an early position of that kind
    near_early = list(near)
    near_early[k] = two_token_logits(uniform_draw(3, start + k) + 2e-4)
    early = [0] * k + [1] + [0] * (n - k - 1)
    with pytest.raises(AssertionError, match="before 8 positions"):
        assert_sampling_match([0] * n, early, near_early, params, 3, start, **zero)
