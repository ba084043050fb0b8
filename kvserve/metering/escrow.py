"""A limit that holds across regions: escrow of one tenant's budget (or rate-limit window) among the regions
that spend it. Pure arithmetic (no I/O, no clock); the stores and the gateways carry the messages.

One limit (a budget for a period, or a rate limit's requests or tokens for a window) is split into what each
region may spend, its *allotment*:
- a *floor*, a fixed share of the limit each region owns for the period without asking anybody, so a region
  cut off from the others keeps serving its tenants up to it;
- *leases* from the rest (the pool), granted by the `Ledger`, the one global record of who may spend what
  (kept with the primary store). A region asks for a lease when what it may still spend runs low.

The promise: at every instant, the sum over regions of what they spent (reserved or settled) is at most the
limit, whatever the network does. A region raises its allotment only from a grant it received, and lowers it
before it tells the ledger it released some; the ledger grants only from the pool (the limit less every
floor and every lease it believes outstanding). A lost grant leaves lease the region never uses, a lost
release leaves lease the ledger never re-grants: both err on refusing, never on overspending. What a partition
costs is refusals: the partitioned region spends at most its allotment, and what it holds unused is not
available to the others until it comes back and releases it.

A region reserves a request's worst case before it runs and settles to the real amount after (never above
the reservation), as metering does in one region (metering/budgets.py).
"""
from __future__ import annotations

from kvserve.config import EscrowPolicy

EPSILON = 1e-9  # money is in floats (USD); comparisons forgive rounding


class Ledger:
    """The global record of one limit: each region's floor and the leases granted to it."""

    def __init__(self, limit: float, regions: list[str], policy: EscrowPolicy = EscrowPolicy()):
        if limit < 0 or not regions or len(set(regions)) != len(regions):
            raise ValueError("a ledger needs a limit >= 0 and distinct regions")
        if policy.floor_fraction * len(regions) > 1 + EPSILON:
            raise ValueError(f"floors of {policy.floor_fraction:g} for {len(regions)} regions exceed the limit")
        self.limit, self.policy = limit, policy
        self.floors = {r: policy.floor_fraction * limit for r in regions}
        self.leases = {r: 0.0 for r in regions}
        self.reported = {r: 0.0 for r in regions}  # what each region last said it spent (for reports)

    @property
    def pool(self) -> float:
        return max(0.0, self.limit - sum(self.floors.values()) - sum(self.leases.values()))

    def allotment(self, region: str) -> float:
        return self.floors[region] + self.leases[region]

    def grant(self, region: str, want: float) -> float:
        """A lease of at most `want` from the pool (0 when it is empty)."""
        got = min(max(0.0, want), self.pool)
        self.leases[region] += got
        return got

    def lease(self, region: str, need: float) -> float:
        """A region needs `need` more to admit a request: it gets a lease of at least that, a share of the pool
        (lease_fraction of it, at least min_lease_fraction of the limit) so it does not ask at every request;
        nothing when the pool cannot cover the need (a part of it would sit unused)."""
        p = self.policy
        if need > self.pool + EPSILON:
            return 0.0
        return self.grant(region, max(need, p.lease_fraction * self.pool, p.min_lease_fraction * self.limit))

    def release(self, region: str, amount: float) -> None:
        """The region gave back `amount` of its leases (it stopped counting it before it said so)."""
        self.leases[region] = max(0.0, self.leases[region] - amount)

    def report(self, region: str, spent: float) -> None:
        self.reported[region] = max(self.reported[region], spent)


class RegionAccount:
    """One region's side of a limit: its allotment (floor + leases received) and what it spent."""

    def __init__(self, limit: float, floor: float, policy: EscrowPolicy = EscrowPolicy()):
        self.limit, self.floor, self.policy = limit, floor, policy
        self.allotment = floor
        self.spent = 0.0  # reserved or settled

    @property
    def headroom(self) -> float:
        return max(0.0, self.allotment - self.spent)

    def reserve(self, amount: float) -> bool:
        """Take `amount` (a request's worst case) if the allotment holds it."""
        if amount < 0:
            raise ValueError("a reservation cannot be negative")
        if self.spent + amount > self.allotment + EPSILON:
            return False
        self.spent += amount
        return True

    def settle(self, reserved: float, actual: float) -> None:
        """A finished request cost `actual` of its reservation."""
        if not 0 <= actual <= reserved + EPSILON:
            raise ValueError(f"a request settles within its reservation (0..{reserved:g}), not at {actual:g}")
        self.spent -= reserved - actual

    def wanted(self, pool: float | None = None) -> float:
        """The lease to ask for now (0 while there is room): a share of the pool when the region knows it,
        at least the minimum lease."""
        p = self.policy
        if self.headroom >= p.refill_below_fraction * self.limit:
            return 0.0
        share = p.lease_fraction * pool if pool is not None else 0.0
        return max(share, p.min_lease_fraction * self.limit)

    def received(self, lease: float) -> None:
        self.allotment += lease

    def give_back(self, keep: float = 0.0) -> float:
        """Lower the allotment to keep at most `keep` of headroom above the floor's share; what the ledger is
        then told is released (say it after lowering: a lost message loses only availability)."""
        lease_left = self.allotment - self.floor
        spare = max(0.0, min(lease_left, self.headroom - keep))
        self.allotment -= spare
        return spare
