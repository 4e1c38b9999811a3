"""The capacity planner (`inferd plan`), on a synthetic profile whose every step takes 0.1 s, so that the answers can
be worked out by hand: with max_num_seqs 1, a request of a 10-token prompt and 10 output tokens takes one prefill
step (its first token at 0.1 s) and 9 decode steps: 1.0 s of a worker, and a worker serves at most 1 request/s."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace
from datetime import datetime

import pytest

from inferd.cli.plan import add_plan_arguments
from inferd.cluster.autoscaler import Autoscaler, AutoscalerConfig
from inferd.engine.tier_shares import TierShares
from inferd.planner.plan import (
    HOUR,
    Traffic,
    figures,
    hourly_need,
    parse_slo,
    percentile,
    read_traffic,
    run_autoscaler,
    run_fixed,
    tier_targets,
    worker_capacity,
)
from inferd.planner.report import cmd_plan, make_plan, tiers_paragraph
from inferd.planner.sim import Req, Simulation, StepModel, WorkerConfig

FLAT = StepModel({(1, 1): 0.1, (64, 1): 0.1, (1, 100000): 0.1, (64, 100000): 0.1}, {1: 0.1, 100000: 0.1})
ONE_AT_A_TIME = WorkerConfig(max_num_seqs=1, max_num_batched_tokens=256, worker_queue_depth=4, kv_tokens=10000)
SLO = parse_slo("ttft_p99=500ms")


def write_profile(path) -> None:
    points = [{"kind": "decode", "batch": b, "context": c, "step_s": 0.1} for b in (1, 64) for c in (1, 100000)]
    points += [{"kind": "prefill", "batch": 1, "context": n, "step_s": 0.1} for n in (1, 100000)]
    path.write_text(json.dumps({"model": "synthetic", "points": points}))


def hours_csv(path, rates: dict[int, float]) -> None:
    path.write_text("hour,requests_per_s,prompt_tokens,output_tokens\n" +
                    "".join(f"{h},{r},10,10\n" for h, r in rates.items()))


def test_one_request_by_hand():
    r = Req(0.0, 10, 10)
    Simulation(FLAT, ONE_AT_A_TIME, [r], workers=1).run()
    assert r.first_token == pytest.approx(0.1) and r.done == pytest.approx(1.0)
    assert r.tpot == pytest.approx(0.1)


def test_a_constant_load_needs_exactly_two_workers(tmp_path):
    # 1.5 requests/s evenly spaced (every 2/3 s): one worker serves 1/s, so its line grows without bound over the
    # hour; two workers take turns (each gets one every 4/3 s and is done in 1 s), so every first token comes 0.1 s
    # after its arrival
    hours_csv(tmp_path / "day.csv", {0: 1.5})
    traffic = read_traffic(tmp_path / "day.csv")
    need = hourly_need(FLAT, ONE_AT_A_TIME, traffic, SLO, seed=0, uniform=True, max_workers=8)
    assert need == [2] + [0] * 23
    two = run_fixed(FLAT, ONE_AT_A_TIME, traffic.requests(0, uniform=True), 2)
    assert len(two.requests) == 5400 and all(r.ttft == pytest.approx(0.1) for r in two.requests)
    assert two.worker_hours == pytest.approx(48.0)  # two workers billed all day
    one = run_fixed(FLAT, ONE_AT_A_TIME, traffic.requests(0, uniform=True), 1)
    # one worker: request i starts when the i requests before it are done (1 s each), not at i * 2/3 s
    last = one.requests[-1]
    assert last.ttft == pytest.approx(5399 * 1.0 + 0.1 - 5399 / 1.5, rel=1e-6)


def test_a_ramp_needs_one_two_three_workers(tmp_path):
    # 0.5/s: one worker, idle half the time; 1.5/s: two (above); 2.5/s: two would each get 1.25/s > 1/s, three
    # each get one every 1.2 s
    hours_csv(tmp_path / "day.csv", {0: 0.5, 1: 1.5, 2: 2.5, 3: 0.0})
    need = hourly_need(FLAT, ONE_AT_A_TIME, read_traffic(tmp_path / "day.csv"), SLO, seed=0, uniform=True,
                       max_workers=8)
    assert need[:4] == [1, 2, 3, 0]
    # and when even the most workers cannot, the answer says so (None)
    assert hourly_need(FLAT, ONE_AT_A_TIME, read_traffic(tmp_path / "day.csv"), SLO, 0, True, max_workers=2)[2] is None


def test_the_autoscaler_replay_is_the_autoscalers_own_decisions(tmp_path):
    # capacity 20 tokens/s at utilisation 1.0 = one request (20 tokens) per second per worker: hour 1 at 2.5/s
    # (50 tokens/s) needs 3; the cool-down (600 s) holds them into the quiet hour 2, then it drops to 1
    hours_csv(tmp_path / "day.csv", {0: 0.5, 1: 2.5, 2: 0.2})
    traffic = read_traffic(tmp_path / "day.csv")
    config = AutoscalerConfig(worker_capacity=20, target_utilization=1.0, min_workers=1, max_workers=6,
                              scale_down_cooldown_s=600, warm_schedule="02:30=2,02:45=0")
    run = run_autoscaler(FLAT, ONE_AT_A_TIME, traffic.requests(0, uniform=True), config, start_delay_s=5.0,
                         day=datetime(2026, 1, 1), until=3 * HOUR)
    replay = Autoscaler(config)
    assert [replay.observe(t, wall, demand) for t, wall, demand, _ in run.decisions] == \
        [desired for *_, desired in run.decisions]
    desired = {int(t): d for t, _, _, d in run.decisions}
    # (the ramp's first seconds may ask for more: the line that builds on one worker counts as demand too)
    assert desired[1800] == 1 and desired[HOUR_S(1.5)] == 3  # mid hour 0: one; mid hour 1: three
    assert desired[HOUR_S(2) + 300] == 3  # within the cool-down after the load fell
    assert desired[HOUR_S(2) + 900] == 1  # after it
    assert desired[HOUR_S(2.5) + 60] == 2  # the warm schedule's floor from 02:30, at once
    assert desired[HOUR_S(2.75) + 60] == 2  # its end lowers the need: the cool-down again
    assert desired[HOUR_S(2.75) + 660] == 1
    # the fleet followed (each new worker serving 5 s after its start) and every request was served
    sizes = [n for t, n in run.fleet_log if t <= HOUR_S(1.5)]
    assert sizes[-1] == 3
    assert all(r.done is not None for r in run.requests)


def HOUR_S(hours: float) -> int:
    return int(hours * HOUR)


def test_kv_pressure_preempts_and_every_request_still_completes():
    config = WorkerConfig(max_num_seqs=8, max_num_batched_tokens=64, worker_queue_depth=0, kv_tokens=120)
    reqs = [Req(0.01 * i, 30, 40) for i in range(8)]
    sim = Simulation(FLAT, config, reqs, workers=1)
    sim.run()
    assert sim.workers[0].preemptions > 0
    assert all(r.done is not None and r.generated == 40 for r in reqs)
    assert sim.workers[0].kv_used == 0  # nothing left held


def test_step_model_interpolates_the_profile():
    m = StepModel.load("docs/profile/bf16/profile.json")
    points = {(p["batch"], p["context"]): p["step_s"] for p in json.load(open("docs/profile/bf16/profile.json"))[
        "points"] if p["kind"] == "decode"}
    assert m.decode(4, 128) == pytest.approx(points[(4, 128)])
    assert m.decode(6, 128) == pytest.approx((points[(4, 128)] + points[(8, 128)]) / 2)
    assert m.decode(4, 320) == pytest.approx((points[(4, 128)] + points[(4, 512)]) / 2)
    assert m.step(0, 0, 64) == pytest.approx(0.0671, abs=1e-4)  # the measured 64-token prefill
    assert m.step(8, 128, 64) == pytest.approx(points[(8, 128)] + 0.0671 - points[(1, 128)], abs=1e-4)


def test_bad_inputs_are_refused(tmp_path):
    for text in ("", "ttft=2s", "ttft_p99=fast", "latency_p99=2s", "ttft_p100=1s"):
        with pytest.raises(ValueError):
            parse_slo(text)
    assert [str(t) for t in parse_slo("ttft_p99=2s, tpot_p50=50ms")] == ["ttft_p99=2.00s", "tpot_p50=50ms"]
    (tmp_path / "bad.csv").write_text("when,rate\n1,2\n")
    with pytest.raises(ValueError, match="header"):
        read_traffic(tmp_path / "bad.csv")
    (tmp_path / "hours.csv").write_text("hour,requests_per_s,prompt_tokens,output_tokens\n25,1,10,10\n")
    with pytest.raises(ValueError, match="line 2"):
        read_traffic(tmp_path / "hours.csv")
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and percentile([], 99) is None


def test_trace_input_and_the_command_line(tmp_path):
    write_profile(tmp_path / "profile.json")
    # a trace: 3 requests at 00:00:00-00:00:02 and 3 at 01:00:00-01:00:02
    (tmp_path / "trace.csv").write_text("t,prompt_tokens,output_tokens\n" +
                                        "".join(f"{h * 3600 + i},10,10\n" for h in (0, 1) for i in range(3)))
    traffic = read_traffic(tmp_path / "trace.csv")
    assert [round(r.t) for r in traffic.requests(0)] == [0, 1, 2, 3600, 3601, 3602]
    assert Traffic(trace=traffic.trace).hourly()[1] == (1, 3 / 3600, 60 / 3600)
    out = tmp_path / "plan"
    proc = subprocess.run([sys.executable, "-m", "inferd", "plan", "--traffic", str(tmp_path / "trace.csv"),
                           "--slo", "ttft_p99=500ms,tpot_p50=200ms", "--profile", str(tmp_path / "profile.json"),
                           "--cost-per-worker-hour", "3.5", "--max-num-seqs", "1", "--worker-capacity", "20",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "| fixed 1 | 24.0 | 84.00 | 2/2 |" in proc.stdout  # one worker all day, both busy hours met
    result = json.loads((out / "plan.json").read_text())
    assert result["need"][:2] == [1, 1] and result["fixed_workers"] == 1
    for png in ("load_and_workers.png", "latency.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run([sys.executable, "-m", "inferd", "plan", "--traffic", str(tmp_path / "trace.csv"),
                          "--slo", "ttft=fast", "--profile", str(tmp_path / "profile.json")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "SLO entry" in bad.stderr


def test_runs_of_decode_steps_taken_in_one_jump_equal_step_by_step():
    # the simulator takes a run of decode-only steps as one event and cuts it short when work is sent to that worker;
    # on the measured (non-flat) profile every request must see the same times as when every step is its own event
    # (two workers at 4 req/s for 5 minutes: arrivals land mid-run on both; then a KV cache small enough to preempt)
    import random

    model = StepModel.load("docs/profile/bf16/profile.json")
    rng = random.Random(7)
    arrivals, t = [], 0.0
    while t < 300:
        t += rng.expovariate(4.0)
        arrivals.append((t, rng.randint(20, 300), rng.randint(5, 120)))
    for config, workers in ((WorkerConfig(), 2), (WorkerConfig(max_num_seqs=16, max_num_batched_tokens=128,
                                                               worker_queue_depth=2, kv_tokens=2000), 1)):
        runs = []
        for jumps in (True, False):
            reqs = [Req(*a) for a in arrivals]
            sim = Simulation(model, config, reqs, workers=workers, jumps=jumps)
            sim.run()
            runs.append((reqs, sum(w.busy_s for w in sim.workers), sum(w.steps for w in sim.workers)))
        (jumped, busy_j, steps_j), (stepped, busy_s, steps_s) = runs
        assert steps_j == steps_s and busy_j == pytest.approx(busy_s, rel=1e-9)
        for a, b in zip(jumped, stepped):
            assert a.first_token == pytest.approx(b.first_token, rel=1e-9, abs=1e-9)
            assert a.done == pytest.approx(b.done, rel=1e-9, abs=1e-9)


def test_requests_larger_than_the_kv_cache_are_refused_and_the_rest_served():
    # a 100-token cache: the engine refuses a request whose prompt + output can never fit it (Engine.validate checks
    # prompt + max_tokens against the whole pool), whether the prompt alone is too long or only its output overflows;
    # one that exactly fills the cache runs. A refused request takes no worker time and blocks no one behind it.
    config = WorkerConfig(max_num_seqs=4, max_num_batched_tokens=64, worker_queue_depth=4, kv_tokens=100)
    for jumps in (True, False):
        fits, prompt_too_long, output_overflows, exactly, after = (
            Req(0.0, 10, 10), Req(0.01, 500, 10), Req(0.02, 50, 60), Req(0.03, 60, 40), Req(0.04, 10, 10))
        reqs = [fits, prompt_too_long, output_overflows, exactly, after]
        sim = Simulation(FLAT, config, reqs, workers=1, jumps=jumps)
        sim.run()
        for r in (fits, exactly, after):
            assert r.done is not None and r.generated == r.output
        assert sim.refused == [prompt_too_long, output_overflows]
        assert [r.refused for r in reqs] == [False, True, True, False, False]
        for r in (prompt_too_long, output_overflows):
            assert r.first_token is None and r.done is None and r.generated == 0
        assert sim.workers[0].kv_used == 0
        f = figures(reqs, SLO)
        assert f["requests"] == 3 and f["refused"] == 2 and f["ttft_p99"] is not None


def test_capacity_is_not_searched_for_requests_that_never_fit():
    with pytest.raises(ValueError, match="larger than the KV cache"):
        worker_capacity(FLAT, WorkerConfig(kv_tokens=100), SLO, prompt=90, output=20, seed=0)


def plan_cli(tmp_path, traffic, *extra, name="plan"):
    write_profile(tmp_path / "profile.json")
    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "inferd", "plan", "--traffic", str(traffic), "--slo", "ttft_p99=500ms",
                           "--profile", str(tmp_path / "profile.json"), "--max-num-seqs", "1", "--worker-capacity",
                           "20", "--out", str(out), *extra], capture_output=True, text=True, timeout=120)
    return proc, out


def test_the_plan_reports_requests_larger_than_the_kv_cache(tmp_path):
    # a trace of 4 requests at 00:00:00-00:00:03 against a 100-token cache: one whose prompt alone is too long, one
    # whose output overflows; the other two are served and measured
    trace = tmp_path / "trace.csv"
    trace.write_text("t,prompt_tokens,output_tokens\n0,10,10\n1,500,10\n2,10,10\n3,50,100\n")
    proc, out = plan_cli(tmp_path, trace, "--kv-tokens", "100")
    assert proc.returncode == 0, proc.stderr
    assert "**2 of the day's 4 requests (50.0%) can never run**" in proc.stdout
    assert "up to 510 tokens) is more than the KV cache (100 tokens)" in proc.stdout
    assert "| 00 | 0.00 | 0 | 1 | 2 | 1.0, 100ms, yes |" in proc.stdout  # the hour's row: 2 refused, 2 served in time
    result = json.loads((out / "plan.json").read_text())
    assert result["requests"] == 4 and result["refused"] == 2 and result["refused_per_hour"][:2] == [2, 0]
    assert result["summary"][0]["hours_meeting_slo"] == 1 and result["summary"][0]["within_ttft"] == 1.0
    assert (out / "latency.png").read_bytes()[:4] == b"\x89PNG"


def test_a_day_with_nothing_to_serve_is_a_plan_that_says_so(tmp_path):
    # every hour at 0 req/s, a trace of only its header, and a day whose every request is larger than the cache: no
    # hour needs a worker (no simulation, no division by the number of requests)
    zero = tmp_path / "zero.csv"
    hours_csv(zero, {h: 0.0 for h in range(24)})
    empty = tmp_path / "empty.csv"
    empty.write_text("t,prompt_tokens,output_tokens\n")
    too_big = tmp_path / "too_big.csv"
    too_big.write_text("t,prompt_tokens,output_tokens\n5,500,1\n3605,99,2\n")
    for traffic, why in ((zero, "The traffic has no requests"), (empty, "The traffic has no requests"),
                         (too_big, "Every one of the day's 2 requests is larger than the KV cache")):
        proc, out = plan_cli(tmp_path, traffic, "--kv-tokens", "100", "--min-workers", "2", name=traffic.stem)
        assert proc.returncode == 0, proc.stderr
        assert f"{why}: no hour needs a worker" in proc.stdout
        assert "--min-workers 2 (48 worker-hours, 48.00 at 1 per worker-hour)" in proc.stdout
        result = json.loads((out / "plan.json").read_text())
        assert result["need"] == [0] * 24 and result["summary"] == []
        assert result["refused"] == (2 if traffic is too_big else 0)
    assert result["refused_per_hour"][:2] == [1, 1] and result["largest_refused_tokens"] == 501


# ---- tiers (issue 29): capacity shares between interactive, standard and batch ------------------------------------
SHARED = WorkerConfig(max_num_seqs=20, max_num_batched_tokens=256, worker_queue_depth=4, kv_tokens=100000)
INTERACTIVE, STANDARD, BATCH = range(3)


def with_shares(config: WorkerConfig, shares: str) -> WorkerConfig:
    return replace(config, tier_shares=TierShares.parse(shares))


def backlog(counts: dict[int, int], shares: str = "interactive=70,standard=25,batch=5", config=SHARED, output=10):
    """counts[tier] requests of each tier, all at t=0 (interleaved), on one worker; run to the end."""
    order = [t for i in range(max(counts.values())) for t in counts if i < counts[t]]
    reqs = [Req(0.0, 10, output, tier=t) for t in order]
    sim = Simulation(FLAT, with_shares(config, shares), reqs, workers=1)
    sim.run()
    assert all(r.done is not None for r in reqs)
    return reqs, sim


def token_shares(reqs, until: float) -> list[float]:
    """Each tier's share of the output tokens of the requests done by `until` (every tier still backlogged then)."""
    tokens = [sum(r.output for r in reqs if r.tier == t and r.done <= until) for t in range(3)]
    return [n / sum(tokens) for n in tokens]


