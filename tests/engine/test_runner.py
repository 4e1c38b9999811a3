"""ModelRunner helpers: decode rows grouped by context length."""

from __future__ import annotations

import random

from inferd.engine.runner import split_by_length


def test_split_by_length_covers_rows_and_bounds_padding():
    rng = random.Random(5)
    for _ in range(200):
        lens = sorted(rng.randint(1, 600) for _ in range(rng.randint(1, 80)))
        groups = split_by_length(lens, 16, max_waste=0.25)
        assert groups[0][0] == 0 and groups[-1][1] == len(lens)
        assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))  # contiguous, no gaps or overlaps
        for lo, hi in groups:
            blocks = [-(-n // 16) for n in lens[lo:hi]]
            if hi - lo > 1:
                assert max(blocks) * (hi - lo) <= 1.25 * sum(blocks)


def test_split_by_length_keeps_similar_lengths_together():
    assert split_by_length([100] * 10, 16) == [(0, 10)]
    assert split_by_length([16, 16, 400, 400], 16) == [(0, 2), (2, 4)]
    assert split_by_length([], 16) == []
