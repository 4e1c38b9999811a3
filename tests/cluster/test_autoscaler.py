"""The autoscaler's decision logic (inferd/cluster/autoscaler.py), driven by scripted observations: no processes, no
clock. Every expected count below is worked out by hand from the numbers in the comments."""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta, timezone

import pytest

from inferd.cluster.autoscaler import Autoscaler, AutoscalerConfig, Demand, WarmEntry, parse_warm_schedule, warm_floor

DAY = datetime(2025, 3, 10)  # a Monday, midnight, naive local time
NOON = DAY + timedelta(hours=12)  # no schedule in these tests cares about the wall time


def demand(arrival: float, queued: float = 0, kv: float = 0.0, current: int = 1) -> Demand:
    return Demand(arrival_tokens_per_s=arrival, queued_tokens=queued, kv_usage=kv, current_workers=current)


def config(**kw) -> AutoscalerConfig:
    # 400 tok/s per worker planned at 80%: 320 tok/s per worker
    base = dict(worker_capacity=400.0, min_workers=1, max_workers=8, target_utilization=0.8,
                scale_down_cooldown_s=300.0, queue_drain_s=10.0, kv_high_water=0.9)
    base.update(kw)
    return AutoscalerConfig(**base)


# (t seconds, arrival tok/s, expected desired). Need = ceil(arrival / 320), clamped to [1, 8].
RAMP = [
    (0, 100, 1),      # 0.31 -> 1
    (30, 500, 2),     # 1.56 -> 2: up at once
    (60, 1000, 4),    # 3.13 -> 4: up at once, skipping 3
    (90, 1834, 6),    # 5.73 -> 6
    (120, 1834, 6),
    (150, 200, 6),    # a 60 s dip to need 1 ...
    (180, 200, 6),
    (210, 1834, 6),   # ... never scales down
    (240, 1834, 6),
    (300, 1834, 6),
    (450, 1834, 6),   # 150 + 300: the dip would have ended its cool-down here, had it lasted
    (480, 1834, 6),
    (510, 900, 6),    # 2.81 -> 3: lower since 510
    (540, 900, 6),
    (600, 1200, 6),   # 3.75 -> 4, still lower than 6
    (630, 900, 6),    # 3 again (holds until the next sample at 780)
    (780, 900, 6),    # 780 < 510 + 300
    (809, 900, 6),
    (810, 900, 4),    # 510 + 300: the need stayed <= 4 (its peak in the window, at 600) for 300 s
    (840, 900, 4),
    (900, 900, 4),    # the 4 seen at 600 held until 630: 630 + 300 = 930
    (929, 900, 4),
    (930, 900, 3),
    (960, 0, 3),      # need 0 -> min_workers 1, after the cool-down
    (1230, 0, 3),
    (1259, 0, 3),
    (1260, 0, 1),     # 960 + 300
    (1500, 0, 1),
]


def test_scripted_ramp_up_steady_down():
    a = Autoscaler(config())
    got = []
    current = 1
    for t, arrival, _ in RAMP:
        current = a.observe(float(t), NOON + timedelta(seconds=t), demand(arrival, current=current))
        assert a.desired == current
        got.append((t, current))
    assert got == [(t, want) for t, _, want in RAMP]


def test_reasons_say_why():
    a = Autoscaler(config())
    a.observe(0.0, NOON, demand(1000))
    assert a.observe(10.0, NOON, demand(1834)) == 6
    assert a.reason == "demand 1834 tok/s / (400 tok/s x 0.8) = 5.73 -> 6; up from 4"
    a.observe(20.0, NOON, demand(900, current=6))
    assert "holding 6" in a.reason and "lower for 0 of 300 s" in a.reason
    a.observe(120.0, NOON, demand(900, current=6))
    assert "lower for 100 of 300 s" in a.reason
    assert a.observe(320.0, NOON, demand(900, current=6)) == 3
    assert "down from 6" in a.reason and "<= 3" in a.reason


def test_scale_up_during_cooldown_is_immediate_and_restarts_the_wait():
    a = Autoscaler(config())
    assert a.observe(0.0, NOON, demand(1834)) == 6
    assert a.observe(10.0, NOON, demand(900)) == 6  # 3, waiting
    assert a.observe(200.0, NOON, demand(900)) == 6
    assert a.observe(210.0, NOON, demand(2500)) == 8  # 7.81 -> 8 at once, mid-wait
    assert a.observe(220.0, NOON, demand(900)) == 8
    assert a.observe(310.0, NOON, demand(900)) == 8  # 10 + 300 would have ended the old wait
    assert a.observe(519.0, NOON, demand(900)) == 8
    assert a.observe(520.0, NOON, demand(900)) == 3  # 220 + 300