def test_three_backlogged_tiers_get_their_shares_of_one_worker():
    # 600 requests of each tier at once; 20 seats, 20 requests/s in all: over the first 20 s no tier runs dry, and
    # the seats go 14/5/1 (D'Hondt), so the tokens 70/25/5
    reqs, sim = backlog({INTERACTIVE: 600, STANDARD: 600, BATCH: 600})
    shares = token_shares(reqs, until=20.0)
    for got, want in zip(shares, (0.70, 0.25, 0.05)):
        assert abs(got - want) < 0.10, shares
    assert shares[BATCH] > 0.02  # batch is never starved
    # another split of the same day follows the flag
    reqs, _ = backlog({INTERACTIVE: 600, STANDARD: 600, BATCH: 600}, shares="interactive=40,standard=40,batch=20")
    for got, want in zip(token_shares(reqs, until=20.0), (0.40, 0.40, 0.20)):
        assert abs(got - want) < 0.10


def test_two_backlogged_tiers_the_idle_tiers_share_goes_to_the_busier():
    # standard idle: its 25% is lent; batch keeps its own 5% (1 seat of 20), interactive takes the rest
    reqs, _ = backlog({INTERACTIVE: 600, BATCH: 600})
    shares = token_shares(reqs, until=20.0)
    assert shares[STANDARD] == 0 and abs(shares[BATCH] - 0.05) < 0.03 and shares[INTERACTIVE] > 0.9, shares
    # batch alone first, holding every seat with long requests; interactive arriving later reclaims its 14 seats at
    # once (the newest batch requests preempted) instead of waiting for batch requests to finish (200 steps each)
    config = with_shares(SHARED, "interactive=70,standard=25,batch=5")
    batch = [Req(0.0, 10, 200, tier=BATCH) for _ in range(40)]
    interactive = [Req(5.0, 10, 10, tier=INTERACTIVE) for _ in range(14)]
    sim = Simulation(FLAT, config, batch + interactive, workers=1)
    sim.run()
    assert max(r.ttft for r in interactive) < 0.5
    assert sim.workers[0].preemptions >= 14
    assert all(r.done is not None and r.generated == r.output for r in batch + interactive)


