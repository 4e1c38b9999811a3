"""The queue as a data structure: priority tiers, VTC fair sharing with its 2U bound, FCFS for comparison,
bounds. A deterministic simulation of one server slot drives it: time advances one unit per generated token."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from inferd.config import FAIRNESS_OUTPUT_WEIGHT, FAIRNESS_PROMPT_WEIGHT
from inferd.gateway.waiting_queue import Waiter
from inferd.gateway.waiting_queue import WaitingQueue as WaitingLine


def waiter(tenant: str, prompt: int, output: int, tier_rank: int = 1, weight: float = 1.0) -> Waiter:
    return Waiter(tenant, tier_rank, weight, prompt, prompt + output, prompt + output, payload=output)


def cost(prompt: int, output: int, weight: float = 1.0) -> float:
    return (FAIRNESS_PROMPT_WEIGHT * prompt + FAIRNESS_OUTPUT_WEIGHT * output) / weight


@dataclass
class Client:
    """A closed-loop client: keeps `outstanding` requests in the system (queued or running)."""
    tenant: str
    prompt: int
    output: int
    outstanding: int
    weight: float = 1.0
    in_system: int = 0


def simulate(policy: str, clients: list[Client], steps: int, slots: int = 1):
    """Runs the line with `slots` servers for `steps` time units. Returns (service events, backlog intervals):
    events are (time, tenant, weighted amount); intervals per tenant are [start, end) while it had a request
    waiting."""
    line = WaitingLine(10_000, 10**9, policy)
    by_name = {c.tenant: c for c in clients}
    running: list[list] = []  # [tenant, tokens left, weight]
    events: list[tuple[float, str, float]] = []
    waiting_since: dict[str, float | None] = {c.tenant: None for c in clients}
    intervals: dict[str, list[tuple[float, float]]] = {c.tenant: [] for c in clients}

    def refill(t: float) -> None:
        for c in clients:
            while c.in_system < c.outstanding:
                line.push(waiter(c.tenant, c.prompt, c.output, weight=c.weight))
                c.in_system += 1
        note_backlog(t)

    def note_backlog(t: float) -> None:
        backlogged = {w.tenant for w in line.waiters()}
        for name in waiting_since:
            if name in backlogged and waiting_since[name] is None:
                waiting_since[name] = t
            elif name not in backlogged and waiting_since[name] is not None:
                intervals[name].append((waiting_since[name], t))
                waiting_since[name] = None

    def dispatch(t: float) -> None:
        while len(running) < slots and (w := line.peek()) is not None:
            events.append((t, w.tenant, line.pop(w)))
            running.append([w.tenant, w.payload, w.weight])
        note_backlog(t)

    refill(0.0)
    dispatch(0.0)
    for t in range(1, steps + 1):
        for r in running:  # one token each, charged as it is generated
            events.append((t - 0.5, r[0], line.charge(1, r[0], r[2], output_tokens=1)))
            r[1] -= 1
        for r in [r for r in running if r[1] == 0]:
            running.remove(r)
            by_name[r[0]].in_system -= 1
        refill(float(t))
        dispatch(float(t))
    return events, intervals


def service_in(events, tenant: str, start: float, end: float) -> float:
    """Service a tenant received in (start, end]: a dispatch at the very end of a waiting interval belongs to it."""
    return sum(a for t, who, a in events if who == tenant and start < t <= end)


def worst_gap(events, intervals_b, a: str, b: str) -> float:
    return max(abs(service_in(events, a, s, e) - service_in(events, b, s, e)) for s, e in intervals_b)


def test_vtc_bounds_the_service_gap_while_both_wait_and_fcfs_does_not():
    """Tenant A keeps 16 long-prompt requests queued; B sends one short request at a time. Over every interval in
    which both are backlogged (B has its request waiting; A always does), the weighted service of A and B differs by
    at most 2U, U = the largest weighted cost of one request (the VTC paper's bound). Under FCFS, B waits behind A's
    16 and the gap is many times U."""
    a, b = Client("A", prompt=200, output=20, outstanding=16), Client("B", prompt=10, output=20, outstanding=1)
    U = max(cost(a.prompt, a.output), cost(b.prompt, b.output))
    events, intervals = simulate("vtc", [a, b], steps=2000)
    assert len(intervals["B"]) > 20  # B was served many times
    assert worst_gap(events, intervals["B"], "A", "B") <= 2 * U

    a, b = Client("A", prompt=200, output=20, outstanding=16), Client("B", prompt=10, output=20, outstanding=1)
    events, intervals = simulate("fcfs", [a, b], steps=2000)
    assert worst_gap(events, intervals["B"], "A", "B") > 2 * U * 4


def test_vtc_weighted_shares_when_both_are_always_backlogged():
    """Both tenants always backlogged, weights 2 and 1: their weighted service stays within 2U at every moment, so
    the heavier tenant gets about twice the raw service."""
    a, b = Client("A", 50, 10, outstanding=8, weight=2.0), Client("B", 50, 10, outstanding=8, weight=1.0)
    U = cost(50, 10, 1.0)
    events, _ = simulate("vtc", [a, b], steps=3000, slots=2)
    for t_end in range(100, 3001, 100):
        gap = service_in(events, "A", -1, t_end) - service_in(events, "B", -1, t_end)
        assert abs(gap) <= 2 * U, (t_end, gap)
    raw_a = service_in(events, "A", -1, 3000) * 2.0
    raw_b = service_in(events, "B", -1, 3000)
    assert 1.8 < raw_a / raw_b < 2.2


def test_a_tenant_returning_from_idle_starts_at_the_current_minimum():
    """A was served alone for a long time; B arrives: B's counter starts at A's, not at 0, so B does not get a
    burst that starves A for the service A received while B was away."""
    line = WaitingLine(100, 10**6, "vtc")
    for _ in range(50):
        line.push(waiter("A", 100, 0))
        line.pop(line.peek())
    line.push(waiter("A", 100, 0))
    line.push(waiter("B", 100, 0))
    line.push(waiter("B", 100, 0))
    assert line.counter(1, "B") == line.counter(1, "A")
    order = []
    for _ in range(3):
        w = line.peek()
        order.append(w.tenant)
        line.pop(w)
        line.push(waiter(w.tenant, 100, 0))
    assert order.count("A") >= 1  # not B, B, B


def test_bands_go_first_whatever_the_counters():
    line = WaitingLine(100, 10**6, "vtc")
    batch = [waiter("A", 10, 10, tier_rank=2) for _ in range(5)]
    for w in batch:
        line.push(w)
    line.push(waiter("B", 10, 10, tier_rank=1))
    interactive = waiter("C", 1000, 1000, tier_rank=0)
    line.push(interactive)
    assert line.peek() is interactive
    line.pop(interactive)
    assert line.peek().tenant == "B"


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_bounds_by_count_and_by_tokens(policy):
    line = WaitingLine(3, 100, policy)
    assert line.fits(100) and not line.fits(101)
    line.push(waiter("A", 30, 10))
    line.push(waiter("A", 30, 10))
    assert line.num_tokens == 80 and not line.fits(21) and line.fits(20)
    line.push(waiter("B", 10, 10))
    assert len(line) == 3 and not line.fits(1)
    with pytest.raises(OverflowError):
        line.push(waiter("C", 1, 0))
    w = line.peek()
    assert line.remove(w) and not line.remove(w)
    assert len(line) == 2


def test_fcfs_is_arrival_order_inside_a_band():
    line = WaitingLine(100, 10**6, "fcfs")
    ws = [waiter(t, 10, 10) for t in "ABAB"]
    for w in ws:
        line.push(w)
    got = []
    while (w := line.peek()) is not None:
        line.pop(w)
        got.append(w)
    assert got == ws


def test_counters_are_per_band_and_charges_divide_by_weight():
    line = WaitingLine(100, 10**6, "vtc")
    w = waiter("A", 10, 0, tier_rank=2, weight=4.0)
    line.push(w)
    assert line.pop(w) == pytest.approx(10 * FAIRNESS_PROMPT_WEIGHT / 4.0)
    assert line.charge(2, "A", 4.0, output_tokens=2) == pytest.approx(2 * FAIRNESS_OUTPUT_WEIGHT / 4.0)
    assert line.counter(1, "A") == 0.0