def test_cooldown_zero_scales_down_at_once():
    a = Autoscaler(config(scale_down_cooldown_s=0.0))
    assert a.observe(0.0, NOON, demand(1834)) == 6
    assert a.observe(0.0, NOON, demand(900)) == 3
    assert a.observe(1.0, NOON, demand(0)) == 1


def test_first_observation_holds_the_running_workers_for_a_cooldown():
    a = Autoscaler(config())
    assert a.observe(1000.0, NOON, demand(300, current=5)) == 5  # need 1, but 5 are running
    assert "holding the 5 running workers" in a.reason
    assert a.observe(1299.0, NOON, demand(300, current=5)) == 5
    assert a.observe(1300.0, NOON, demand(300, current=5)) == 1
    # more running than max_workers: the start is capped
    b = Autoscaler(config(max_workers=4))
    assert b.observe(0.0, NOON, demand(300, current=7)) == 4


def test_min_workers_floor_and_max_clamp():
    a = Autoscaler(config(min_workers=2))
    assert a.observe(0.0, NOON, demand(0)) == 2
    assert a.need == 0 and a.target == 2 and "min_workers 2" in a.reason
    assert a.observe(1.0, NOON, demand(10_000)) == 8  # 31.25 -> 32, capped
    assert a.need == 32 and "capped at max_workers 8" in a.reason
    assert a.observe(400.0, NOON, demand(0)) == 8  # the need of 32 held from 1 until now
    assert a.observe(699.0, NOON, demand(0)) == 8
    assert a.observe(700.0, NOON, demand(0)) == 2  # 400 + 300, and never under min_workers
    z = Autoscaler(config(min_workers=0))
    assert z.observe(0.0, NOON, demand(0, current=0)) == 0  # scale to zero when allowed


def test_exact_multiples_do_not_round_up_on_float_noise():
    a = Autoscaler(config())
    assert a.observe(0.0, NOON, demand(640)) == 2  # exactly 2.0
    assert a.observe(1.0, NOON, demand(641)) == 3
    b = Autoscaler(config(worker_capacity=0.1, target_utilization=1.0, min_workers=0))
    assert b.observe(0.0, NOON, demand(0.1 + 0.2, current=0)) == 3  # 3.0000000000000004 is 3


def test_queue_backlog_adds_workers():
    a = Autoscaler(config())
    assert a.observe(0.0, NOON, demand(320)) == 1  # exactly one worker's planned rate
    # 3200 queued tokens to serve within 10 s: +320 tok/s -> 640 / 320 = 2
    assert a.observe(1.0, NOON, demand(320, queued=3200)) == 2
    assert "3200 queued tok / 10 s = 640 tok/s" in a.reason
    # 20000 queued: +2000 -> 2320 / 320 = 7.25 -> 8
    assert a.observe(2.0, NOON, demand(320, queued=20_000)) == 8
    c = Autoscaler(config(queue_drain_s=40.0))
    assert c.observe(0.0, NOON, demand(320, queued=20_000)) == 3  # +500 -> 820 / 320 = 2.56 -> 3


def test_kv_high_water_adds_one_worker():
    a = Autoscaler(config())
    assert a.observe(0.0, NOON, demand(500, kv=0.95, current=2)) == 3  # need 2 <= 2 running, KV short: 2 + 1
    assert "KV 95% > 90% on 2 workers -> 3" in a.reason
    b = Autoscaler(config())
    assert b.observe(0.0, NOON, demand(500, kv=0.90, current=2)) == 2  # at the high water, not above it
    c = Autoscaler(config())
    assert c.observe(0.0, NOON, demand(1000, kv=0.95, current=2)) == 4  # need 4 > 2 running: compute already adds
    d = Autoscaler(config())
    d.observe(0.0, NOON, demand(500, current=5))  # need 2, 5 running (held at 5)
    assert d.observe(1.0, NOON, demand(500, kv=0.95, current=5)) == 6  # KV-bound: one more than running
    e = Autoscaler(config(max_workers=5))
    assert e.observe(0.0, NOON, demand(500, kv=0.95, current=5)) == 5  # capped