def test_one_tier_alone_gets_every_seat():
    # whatever its share, a tier alone is served as a day of one tier always was: the same times as the same
    # requests all standard, under shares and strict alike
    same = [Req(0.0, 10, 10) for _ in range(100)]
    Simulation(FLAT, SHARED, same, workers=1).run()
    for shares in ("interactive=70,standard=25,batch=5", "strict"):
        reqs, sim = backlog({BATCH: 100}, shares=shares)
        assert [(r.first_token, r.done) for r in reqs] == [(r.first_token, r.done) for r in same]
        assert sim.workers[0].preemptions == 0
    assert sum(r.first_token <= 0.2 + 1e-9 for r in same) == 20  # all 20 seats: the first step, then 19 more


def test_strict_serves_interactive_before_standard():
    # strict: interactive takes every seat (standard's running ones preempted) until it has nothing left; with
    # shares, standard keeps a quarter of the seats meanwhile
    standard = [Req(0.0, 10, 10, tier=STANDARD) for _ in range(100)]
    interactive = [Req(0.05, 10, 10, tier=INTERACTIVE) for _ in range(300)]
    Simulation(FLAT, with_shares(SHARED, "strict"), standard + interactive, workers=1).run()
    assert min(r.done for r in standard) > max(r.done for r in interactive)
    standard = [Req(0.0, 10, 10, tier=STANDARD) for _ in range(100)]
    interactive = [Req(0.05, 10, 10, tier=INTERACTIVE) for _ in range(300)]
    Simulation(FLAT, with_shares(SHARED, "interactive=70,standard=25,batch=5"), standard + interactive,
               workers=1).run()
    last = max(r.done for r in interactive)
    done = sum(r.done < last for r in standard)
    assert 0.2 < done / (done + len(interactive)) < 0.35  # ~25/(70+25) of the requests done meanwhile


