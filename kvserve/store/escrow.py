"""The ledger of budgets shared by regions, kept in the ledger region's store (the arithmetic is
metering/escrow.py's `Ledger`): each budget's leases granted to each region, by period.

A grant and a release are each one write transaction, so the pool a grant draws from is the amount less every
floor and every lease outstanding at that instant, whichever gateway asks. The amount is the ledger region's
own budget row (tenant, model): every region sets the same amount, and the ledger's rules the pool. A rate
limit is leased the same way per window (key '#rpm' or '#tpm', period_start the window's start), from the
ledger region's own limits of the tenant.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.config import EscrowPolicy
from kvserve.metering.escrow import Ledger
from kvserve.metering.rate_limits import SHARED_KEYS

if TYPE_CHECKING:
    import sqlite3

    from kvserve.store.database import Database


class EscrowLedger:
    def __init__(self, db: "Database"):
        self.db = db

    def lease(self, tenant: str, model: str, start: float, region: str, need: float, regions: list[str],
              policy: EscrowPolicy) -> float:
        """A lease for a region that needs `need` more of the budget in the period that began at `start`
        (metering/escrow.py Ledger.lease; 0: the pool cannot cover it, or no such budget here)."""
        now = self.db.clock()
        with self.db.write() as conn:
            ledger = self._ledger(conn, tenant, model, start, regions, policy)
            if ledger is None or region not in ledger.leases:
                return 0.0
            got = ledger.lease(region, need)
            if got > 0:
                self._save(conn, tenant, model, start, region, ledger.leases[region], now)
            return got

    def release(self, tenant: str, model: str, start: float, region: str, amount: float) -> None:
        now = self.db.clock()
        with self.db.write() as conn:
            conn.execute("UPDATE escrow_leases SET lease = MAX(0, lease - ?), updated_at = ? WHERE tenant = ? AND"
                         " model = ? AND period_start = ? AND region = ?", (amount, now, tenant, model, start, region))

    def leases(self, tenant: str, model: str, start: float) -> dict[str, float]:
        with self.db.read() as conn:
            rows = conn.execute("SELECT region, lease FROM escrow_leases WHERE tenant = ? AND model = ? AND"
                                " period_start = ?", (tenant, model, start)).fetchall()
        return dict(rows)

    def _ledger(self, conn: "sqlite3.Connection", tenant: str, model: str, start: float, regions: list[str],
                policy: EscrowPolicy) -> Ledger | None:
        if model in SHARED_KEYS:
            row = conn.execute(f"SELECT {SHARED_KEYS[model]} FROM rate_limits WHERE tenant = ?", (tenant,)).fetchone()
        else:
            row = conn.execute("SELECT amount FROM budgets WHERE tenant = ? AND model = ?", (tenant, model)).fetchone()
        if row is None or row[0] is None:
            return None
        ledger = Ledger(row[0], regions, policy)
        for region, lease in conn.execute("SELECT region, lease FROM escrow_leases WHERE tenant = ? AND model = ?"
                                          " AND period_start = ?", (tenant, model, start)).fetchall():
            if region in ledger.leases:
                ledger.leases[region] = lease
        return ledger

    @staticmethod
    def _save(conn: "sqlite3.Connection", tenant: str, model: str, start: float, region: str, lease: float,
              now: float) -> None:
        conn.execute("INSERT INTO escrow_leases (tenant, model, period_start, region, lease, updated_at)"
                     " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, model, period_start, region) DO UPDATE SET"
                     " lease = excluded.lease, updated_at = excluded.updated_at",
                     (tenant, model, start, region, lease, now))
