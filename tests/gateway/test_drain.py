"""The drain rate behind admission control and Retry-After: work per second of busy time."""

from __future__ import annotations

import pytest

from inferd.gateway.admission import DrainRate


def test_nothing_to_go_on_until_busy_for_a_while():
    d = DrainRate(window=30.0)
    assert d.rate(100.0) is None  # idle
    d.busy(100.0)
    d.record(100.1, 50)
    d.record(100.2, 50)
    assert d.rate(100.3) is None  # under half a second
    d.record(100.6, 50)
    assert d.rate(101.0) == pytest.approx(150 / 1.0)


def test_idle_time_does_not_dilute_the_rate():
    """A light period, then idle, then saturation: the rate is that of the new busy period (its capacity), not
    the tokens of the last 30 s divided by 30 s (which would make admission refuse work it could do)."""
    d = DrainRate(window=30.0)
    d.busy(0.0)
    for t in range(1, 6):
        d.record(float(t), 10)
    d.idle()
    assert d.rate(20.0) is None
    d.busy(40.0)
    for i in range(1, 21):
        d.record(40.0 + i * 0.1, 100)  # 1,000 tokens/s
    assert d.rate(42.0) == pytest.approx(2000 / 2.0)


def test_the_window_slides_inside_a_long_busy_period():
    d = DrainRate(window=10.0)
    d.busy(0.0)
    for t in range(0, 10):
        d.record(float(t), 100)  # 100/s for 10 s
    for t in range(10, 20):
        d.record(float(t), 300)  # then 300/s
    assert d.rate(20.0) == pytest.approx(300 * 10 / 10.0)