def test_a_tier_held_back_prefills_at_its_share_of_the_token_budget():
    # an interactive request decoding for a while; a batch prompt of 320 tokens beside it gets max(5% of 256, 32) =
    # 32 prompt tokens a step (10 steps); strict does not cap it (255 + 65 tokens: 2 steps)
    for shares, steps in (("interactive=70,standard=25,batch=5", 10), ("strict", 2)):
        long = Req(0.0, 10, 100, tier=INTERACTIVE)
        prompt = Req(0.05, 320, 2, tier=BATCH)
        Simulation(FLAT, with_shares(SHARED, shares), [long, prompt], workers=1).run()
        assert prompt.first_token == pytest.approx(0.1 + steps * 0.1), shares


def test_runs_of_decode_steps_with_tiers_equal_step_by_step():
    # the jump over decode-only steps with three tiers, shares and strict, a small token budget (prompt caps) and a
    # small KV cache (KV preemptions beside the reclaimed seats): the same times as one event per step
    import random

    model = StepModel.load("docs/profile/bf16/profile.json")
    rng = random.Random(3)
    arrivals, t = [], 0.0
    while t < 120:
        t += rng.expovariate(4.0)
        arrivals.append((t, rng.randint(20, 300), rng.randint(5, 120), rng.randrange(3)))
    for shares in ("interactive=70,standard=25,batch=5", "strict"):
        config = with_shares(WorkerConfig(max_num_seqs=8, max_num_batched_tokens=128, worker_queue_depth=2,
                                          kv_tokens=2000), shares)
        runs = []
        for jumps in (True, False):
            reqs = [Req(t, p, o, tier=tier) for t, p, o, tier in arrivals]
            sim = Simulation(model, config, reqs, workers=2, jumps=jumps)
            sim.run()
            runs.append((reqs, sum(w.steps for w in sim.workers), sum(w.preemptions for w in sim.workers)))
        (jumped, steps_j, pre_j), (stepped, steps_s, pre_s) = runs
        assert steps_j == steps_s and pre_j == pre_s > 0
        for a, b in zip(jumped, stepped):
            assert a.first_token == pytest.approx(b.first_token, rel=1e-9, abs=1e-9)
            assert a.done == pytest.approx(b.done, rel=1e-9, abs=1e-9)


