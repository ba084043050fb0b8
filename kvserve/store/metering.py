"""Admission holds: a request's worst-case price in its tenant's budgets (store/budgets.py) and its
worst-case tokens in the tenant's rate-limit window (store/rate_limits.py), taken in one write
transaction per call, all or nothing, and settled by the request's usage row.

`budget_reservations` has one row per held engine request (tenant, request id): the budget keys and the
dollars held, the tokens counted, when, and when the hold's lease ends: the process that took it renews the
leases of its requests in flight (service/gate.py), so a hold whose process died (a gateway SIGKILLed: no
usage row will settle it) lapses within a lease, and the next admission drops it; the only server on a store
drops all at start-up.
`settle` runs inside the usage ledger's transaction that writes the request's row: the hold goes, the real
price is spent, unused tokens are given back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvserve.metering.budgets import Budget
from kvserve.metering.rate_limits import RateState

if TYPE_CHECKING:
    import sqlite3

    from kvserve.store.budgets import BudgetBook
    from kvserve.store.database import Database
    from kvserve.store.rate_limits import RateLimiter
    from kvserve.store.usage import UsageRecord

# A hold's lease; its process renews it three times a lease while the request runs. A process cut off from its
# store for longer may see its holds dropped by another gateway on the store (bound: those requests' worst case).
DEFAULT_HOLD_LEASE_S = 60.0


@dataclass(frozen=True)
class Admission:
    short: Budget | None = None  # the budget the call does not fit in
    rate: RateState | None = None  # the tenant's rate window after the check (None: no limits)
    rate_limited: bool = False

    @property
    def admitted(self) -> bool:
        return self.short is None and not self.rate_limited


class _Refused(Exception):
    def __init__(self, admission: Admission):
        self.admission = admission


class Holds:
    def __init__(self, db: "Database", budgets: "BudgetBook", limits: "RateLimiter",
                 hold_lease_s: float = DEFAULT_HOLD_LEASE_S):
        self.db, self.budgets, self.limits, self.hold_lease_s = db, budgets, limits, hold_lease_s

    def applies(self, tenant: str) -> bool:
        """Whether the tenant has a budget or rate limits (cached flags: no transaction for the others)."""
        return self.budgets.has_budget(tenant) or self.limits.limits(tenant) is not None

    def admit(self, tenant: str, model: str, asks: Sequence[tuple[str, float, int]]) -> Admission:
        """Hold each (request id, worst-case dollars, worst-case tokens), all or nothing."""
        now = self.db.clock()
        dollars, tokens = sum(a[1] for a in asks), sum(a[2] for a in asks)
        try:
            with self.db.write() as conn:
                ok, rate = self.limits.admit(conn, tenant, tokens, now)
                if not ok:
                    raise _Refused(Admission(rate=rate, rate_limited=True))
                budgets, short = self.budgets.check(conn, tenant, model, dollars, now)
                if short is not None:
                    raise _Refused(Admission(short=short, rate=rate))  # rolls the rate count back too
                for rid, _, _ in asks:  # a request run again (a batch line after a restart): its old hold goes
                    self._drop(conn, tenant, rid)
                keys = self.budgets.hold(conn, tenant, budgets, dollars)
                conn.executemany(
                    "INSERT INTO budget_reservations (tenant, request_id, models, amount, tokens, created_at,"
                    " expires_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [(tenant, rid, keys, amount if budgets else 0.0, n, now, now + self.hold_lease_s)
                     for rid, amount, n in asks])
        except _Refused as r:
            return r.admission
        return Admission(rate=rate)

    def settle(self, conn: "sqlite3.Connection", rec: "UsageRecord", charge: bool = True) -> None:
        """In the usage row's transaction: drop the request's hold, spend its real price (unless `charge` is
        False: its row was already written by an earlier run), give back unused tokens."""
        self._drop(conn, rec.tenant, rec.request_id, used_tokens=rec.prompt_tokens + rec.completion_tokens)
        if charge:
            self.budgets.spend(conn, rec.tenant, rec.model, rec.price or 0.0)

    def renew(self, held: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
        """Extend the leases of these (tenant, request id) holds, taken by this process for its requests in
        flight; the ones still held (the others were settled by their usage rows, or released)."""
        if not held:
            return []
        until = self.db.clock() + self.hold_lease_s
        with self.db.write() as conn:
            return [(tenant, rid) for tenant, rid in held
                    if conn.execute("UPDATE budget_reservations SET expires_at = ? WHERE tenant = ? AND request_id = ?",
                                    (until, tenant, rid)).rowcount == 1]

    def release(self, tenant: str, request_ids: Sequence[str]) -> None:
        """Drop the holds of requests that never reached an engine (no usage row will settle them)."""
        with self.db.write() as conn:
            for rid in request_ids:
                self._drop(conn, tenant, rid)

    def release_all(self) -> int:
        """Drop every hold: start-up of the only server on this store, whose previous run died (SIGKILL, a crash)
        with requests in flight. Their holds would never be settled (no usage row comes for a request that died
        with its process) and would keep their dollars out of the budgets until their leases lapse. The
        dollars go back; the tokens stay counted in their rate window (they may have been used; it ends within
        a minute). A batch line that was in flight runs again and takes a new hold. Returns how many."""
        with self.db.write() as conn:
            rows = conn.execute("SELECT tenant, request_id, models, amount FROM budget_reservations").fetchall()
            for tenant, rid, models, amount in rows:
                conn.execute("DELETE FROM budget_reservations WHERE tenant = ? AND request_id = ?", (tenant, rid))
                self.budgets.unhold(conn, tenant, models, amount)
            conn.execute("UPDATE budgets SET reserved = 0 WHERE reserved != 0")  # nothing is held now (no drift)
        return len(rows)

    def _drop(self, conn: "sqlite3.Connection", tenant: str, request_id: str, used_tokens: int = 0) -> None:
        row = conn.execute("SELECT models, amount, tokens, created_at FROM budget_reservations WHERE tenant = ?"
                           " AND request_id = ?", (tenant, request_id)).fetchone()
        if row is not None:
            models, amount, tokens, created = row
            conn.execute("DELETE FROM budget_reservations WHERE tenant = ? AND request_id = ?", (tenant, request_id))
            self.budgets.unhold(conn, tenant, models, amount)
            self.limits.settle(conn, tenant, tokens - used_tokens, created)
