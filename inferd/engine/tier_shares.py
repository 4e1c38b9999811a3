"""Capacity shares between tiers: Kubernetes' API Priority and Fairness, for our three tiers.

Each tier has a nominal share of a worker's seats (running sequences; in the gateway, the room a worker offers:
max_num_seqs + worker_queue_depth). Seats are counted, not requests. A tier's *own seats* are its nominal share
rounded up (70/25/5 of 64 seats: 45, 16 and 4), so a tier with a positive share always has at least one and never
starves. The rule, used alike by the engine's scheduler (inferd/engine/scheduler.py), the gateway's dispatch
(inferd/gateway/admission.py), the echo engine and the planner's simulation:

- **Who gets the next free seat**: first the tiers below their own seats, the least filled (seats held / nominal
  seats) first, ties to the more important; then, once every tier that waits holds its own, the most important tier
  that waits. So a tier below its share lends the rest, an idle tier's capacity is never wasted, and what is lent goes
  to the more important work first.
- **Reclaiming**: a tier below its own seats whose work finds no free seat takes one back from a tier that holds more
  than its own (preemption in the engine; in the gateway, room beyond the worker's capacity, which the engine then
  reclaims). The lender keeps at least its own seats, so two tiers never trade one seat back and forth.
- **Strict** (`--tier-shares strict`): the old rule. Tiers go in priority order, and any more important request
  takes the seat of a less important one.

Within a tier, the gateway's virtual token counters share it between tenants (inferd/gateway/waiting_queue.py).
Pure: no torch, no asyncio, no clock.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..config import DEFAULT_TIER_SHARES, TIERS

STRICT = "strict"
_EPS = 1e-9  # seats are compared with real-valued nominal shares: 70% of 20 seats is 14, not 14.000000000000002


@dataclass(frozen=True)
class TierShares:
    fractions: tuple[float, ...] | None  # per tier rank, summing to 1; None: strict priority

    @classmethod
    def parse(cls, text: str | None = None) -> TierShares:
        """`strict`, or `interactive=70,standard=25,batch=5` (weights, normalised; an unnamed tier gets 0).
        ValueError with a message that names what is wrong."""
        text = (DEFAULT_TIER_SHARES if text is None else text).strip()
        if text.lower() == STRICT:
            return cls(None)
        weights = [0.0] * len(TIERS)
        seen: set[str] = set()
        for part in text.split(","):
            name, sep, value = part.partition("=")
            name = name.strip().lower()
            if not sep or name not in TIERS:
                raise ValueError(f"tier shares must be 'strict' or like "
                                 f"'{DEFAULT_TIER_SHARES}' (tiers: {', '.join(TIERS)}); got {part.strip()!r}")
            if name in seen:
                raise ValueError(f"tier {name!r} is given twice in the tier shares")
            seen.add(name)
            try:
                weight = float(value)
            except ValueError:
                raise ValueError(f"the share of tier {name!r} must be a number, got {value.strip()!r}") from None
            if not math.isfinite(weight) or weight < 0:
                raise ValueError(f"the share of tier {name!r} must be a finite number >= 0, got {value.strip()!r}")
            weights[TIERS.index(name)] = weight
        total = sum(weights)
        if total <= 0:
            raise ValueError("tier shares must give at least one tier a share above 0")
        return cls(tuple(w / total for w in weights))

    @property
    def strict(self) -> bool:
        return self.fractions is None

    def __str__(self) -> str:
        if self.fractions is None:
            return STRICT
        return ",".join(f"{tier}={round(100 * f, 4):g}" for tier, f in zip(TIERS, self.fractions))

    def nominal(self, capacity: float) -> list[float]:
        """Each tier's nominal seats out of capacity (real-valued); strict: every tier may hold all of them."""
        if self.fractions is None:
            return [float(capacity)] * len(TIERS)
        return [capacity * f for f in self.fractions]

    def own_seats(self, capacity: float) -> tuple[int, ...]:
        """Each tier's own seats: its nominal seats rounded up (0 only for a share of 0); strict: all of them."""
        return _own_seats(self.fractions, capacity)

    def next_tier(self, held: Sequence[int], candidates: Iterable[int], capacity: float) -> int | None:
        """Among the tiers (ranks) with work waiting for a seat, the one the next free seat goes to. held: seats
        each tier holds now."""
        candidates = list(candidates)
        if not candidates:
            return None
        if self.fractions is None:
            return min(candidates)
        nominal, own = self.nominal(capacity), self.own_seats(capacity)
        under = [t for t in candidates if held[t] < own[t]]
        if under:
            return min(under, key=lambda t: (held[t] / nominal[t], t))
        return min(candidates)

    def tier_order(self, held: Sequence[int], candidates: Iterable[int], capacity: float) -> list[int]:
        """The candidates in the order next_tier would serve them, each as if it were next (for a scheduler that
        tries the following tier when one cannot be placed)."""
        remaining = list(candidates)
        order = []
        while remaining:
            t = self.next_tier(held, remaining, capacity)
            order.append(t)
            remaining.remove(t)
        return order

    def may_reclaim(self, held: Sequence[int], tier: int, capacity: float, seats: int = 1) -> bool:
        """Whether `tier` may take `seats` seats back from lenders: it stays within its own seats. Strict: always
        (from less important tiers only; see may_lend)."""
        if self.fractions is None:
            return True
        return held[tier] + seats <= self.own_seats(capacity)[tier]

    def may_lend(self, held: Sequence[int], tier: int, capacity: float, taker: int, seats: int = 1) -> bool:
        """Whether `seats` seats of `tier` may be taken for `taker`: strict, when taker is more important; with
        shares, when `tier` still holds its own seats after giving them back (they were borrowed)."""
        if self.fractions is None:
            return taker < tier
        return tier != taker and held[tier] - seats >= self.own_seats(capacity)[tier]

    def lendable(self, held: Sequence[int], taker: int, capacity: float) -> int:
        """Seats the other tiers hold beyond their own: what `taker` could take back (strict: those of the less
        important tiers)."""
        if self.fractions is None:
            return sum(held[taker + 1:])
        return sum(max(0, h - n) for t, (h, n) in enumerate(zip(held, self.own_seats(capacity))) if t != taker)

    def borrowed(self, held: Sequence[int], capacity: float) -> list[int]:
        """Seats each tier holds beyond its own (0 where it holds fewer); strict: all 0."""
        if self.fractions is None:
            return [0] * len(TIERS)
        return [max(0, h - n) for h, n in zip(held, self.own_seats(capacity))]


@functools.lru_cache(maxsize=64)
def _own_seats(fractions: tuple[float, ...] | None, capacity: float) -> tuple[int, ...]:
    """Cached: the schedulers ask for every candidate of every step, with a handful of capacities."""
    if fractions is None:
        return (math.ceil(capacity),) * len(TIERS)
    return tuple(math.ceil(capacity * f - _EPS) for f in fractions)


_LAST_TIER = len(TIERS) - 1


def tier_rank(priority: int) -> int:
    """A request's priority as a tier rank, clamped to the tiers there are (no min/max calls: the schedulers ask this
    of every running and waiting request each step)."""
    return priority if 0 <= priority <= _LAST_TIER else (0 if priority < 0 else _LAST_TIER)


def tier_counts(ranks: Iterable[int]) -> list[int]:
    """Seats per tier rank, from the ranks (or priorities) of the sequences holding them."""
    counts = [0] * len(TIERS)
    for rank in ranks:
        counts[tier_rank(rank)] += 1
    return counts