def plan_args(tmp_path, traffic, *extra, slo="ttft_p99=500ms") -> argparse.Namespace:
    """`inferd plan`'s command line, parsed by its own parser, on the synthetic profile."""
    write_profile(tmp_path / "profile.json")
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(["--traffic", str(traffic), "--slo", slo, "--profile", str(tmp_path / "profile.json"),
                              "--max-num-seqs", "1", "--worker-capacity", "20", "--out", str(tmp_path / "plan"),
                              *extra])


def test_a_mixed_tier_day_is_planned_per_tier(tmp_path):
    # hour 0: 10 batch requests at 0..9 s and 5 interactive at 0, 2, .. 8 s on one worker of one seat (1 request/s):
    # interactive takes the seat whenever it waits (at most one batch request, 1 s, ahead of it), batch waits
    # behind the backlog: interactive meets 1.5s, batch does not
    trace = tmp_path / "trace.csv"
    trace.write_text("t,prompt_tokens,output_tokens,tier\n" + "".join(f"{i},10,10,batch\n" for i in range(10)) +
                     "".join(f"{i}.5,10,10,interactive\n" for i in range(0, 10, 2)))
    # (the plan as `inferd plan` makes it, in this process and without its plots: they take a second)
    result, text = make_plan(plan_args(tmp_path, trace, "--workers", "1", "--max-workers", "2",
                                       slo="interactive:ttft_p99=1.5s,batch:ttft_p99=1.5s,e2e_p99=1h"))
    assert "Tiers: interactive, batch, served with capacity shares interactive=70,standard=25,batch=5" in text
    assert "interactive: e2e_p99=3600.00s, ttft_p99=1.50s; batch: e2e_p99=3600.00s, ttft_p99=1.50s" in text
    assert "| fixed 1 | interactive | 5 | 1/1 |" in text and "| fixed 1 | batch | 10 | 0/1 |" in text
    assert "NO (batch)" in text  # the hour's row names the tier that missed
    assert result["tier_shares"] == "interactive=70,standard=25,batch=5"
    fixed = result["summary"][0]
    assert fixed["hours_meeting_slo"] == 0 and result["need"][0] == 2
    tiers = fixed["tiers"]
    assert tiers["interactive"]["ttft_p99"] <= 1.5 < tiers["batch"]["ttft_p99"]
    assert tiers["interactive"]["within_ttft"] == 1.0 and tiers["batch"]["within_ttft"] < 0.5
    assert fixed["within_ttft"] == pytest.approx((5 + 10 * tiers["batch"]["within_ttft"]) / 15)
    # the plan says which rule it modelled
    assert tiers_paragraph({"tiers": ["interactive", "batch"], "tier_shares": "strict"}) == \
        "Tiers: interactive, batch, served with strict priority (`--tier-shares`)."
    assert tiers_paragraph({"tiers": ["standard"], "tier_shares": "interactive=70,standard=25,batch=5"}).startswith(
        "Every request is of tier standard")