def test_kv_pressure_keeps_workers_through_the_cooldown():
    a = Autoscaler(config())
    assert a.observe(0.0, NOON, demand(300, kv=0.95, current=1)) == 2
    assert a.observe(100.0, NOON, demand(300, kv=0.5, current=2)) == 2
    assert a.observe(299.0, NOON, demand(300, kv=0.5, current=2)) == 2
    assert a.observe(300.0, NOON, demand(300, kv=0.5, current=2)) == 2  # 2 was asked for until 100
    assert a.observe(400.0, NOON, demand(300, kv=0.5, current=2)) == 1


def at(hh: int, mm: int, ss: int = 0, day: int = 0) -> datetime:
    return DAY + timedelta(days=day, hours=hh, minutes=mm, seconds=ss)


def test_warm_schedule_raises_the_floor_ahead_of_the_ramp():
    # floor 4 from 07:30 to 19:00, read 30 min ahead; demand needs 1 all along
    a = Autoscaler(config(warm_schedule="07:30=4,19:00=0", warm_lead_s=1800))
    t0 = at(6, 0)
    samples = [  # (wall, expected)
        (at(6, 0), 1),          # 06:30 ahead: the 19:00=0 entry of the day before
        (at(6, 59, 59), 1),     # 07:29:59 ahead
        (at(7, 0), 4),          # 07:30 ahead: up at once, 30 min before the ramp
        (at(7, 30), 4),
        (at(12, 0), 4),
        (at(18, 29, 59), 4),
        (at(18, 30), 4),        # 19:00 ahead: the floor is gone, the cool-down starts
        (at(18, 34, 59), 4),
        (at(18, 35), 1),        # 300 s later
        (at(23, 59), 1),
        (at(6, 59, 59, day=1), 1),
        (at(7, 0, day=1), 4),   # the next morning again
    ]
    got = [(w, a.observe((w - t0).total_seconds(), w, demand(100))) for w, _ in samples]
    assert got == samples
    assert a.floor_entry == WarmEntry(time(7, 30), 4)
    assert "schedule floor 4 (07:30=4, 1800 s ahead)" in a.reason


def test_warm_schedule_floor_adds_to_demand_not_below_it():
    a = Autoscaler(config(warm_schedule="07:30=4"))
    assert a.observe(0.0, at(8, 0), demand(100)) == 4  # floor
    assert a.observe(1.0, at(8, 0), demand(1834)) == 6  # demand above the floor wins
    b = Autoscaler(config(min_workers=3, warm_schedule="07:30=2"))
    assert b.observe(0.0, at(8, 0), demand(0)) == 3  # min_workers above the floor wins


def test_warm_floor_wraps_around_midnight():
    s = parse_warm_schedule("00:10=3,06:00=1")
    assert warm_floor(s, at(0, 5)) == WarmEntry(time(6, 0), 1)  # before the first entry: yesterday's last
    assert warm_floor(s, at(0, 10)) == WarmEntry(time(0, 10), 3)
    assert warm_floor(s, at(5, 59)) == WarmEntry(time(0, 10), 3)
    assert warm_floor(s, at(6, 0)) == WarmEntry(time(6, 0), 1)
    assert warm_floor(s, at(23, 59)) == WarmEntry(time(6, 0), 1)
    # with a lead, the late evening already reads the next day's 00:10 entry
    assert warm_floor(s, at(23, 35), lead_s=1800) == WarmEntry(time(6, 0), 1)  # 00:05 ahead
    assert warm_floor(s, at(23, 40), lead_s=1800) == WarmEntry(time(0, 10), 3)  # 00:10 ahead
    assert warm_floor(s, at(23, 45), lead_s=1800) == WarmEntry(time(0, 10), 3)
    # one entry: its floor holds all day; none: no floor
    one = parse_warm_schedule("07:30=4")
    assert [warm_floor(one, at(h, 0)).workers for h in (0, 3, 7, 8, 23)] == [4, 4, 4, 4, 4]
    assert warm_floor([], at(8, 0)) is None


def test_warm_floor_reads_the_wall_clock_of_the_time_zone_given():
    s = parse_warm_schedule("07:30=4,19:00=0")
    tz = timezone(timedelta(hours=-5))
    assert warm_floor(s, datetime(2025, 3, 10, 7, 45, tzinfo=tz)).workers == 4
    assert warm_floor(s, datetime(2025, 3, 10, 6, 0, tzinfo=tz)).workers == 0
    assert warm_floor(s, datetime(2025, 3, 10, 6, 0, tzinfo=tz).astimezone(UTC)).workers == 4  # 11:00 UTC


