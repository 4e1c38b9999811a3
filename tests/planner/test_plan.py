"""The capacity planner (`inferd plan`), on a synthetic profile whose every step takes 0.1 s, so that the answers can
be worked out by hand: with max_num_seqs 1, a request of a 10-token prompt and 10 output tokens takes one prefill
step (its first token at 0.1 s) and 9 decode steps: 1.0 s of a worker, and a worker serves at most 1 request/s."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime

import pytest

from inferd.cluster.autoscaler import Autoscaler, AutoscalerConfig
from inferd.planner.plan import (HOUR, Traffic, hourly_need, parse_slo, percentile, read_traffic, run_autoscaler,
                                 run_fixed)
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