def test_tier_columns_and_per_tier_targets_are_checked(tmp_path, capsys):
    hours = tmp_path / "hours.csv"
    hours.write_text("hour,requests_per_s,prompt_tokens,output_tokens,tier\n0,1,10,10,interactive\n"
                     "0,2,20,20,batch\n1,0.5,10,10,\n")
    traffic = read_traffic(hours)
    assert [(h.hour, h.tier) for h in traffic.hours] == [(0, INTERACTIVE), (0, BATCH), (1, STANDARD)]
    assert traffic.tiers() == ["interactive", "standard", "batch"]
    assert traffic.hourly()[0] == (0, 3.0, 100.0)  # an hour's tiers together
    reqs = traffic.requests(0, uniform=True, hours=range(1))
    assert [r.t for r in reqs] == sorted(r.t for r in reqs) and {r.tier for r in reqs} == {INTERACTIVE, BATCH}
    for text, match in (("0,1,10,10,gold\n", "line 2: the tier 'gold' is not one of interactive, standard, batch"),
                        ("0,1,10,10,batch\n0,2,10,10,batch\n", "line 3: hour 0 of tier batch appears twice")):
        hours.write_text("hour,requests_per_s,prompt_tokens,output_tokens,tier\n" + text)
        with pytest.raises(ValueError, match=match):
            read_traffic(hours)
    trace = tmp_path / "trace.csv"
    trace.write_text("t,prompt_tokens,output_tokens,tier\n1,10,10,Interactive\n2,10,10,premium\n")
    with pytest.raises(ValueError, match="line 3: the tier 'premium'"):
        read_traffic(trace)
    trace.write_text("t,prompt_tokens,output_tokens,tier\n1,10,10,Interactive\n2,10,10\n")
    assert [r.tier for r in read_traffic(trace).requests(0)] == [INTERACTIVE, STANDARD]
    # targets: a tier's own replaces the every-tier one of the same metric and percentile
    targets = parse_slo("ttft_p99=2s,interactive:ttft_p99=500ms,batch:e2e_p99=1h")
    assert [str(t) for t in targets] == ["ttft_p99=2.00s", "interactive:ttft_p99=500ms", "batch:e2e_p99=3600.00s"]
    own = tier_targets(targets)
    assert [[str(t) for t in ts] for ts in own] == [["interactive:ttft_p99=500ms"], ["ttft_p99=2.00s"],
                                                    ["ttft_p99=2.00s", "batch:e2e_p99=3600.00s"]]
    for text in ("gold:ttft_p99=1s", ":ttft_p99=1s"):
        with pytest.raises(ValueError, match="is not one of"):
            parse_slo(text)
    # the command line: a bad --tier-shares, and an SLO that sets nothing for the day's tiers
    assert cmd_plan(plan_args(tmp_path, trace, "--tier-shares", "gold=1")) == 2
    assert "--tier-shares: tier shares must be" in capsys.readouterr().err
    assert cmd_plan(plan_args(tmp_path, trace, slo="batch:ttft_p99=1s")) == 2
    assert "the SLO sets no target for the tiers of the traffic (interactive, standard)" in capsys.readouterr().err
