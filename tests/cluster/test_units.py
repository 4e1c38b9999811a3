"""Small pieces of the cluster without processes: the fault-injection setting, the router's prefix index and
ranking, worker addresses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from inferd.cluster.pool import spread_devices
from inferd.cluster.remote import Backoff
from inferd.config import WORKER_RECONNECT_BACKOFF_S
from inferd.engine.kv_cache import hash_prompt_blocks
from inferd.gateway.router import PrefixIndex, Router
from inferd.worker.address import parse_address
from inferd.worker.faults import FaultInjector, FaultSpec, InjectedFault, step_phase


def test_fault_spec_parses_and_refuses_bad_settings():
    spec = FaultSpec.parse("action=crash,phase=decode,step=5,worker=worker-1,version=v2,times=0")
    assert (spec.action, spec.phase, spec.step, spec.worker, spec.version, spec.times) == \
        ("crash", "decode", 5, "worker-1", "v2", 0)
    assert FaultSpec.parse("action=slow,ms=20").ms == 20.0
    for bad, match in [("action=explode", "action"), ("action=crash,phase=sleep", "phase"),
                       ("action=crash,step=0", "step"), ("action=crash,when=now", "unknown"),
                       ("action=crash,step=x", "integers"), ("crash", "key=value")]:
        with pytest.raises(ValueError, match=match):
            FaultSpec.parse(bad)


def test_fault_injector_acts_only_in_its_worker_and_version(monkeypatch):
    monkeypatch.setenv("INFERD_FAULT", "action=fail,worker=worker-1,version=v2")
    assert FaultInjector.from_env("worker-0", "v2") is None
    assert FaultInjector.from_env("worker-1", "v1") is None
    assert FaultInjector.from_env("worker-1", "v2") is not None
    monkeypatch.delenv("INFERD_FAULT")
    assert FaultInjector.from_env("worker-1", "v2") is None  # unset: inert


class _Req:
    def __init__(self, n_tokens: int, computed: int):
        self.token_ids = list(range(n_tokens))
        self.num_computed_tokens = computed


class _Engine:
    def __init__(self, *reqs):
        self.requests = {str(i): r for i, r in enumerate(reqs)}


def test_fault_injector_counts_steps_of_its_phase():
    prefill, decode = _Engine(_Req(10, 4)), _Engine(_Req(10, 9))
    assert step_phase(prefill) == "prefill" and step_phase(decode) == "decode"
    assert step_phase(_Engine(_Req(10, 9), _Req(5, 0))) == "prefill"  # a mixed step counts as prefill
    injector = FaultInjector(FaultSpec("fail", "decode", step=3, times=2))
    for engine in (decode, prefill, decode):  # decode steps 1 and 2
        injector.before_step(engine)
    for _ in range(2):  # decode steps 3 and 4 fail
        with pytest.raises(InjectedFault, match="decode step"):
            injector.before_step(decode)
    injector.before_step(decode)  # times=2: done


def test_prefix_index_matches_leading_blocks_and_forgets_the_oldest():
    a = hash_prompt_blocks(list(range(64)), 16)  # 4 blocks
    b = hash_prompt_blocks(list(range(32)) + [7] * 32, 16)  # shares 2 leading blocks with a
    index = PrefixIndex(max_blocks=5)
    index.add(a)
    assert index.matched(a) == 4 and index.matched(b) == 2
    assert index.matched(hash_prompt_blocks([9] * 64, 16)) == 0
    index.add(b[2:])  # 2 new blocks: the oldest (a's first) is evicted, so a matches nothing any more
    assert index.matched(a) == 0


class _Worker:
    def __init__(self, name: str):
        self.name = name
        self.on_recover = []
        self.hello = SimpleNamespace(worker_id=name)


def test_router_ranks_by_cached_prefix_then_load():
    router = Router()
    w0, w1 = _Worker("w0"), _Worker("w1")
    for w in (w0, w1):
        router._prefixes[w] = PrefixIndex()
    load = {w0: 5, w1: 1}.get
    system = hash_prompt_blocks(list(range(48)), 16)
    assert router.rank([w0, w1], load, system) is w1  # nobody holds it: the least loaded
    router.remember(w0, system)
    assert router.rank([w0, w1], load, system) is w0  # w0 was sent it: affinity beats load
    assert router.rank([w0, w1], load, []) is w1  # a prompt under one block: load only
    assert (router.affinity_hits, router.affinity_queries) == (1, 2)


def test_router_ties_go_to_the_smallest_worker_id_whatever_the_order():
    router = Router()
    workers = [_Worker(n) for n in ("worker-10", "worker-2", "worker-1")]
    for w in workers:
        router._prefixes[w] = PrefixIndex()
    even = dict.fromkeys(workers, 0).get
    for order in (workers, workers[::-1]):
        assert router.rank(order, even, []).name == "worker-1"
    system = hash_prompt_blocks(list(range(48)), 16)
    router.remember(workers[0], system)
    router.remember(workers[1], system)  # two hold the prefix, equally loaded: worker-2 (2 < 10, as numbers)
    assert router.rank(workers, even, system).name == "worker-2"


def test_worker_addresses():
    assert parse_address("10.0.0.5:9000") == ("10.0.0.5", 9000)
    assert parse_address("[::1]:9000") == ("::1", 9000)
    assert parse_address("0.0.0.0:0", allow_any_port=True) == ("0.0.0.0", 0)
    for bad in ("host", "host:0", "host:99999", ":80"):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_reconnects_back_off_exponentially_up_to_a_cap_and_start_over_after_a_reset():
    first, longest = WORKER_RECONNECT_BACKOFF_S
    backoff = Backoff(first, longest)
    pauses = [backoff.next() for _ in range(12)]
    assert pauses[0] == first and pauses[1] == 2 * first
    assert all(b == min(2 * a, longest) for a, b in zip(pauses, pauses[1:]))
    assert pauses[-1] == longest  # capped: a refusing worker is retried every `longest` seconds, never faster
    backoff.reset()
    assert backoff.next() == first


def test_local_workers_spread_over_the_gpus():
    args = ["--model", "m", "--device", "cuda", "--dtype", "auto"]
    assert [spread_devices(args, i, device_count=2)[3] for i in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert spread_devices(["--device", "cpu"], 3, device_count=2) == ["--device", "cpu"]
    assert spread_devices(["--device", "cuda:1"], 0, device_count=2) == ["--device", "cuda:1"]  # explicit: kept


# ---- the rollout's verdict ----------------------------------------------------------------------------------------
def _controller(min_seconds: float):
    import asyncio
    from types import SimpleNamespace

    from inferd.cluster.rollout import RolloutController, RolloutTargets, VersionFigures
    from inferd.telemetry.metrics import Metrics

    async def make():  # its lock wants a running loop on older Pythons
        pool = SimpleNamespace(args_for=lambda version: [], versions=lambda: ["v1"])
        c = RolloutController(SimpleNamespace(metrics=Metrics("m")), pool,
                              RolloutTargets(min_requests=4, min_seconds=min_seconds), 0.0)
        c.status, c.old_version, c.new_version = "canary", "v1", "v2"
        c.figures = {"v1": VersionFigures(), "v2": VersionFigures()}
        return c

    return asyncio.run(make())


def test_rollout_promotes_only_after_its_minimum_duration_but_rolls_back_at_once():
    import time

    c = _controller(min_seconds=60)
    c.started_at = time.monotonic()
    for _ in range(4):
        c.observe("v2", 0.1, 0.01, error=False)
    assert c.verdict() is None  # good so far, but too early to promote
    c.started_at = time.monotonic() - 61
    assert c.verdict()[0] is True
    bad = _controller(min_seconds=60)
    bad.started_at = time.monotonic()
    for _ in range(4):
        bad.observe("v2", 0.1, 0.01, error=True)
    ok, why = bad.verdict()
    assert ok is False and "error rate" in why


def test_rollout_counts_only_server_side_errors_and_keeps_bounded_samples():
    from inferd.api.refusals import is_server_error
    from inferd.config import ROLLOUT_MAX_LATENCY_SAMPLES
    from inferd.gateway.admission import Overloaded, QueueTimeout
    from inferd.worker.client import RequestFailed, RequestRejected, WorkerDead, WorkerUnavailable

    assert is_server_error(RequestFailed("step failed")) and is_server_error(WorkerDead("gone"))
    assert is_server_error(RuntimeError("a bug"))
    for client_side in (None, RequestRejected("bad prompt"), QueueTimeout(3.0), Overloaded("full", 1),
                        WorkerUnavailable("draining")):
        assert not is_server_error(client_side), client_side
    c = _controller(min_seconds=0)
    for i in range(ROLLOUT_MAX_LATENCY_SAMPLES + 500):
        c.observe("v2", float(i), 0.01, error=False)
    assert len(c.figures["v2"].ttft) == ROLLOUT_MAX_LATENCY_SAMPLES
    assert min(c.figures["v2"].ttft) == 500.0  # the most recent ones
