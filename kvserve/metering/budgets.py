"""Budget arithmetic, pure (no I/O): budget periods, whether a reservation fits, and how fast a budget burns.

A budget is an amount of dollars per tenant (optionally per model) per period: "day" and "month" reset
at the start of each UTC day or month, "none" never does. Admission reserves a request's worst-case
price (metering/prices.py); it fits when spent + reserved + the ask stays within the amount. The finish
settles: the reservation goes, its real price is added to spent. The store (store/budgets.py) does
each of these in one write transaction, so concurrent gateways cannot overspend between check and add.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

PERIODS = ("day", "month", "none")
ALL_MODELS = "*"


def period_start(period: str, now: float) -> float:
    """The start (epoch seconds) of the budget period that `now` falls in."""
    if period == "none":
        return 0.0
    t = datetime.fromtimestamp(now, timezone.utc)
    if period == "day":
        return datetime(t.year, t.month, t.day, tzinfo=timezone.utc).timestamp()
    if period == "month":
        return datetime(t.year, t.month, 1, tzinfo=timezone.utc).timestamp()
    raise ValueError(f"unknown budget period {period!r}; one of {', '.join(PERIODS)}")


def period_end(period: str, now: float) -> float | None:
    """When the period that `now` falls in ends (None: it never does)."""
    if period == "none":
        return None
    t = datetime.fromtimestamp(period_start(period, now), timezone.utc)
    if period == "day":
        return t.timestamp() + 86400
    return datetime(t.year + (t.month == 12), t.month % 12 + 1, 1, tzinfo=timezone.utc).timestamp()


@dataclass(frozen=True)
class Budget:
    tenant: str
    model: str  # a model id, or ALL_MODELS
    amount: float
    period: str
    spent: float = 0.0  # settled in the current period
    reserved: float = 0.0  # held by requests in flight
    period_start: float = 0.0
    # With regions sharing the budget (metering/escrow.py): this region's own share of the amount, and what
    # it may spend in all (that share plus the leases it received). None: the budget is this store's alone.
    floor: float | None = None
    allotment: float | None = None

    @property
    def cap(self) -> float:
        """What this store may spend of the budget in its period."""
        return self.amount if self.allotment is None else min(self.amount, self.allotment)

    @property
    def remaining(self) -> float:
        return max(0.0, self.cap - self.spent - self.reserved)

    def fits(self, ask: float) -> bool:
        return self.spent + self.reserved + ask <= self.cap + 1e-12

    def fits_globally(self, ask: float) -> bool:
        """Whether the ask would fit the whole amount (it may need a lease of the regions' pool first)."""
        return self.spent + self.reserved + ask <= self.amount + 1e-12


@dataclass(frozen=True)
class Burn:
    """How fast a budget is being spent in its current period, and when it would run out at that pace."""

    rate_per_hour: float | None  # dollars settled per hour since the period began (None: a budget with no period)
    exhausts_at: float | None  # Unix seconds when spent + held reaches the amount; None: not before the period ends
    period_end: float | None


def burn(budget: Budget, now: float) -> Burn:
    """The period's burn rate (spent / time elapsed in the period) and the projected exhaustion at that rate.

    A budget with no period ("none") has no elapsed time to divide by, so no rate. One already used up
    (spent + held >= amount) is exhausted now."""
    end = period_end(budget.period, now)
    if budget.period == "none":
        return Burn(None, now if budget.remaining <= 0 else None, None)
    elapsed = max(now - period_start(budget.period, now), 1.0)
    rate = budget.spent / elapsed
    if budget.remaining <= 0:
        return Burn(rate * 3600, now, end)
    at = now + budget.remaining / rate if rate > 0 else None
    return Burn(rate * 3600, at if at is not None and at < end else None, end)