def test_midnight_wrap_through_the_autoscaler():
    # a night batch at 00:10 (floor 3), warm 30 min ahead: the floor rises at 23:40 the day before
    a = Autoscaler(config(warm_schedule="00:10=3,06:00=0", warm_lead_s=1800))
    t0 = at(23, 0)
    seq = [(at(23, 0), 1), (at(23, 39), 1), (at(23, 40), 3), (at(0, 0, day=1), 3), (at(5, 29, day=1), 3),
           (at(5, 30, day=1), 3), (at(5, 35, day=1), 1)]
    got = [(w, a.observe((w - t0).total_seconds(), w, demand(0))) for w, _ in seq]
    assert got == seq


def test_parse_warm_schedule():
    assert parse_warm_schedule("07:30=4,18:00=2") == [WarmEntry(time(7, 30), 4), WarmEntry(time(18, 0), 2)]
    assert parse_warm_schedule(" 18:00=2 , 7:30=4 ") == [WarmEntry(time(7, 30), 4), WarmEntry(time(18, 0), 2)]
    assert parse_warm_schedule("00:00=0,23:59=8") == [WarmEntry(time(0, 0), 0), WarmEntry(time(23, 59), 8)]
    assert parse_warm_schedule("") == [] and parse_warm_schedule("  ") == []
    assert str(WarmEntry(time(7, 5), 2)) == "07:05=2"


@pytest.mark.parametrize("text, message", [
    ("25:00=1", "bad time '25:00'"),
    ("24:00=1", "bad time '24:00'"),
    ("07:60=1", "bad time '07:60'"),
    ("0730=4", "bad time '0730'"),
    ("7.30=4", "bad time '7.30'"),
    ("07:30", "expected HH:MM=N"),
    ("07:30=-1", "negative worker count"),
    ("07:30=x", "'x' is not a whole number"),
    ("07:30=1.5", "'1.5' is not a whole number"),
    ("07:30=", "'' is not a whole number"),
    ("07:30=4,07:30=2", "07:30 is given twice"),
    ("07:30=4,7:30=4", "07:30 is given twice"),
    ("07:30=4,", "empty entry"),
])
def test_parse_warm_schedule_errors(text, message):
    with pytest.raises(ValueError, match="warm schedule") as e:
        parse_warm_schedule(text)
    assert message in str(e.value)


def test_config_validation():
    assert config(warm_schedule=[(time(18, 0), 2), WarmEntry(time(7, 30), 4)]).warm_schedule == [
        WarmEntry(time(7, 30), 4), WarmEntry(time(18, 0), 2)]
    for bad, message in [
        (dict(worker_capacity=0), "worker_capacity must be > 0"),
        (dict(worker_capacity=float("nan")), "worker_capacity must be a finite number"),
        (dict(min_workers=5, max_workers=4), "max_workers (4) must be >= 1 and >= min_workers (5)"),
        (dict(max_workers=0, min_workers=0), "max_workers (0)"),
        (dict(min_workers=-1), "min_workers must be a whole number >= 0"),
        (dict(target_utilization=0), "target_utilization must be > 0 and <= 1"),
        (dict(target_utilization=1.2), "target_utilization must be > 0 and <= 1"),
        (dict(scale_down_cooldown_s=-1), "scale_down_cooldown_s must be >= 0"),
        (dict(queue_drain_s=0), "queue_drain_s must be > 0"),
        (dict(kv_high_water=1.5), "kv_high_water must be > 0 and <= 1"),
        (dict(warm_lead_s=-5), "warm_lead_s must be >= 0"),
        (dict(warm_schedule="07:30=9"), "07:30=9 asks for more workers than max_workers (8)"),
        (dict(warm_schedule=[(time(7, 30), -1)]), "negative worker count"),
        (dict(warm_schedule=[(time(7, 30), 1), (time(7, 30), 2)]), "07:30 is given twice"),
    ]:
        with pytest.raises(ValueError) as e:
            config(**bad)
        assert message in str(e.value), (bad, str(e.value))


def test_demand_validation_and_clock():
    for kw, message in [(dict(arrival=-1), "arrival_tokens_per_s"), (dict(arrival=float("nan")), "arrival"),
                        (dict(arrival=1, queued=-5), "queued_tokens"), (dict(arrival=1, kv=1.2), "kv_usage"),
                        (dict(arrival=1, current=-1), "current_workers")]:
        with pytest.raises(ValueError, match=message):
            demand(**kw)
    a = Autoscaler(config())
    a.observe(10.0, NOON, demand(100))
    a.observe(10.0, NOON, demand(100))  # the same instant is fine
    with pytest.raises(ValueError, match="went back"):
        a.observe(9.0, NOON, demand(100))
