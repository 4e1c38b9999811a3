"""The queue through real servers: fair sharing between tenants (VTC against FCFS), priority with
preemption on the worker, deadlines (503 queue_timeout, or an SSE error event after keep-alive comments).
Assertions count dispatch order (the x-inferd-dispatched-ahead header: requests dispatched while this one waited)
and engine counters, not milliseconds."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
from gw import bearer, completion, make_keys

from servers import iter_sse, sse_data

pytestmark = pytest.mark.timeout(240)


def queued(server, tier: str = "standard") -> float:
    return server.metrics().get(f'inferd_queue_requests{{tier="{tier}"}}', 0.0)


class ClosedLoop:
    """`concurrency` threads that each send the same request again as soon as the last one returned."""

    def __init__(self, server, key: str, prompt, max_tokens: int, concurrency: int, **extra):
        self.stop = threading.Event()
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self._run, args=(server, key, prompt, max_tokens, extra), daemon=True)
                        for _ in range(concurrency)]
        for t in self.threads:
            t.start()

    def _run(self, server, key, prompt, max_tokens, extra) -> None:
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                r = client.post(server.url + "/v1/completions", headers=bearer(key),
                                json={"prompt": prompt, "max_tokens": max_tokens, **extra})
                self.statuses.append(r.status_code)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


@pytest.fixture(scope="module")
def fair_keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    return path, make_keys(path, {"A": {}, "B": {}})


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_a_light_tenant_is_not_stuck_behind_a_heavy_one(serve, fair_keys, policy):
    """A keeps 16 long-prompt requests in the queue of a worker with one slot; B sends one short request at a time.
    Under VTC each of B's requests waits for at most 2 dispatches (the one whose service put A's counter past B's,
    and a tie); under FCFS it waits behind A's whole backlog. (The service bound itself, |W_A - W_B| <= 2U over
    every interval in which both are backlogged, is checked exactly in test_waiting_queue.py.)"""
    path, keys = fair_keys
    # each echo step slowed to 2 ms: a request of A takes ~120 ms, so the 12 waiting ones outlast the time B's
    # request takes to arrive on a loaded machine (unslowed, they drained first: 2 ahead under FCFS, once)
    server = serve("--keys", str(path), "--fairness", policy, "--max-num-seqs", "1", "--worker-queue-depth", "0",
                   name=f"fair-{policy}", env={"INFERD_FAULT": "action=slow,times=0,ms=2"})
    heavy = ClosedLoop(server, keys["A"], [11] * 120, 60, concurrency=16)
    try:
        ahead = []
        for _ in range(5 if policy == "vtc" else 3):  # FCFS, the baseline, waits behind the backlog each time
            # A's backlog is in the queue before each of B's requests (A's 16 client threads refill it as its
            # requests finish; on a loaded machine they can lag behind the dispatches for a moment)
            server.wait_metrics(lambda m: m.get('inferd_queue_requests{tier="standard"}', 0) >= 12)
            r = completion(server, keys["B"], [22] * 8, 4)
            assert r.status_code == 200, r.text
            ahead.append(int(r.headers["x-inferd-dispatched-ahead"]))
    finally:
        heavy.close()
    assert set(heavy.statuses) == {200}
    if policy == "vtc":
        assert max(ahead) <= 2, ahead
    else:
        assert min(ahead) >= 8, ahead  # behind A's backlog every time


@pytest.fixture(scope="module")
def tiny_keyed(serve, tmp_path_factory):
    """A real (tiny) model, two batch slots, no worker queue: the line holds the rest. The heartbeat timeout is
    long so that a worker the test freezes for a moment is not given up."""
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    keys = make_keys(path, {"bulk": {"tier": "batch"}, "vip": {"tier": "interactive"}, "std": {}, "std2": {}})
    server = serve("--keys", str(path), "--max-num-seqs", "2", "--worker-queue-depth", "0", "--sse-keepalive",
                   "0.05", "--heartbeat-timeout", "120", "--max-model-len", "1024", echo=False, name="tiny-prio")
    return server, keys


class LongStream:
    """A streamed batch request of `max_tokens` tokens (EOS ignored) read to its end on a thread; `started` is set
    at its first token (it is then running on the worker), `usage` holds the final usage chunk."""

    def __init__(self, server, key: str, prompt, max_tokens: int):
        self.started = threading.Event()
        self.status: int | None = None
        self.usage: dict | None = None
        body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        self.thread = threading.Thread(target=self._run, args=(server, key, body), daemon=True)
        self.thread.start()

    def _run(self, server, key, body) -> None:
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=bearer(key),
                              timeout=120) as r:
                self.status = r.status_code
                for event in iter_sse(r):
                    if isinstance(event, dict) and event.get("choices"):
                        self.started.set()
                    if isinstance(event, dict) and event.get("usage"):
                        self.usage = event["usage"]
        finally:
            self.started.set()  # a failure shows in status/usage, not as a hang

    def join(self) -> None:
        self.thread.join(timeout=120)


def test_interactive_goes_before_every_waiting_batch_request_and_preempts(tiny_keyed):
    """Two long batch streams hold both slots (each has produced a token, so each runs on the worker with ~500 to
    go) and eight more batch requests wait in the queue. The worker is frozen while the interactive request is
    bound to it, so that it meets both streams still running whatever the machine's speed: it must be dispatched
    before every waiting batch request, and the engine must preempt a stream for it, which then completes."""
    server, keys = tiny_keyed
    [worker] = server.worker_pids()
    preempted_before = server.metrics().get('inferd_preemptions_total{model="tiny"}', 0.0)
    streams = [LongStream(server, keys["bulk"], [33] * 8, 500) for _ in range(2)]
    for s in streams:
        assert s.started.wait(60) and s.status == 200, s.status
    bulk = ClosedLoop(server, keys["bulk"], [33] * 8, 8, concurrency=8, ignore_eos=True)
    frozen = False
    try:
        server.wait_metrics(lambda m: m.get('inferd_queue_requests{tier="batch"}', 0) >= 5)
        bound = server.metrics().get("inferd_queue_wait_seconds_count", 0.0)
        os.kill(worker, signal.SIGSTOP)
        frozen = True
        result: list[httpx.Response] = []
        vip_thread = threading.Thread(target=lambda: result.append(completion(server, keys["vip"], [44] * 8, 8,
                                                                              ignore_eos=True)))
        vip_thread.start()
        server.wait_metrics(lambda m: m.get("inferd_queue_wait_seconds_count", 0) >= bound + 1)  # vip bound
        os.kill(worker, signal.SIGCONT)
        frozen = False
        vip_thread.join(timeout=60)
        [vip] = result
        assert vip.status_code == 200, vip.text
        assert vip.headers["x-inferd-dispatched-ahead"] == "0"  # before every batch request still waiting
        assert vip.headers["x-inferd-tier"] == "interactive"
        assert vip.json()["usage"]["completion_tokens"] == 8
        # the worker was full of batch work: it preempted a stream for the interactive request
        server.wait_metrics(lambda m: m['inferd_preemptions_total{model="tiny"}'] >= preempted_before + 1)
    finally:
        if frozen:
            os.kill(worker, signal.SIGCONT)
        bulk.close()
        for s in streams:
            s.join()
    assert set(bulk.statuses) == {200}
    # the preempted stream was recomputed and completed, every token of it
    assert [s.usage["completion_tokens"] if s.usage else None for s in streams] == [500, 500]


@pytest.fixture(scope="module")
def frozen(serve, tmp_path_factory):
    """An echo server with one slot whose worker the test can freeze (SIGSTOP): a request bound to it then never
    finishes, so the next one waits in the queue for as long as the test wants. The heartbeat timeout is long so
    that a frozen worker is not given up."""
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    keys = make_keys(path, {"busy": {}, "late": {}})
    server = serve("--keys", str(path), "--metrics-key", "frozen-metrics-key", "--max-num-seqs", "1",
                   "--worker-queue-depth", "0", "--sse-keepalive", "0.05", "--heartbeat-timeout", "120", name="frozen")
    [worker] = server.worker_pids()
    return server, keys, worker


class Frozen:
    """The worker stopped, with one request bound to it (sent from a thread, answered after the thaw)."""

    def __init__(self, server, keys, worker):
        self.server, self.worker = server, worker
        dispatched = server.metrics().get("inferd_queue_wait_seconds_count", 0.0)
        os.kill(worker, signal.SIGSTOP)
        self.result: list[httpx.Response] = []
        self.thread = threading.Thread(target=lambda: self.result.append(completion(server, keys["busy"], [7], 3)))
        self.thread.start()
        server.wait_metrics(lambda m: m.get("inferd_queue_wait_seconds_count", 0) >= dispatched + 1)  # bound

    def thaw(self) -> httpx.Response:
        os.kill(self.worker, signal.SIGCONT)
        self.thread.join(timeout=60)
        return self.result[0]


def test_a_request_whose_deadline_passes_in_the_line_gets_503_queue_timeout(frozen):
    server, keys, worker = frozen
    before = server.metrics().get('inferd_gateway_admissions_total{outcome="queue_timeout"}', 0.0)
    hold = Frozen(server, keys, worker)
    try:
        r = completion(server, keys["late"], [66] * 4, 4, headers={"x-inferd-queue-timeout": "0.2"})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "queue_timeout" and "Retry-After" in r.headers

        # a stream: keep-alive comments while it waits, then the timeout as an SSE error event and [DONE]
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          headers={**bearer(keys["late"]), "x-inferd-queue-timeout": "0.5"},
                          json={"prompt": [66] * 4, "max_tokens": 4, "stream": True}) as s:
            assert s.status_code == 200
            lines = [line for line in s.iter_lines() if line]
    finally:
        busy = hold.thaw()
    assert lines[0] == ": keep-alive"
    events = sse_data(lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "queue_timeout"
    assert not any("choices" in e for e in events[:-1])  # no token was ever produced
    assert server.metrics()['inferd_gateway_admissions_total{outcome="queue_timeout"}'] == before + 2
    assert busy.status_code == 200 and busy.json()["usage"]["completion_tokens"] == 3
    # neither timed-out request was charged: the tenant's quota counter saw nothing from them
    assert server.metrics().get('inferd_tenant_tokens_total{tenant="late"}', 0.0) == 0.0


def test_a_waiting_stream_gets_its_tokens_after_keep_alives(frozen):
    server, keys, worker = frozen
    hold = Frozen(server, keys, worker)
    lines: list[str] = []
    try:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60, headers=bearer(keys["late"]),
                          json={"prompt": [66, 67], "max_tokens": 5, "stream": True}) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3:  # it waits: keep-alives keep coming until the worker thaws
                    assert lines == [": keep-alive"] * 3
                    hold.thaw()
    finally:
        os.kill(worker, signal.SIGCONT)
    events = sse_data(lines)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_at_the_bound_a_more_important_request_sheds_the_newest_worse_one(serve, tmp_path_factory):
    """A line of 2 holds two batch requests behind a frozen worker; an interactive request sheds the newest of them
    (503 overloaded with Retry-After), takes its place and, after the thaw, is dispatched before the other."""
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    keys = make_keys(path, {"busy": {"tier": "interactive"}, "late": {}, "bulk": {"tier": "batch"},
                            "vip": {"tier": "interactive"}})
    # the line's bound is what is tested: no per-tenant share of it (every request here is one of two tenants)
    server = serve("--keys", str(path), "--max-num-seqs", "1", "--worker-queue-depth", "0", "--max-queue-requests",
                   "2", "--heartbeat-timeout", "120", "--tenant-queue-share", "1", name="shed")
    [worker] = server.worker_pids()
    hold = Frozen(server, keys, worker)  # an interactive request holds the only slot
    results: dict[str, httpx.Response] = {}

    def send(name: str, key: str) -> threading.Thread:
        t = threading.Thread(target=lambda: results.__setitem__(name, completion(server, key, [3, 4], 2)))
        t.start()
        return t

    try:
        threads = [send("bulk1", keys["bulk"])]
        server.wait_metrics(lambda m: m['inferd_queue_requests{tier="batch"}'] == 1)
        threads.append(send("bulk2", keys["bulk"]))
        server.wait_metrics(lambda m: m['inferd_queue_requests{tier="batch"}'] == 2)
        full = completion(server, keys["bulk"], [3], 1)  # a third of the same tier: the line is full
        assert full.status_code == 503 and full.json()["error"]["code"] == "overloaded"
        assert int(full.headers["Retry-After"]) >= 1
        threads.append(send("vip", keys["vip"]))
        server.wait_metrics(lambda m: m['inferd_queue_requests{tier="interactive"}'] == 1)
        shed = threads[1]
        shed.join(timeout=30)
        assert results["bulk2"].status_code == 503
        assert "shed" in results["bulk2"].json()["error"]["message"] and "Retry-After" in results["bulk2"].headers
    finally:
        assert hold.thaw().status_code == 200
    for t in threads:
        t.join(timeout=60)
    assert results["vip"].status_code == 200 and results["bulk1"].status_code == 200
    assert results["vip"].headers["x-inferd-dispatched-ahead"] == "0"
    assert int(results["vip"].headers["x-inferd-dispatch-seq"]) < int(results["bulk1"].headers["x-inferd-dispatch-seq"])
    assert server.metrics()['inferd_queue_requests_high_water'] == 2
