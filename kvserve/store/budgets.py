"""Budgets and reservations in the store (the arithmetic is metering/budgets.py).

Tables (migration 3): `budgets` (tenant, model) -> amount, period, spent in the current period, reserved,
period_start; `budget_reservations` (tenant, request_id) -> the budgets it holds money in, amount, expiry.

Every change is one write transaction (BEGIN IMMEDIATE, so two gateways serialise on the database):
admission (store/metering.py) rolls a budget into its current period, drops expired holds (a gateway
that died without settling), checks every budget that applies and holds the ask in each, or refuses;
the usage row's transaction moves a hold to the real price, so a request is charged exactly once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.metering.budgets import ALL_MODELS, PERIODS, Budget, period_start
from kvserve.store.ttl_cache import TTLCache

if TYPE_CHECKING:
    import sqlite3

    from kvserve.store.database import Database

_COLUMNS = "tenant, model, amount, period, spent, reserved, period_start, floor, allotment"


class BudgetBook:
    def __init__(self, db: "Database", cache_ttl_s: float = 5.0):
        self.db = db
        self._has: TTLCache[bool] = TTLCache(cache_ttl_s)  # tenant -> has a budget
        # Budgets shared by regions: each region's floor, as a fraction of the amount (None: budgets are
        # this store's alone). Set by the server from [regions] (share_with_regions).
        self.floor_fraction: float | None = None

    # ---- admin ------------------------------------------------------------------------------
    def set_budget(self, tenant: str, amount: float, period: str, model: str = ALL_MODELS) -> Budget:
        if period not in PERIODS:
            raise ValueError(f"period must be one of {', '.join(PERIODS)}, got {period!r}")
        if not isinstance(amount, (int, float)) or isinstance(amount, bool) or amount < 0:
            raise ValueError(f"amount must be a number >= 0, got {amount!r}")
        now = self.db.clock()
        with self.db.write() as conn:
            conn.execute(
                "INSERT INTO budgets (tenant, model, amount, period, spent, reserved, period_start, updated_at)"
                " VALUES (?, ?, ?, ?, 0, 0, ?, ?) ON CONFLICT (tenant, model) DO UPDATE SET amount = excluded.amount,"
                " period = excluded.period, updated_at = excluded.updated_at",
                (tenant, model, float(amount), period, period_start(period, now), now))
            self._roll(conn, tenant, now)
            self._set_floors(conn, "tenant = ? AND model = ?", (tenant, model))
        self._has.forget(tenant)
        return self.get(tenant, model)

    def delete_budget(self, tenant: str, model: str = ALL_MODELS) -> bool:
        with self.db.write() as conn:
            gone = conn.execute("DELETE FROM budgets WHERE tenant = ? AND model = ?", (tenant, model)).rowcount == 1
        self._has.forget(tenant)
        return gone

    def get(self, tenant: str, model: str = ALL_MODELS) -> Budget | None:
        return next((b for b in self.list(tenant) if b.model == model), None)

    def list(self, tenant: str | None = None) -> list[Budget]:
        now = self.db.clock()
        with self.db.write() as conn:  # a read that rolls periods and expires holds first
            self._roll(conn, tenant, now)
            self._expire(conn, now)
            rows = conn.execute(f"SELECT {_COLUMNS} FROM budgets"
                                + (" WHERE tenant = ?" if tenant else "") + " ORDER BY tenant, model",
                                (tenant,) if tenant else ()).fetchall()
        return [Budget(*r) for r in rows]

    def has_budget(self, tenant: str) -> bool:
        """Whether any budget applies to the tenant (cached for cache_ttl_s: a budget set from another
        process takes effect within that time)."""
        def load() -> bool:
            with self.db.read() as conn:
                return conn.execute("SELECT 1 FROM budgets WHERE tenant = ? LIMIT 1", (tenant,)).fetchone() is not None

        return self._has.get(tenant, load)

    # ---- the request path (inside the admission's write transaction: store/metering.py) ---------------
    def check(self, conn: "sqlite3.Connection", tenant: str, model: str, total: float, now: float
              ) -> tuple[list[Budget], Budget | None]:
        """The budgets that cover `model` for `tenant` (rolled, stale holds expired) and the first that
        `total` more does not fit in (None: it fits them all)."""
        self._roll(conn, tenant, now)
        self._expire(conn, now)
        rows = conn.execute(f"SELECT {_COLUMNS} FROM budgets WHERE tenant = ? AND model IN (?, ?)",
                            (tenant, model, ALL_MODELS)).fetchall()
        budgets = [Budget(*r) for r in rows]
        return budgets, next((b for b in budgets if not b.fits(total)), None)

    def hold(self, conn: "sqlite3.Connection", tenant: str, budgets: list[Budget], total: float) -> str:
        """Hold `total` in each of `budgets`; the budget keys the hold row records."""
        if budgets and total:
            conn.execute(f"UPDATE budgets SET reserved = reserved + ? WHERE tenant = ? AND model IN "
                         f"({','.join('?' * len(budgets))})", (total, tenant, *(b.model for b in budgets)))
        return ",".join(b.model for b in budgets)

    def unhold(self, conn: "sqlite3.Connection", tenant: str, models: str, amount: float) -> None:
        keys = [m for m in models.split(",") if m]
        if keys and amount:
            conn.execute(f"UPDATE budgets SET reserved = MAX(0, reserved - ?) WHERE tenant = ? AND model IN "
                         f"({','.join('?' * len(keys))})", (amount, tenant, *keys))

    def spend(self, conn: "sqlite3.Connection", tenant: str, model: str, price: float) -> None:
        if price:
            conn.execute("UPDATE budgets SET spent = spent + ? WHERE tenant = ? AND model IN (?, ?)",
                         (price, tenant, model, ALL_MODELS))

    # ---- budgets shared by regions (metering/escrow.py) ------------------------------------------
    def share_with_regions(self, floor_fraction: float | None) -> None:
        """Every budget becomes this region's floor plus the leases it holds (None: this store's alone again)."""
        self.floor_fraction = floor_fraction
        with self.db.write() as conn:
            self._set_floors(conn, "1 = 1", ())

    def receive(self, tenant: str, model: str, start: float, lease: float) -> bool:
        """A lease granted for the period that began at `start`: this region may spend that much more (not if
        the budget rolled into another period meanwhile: the lease was of the old one)."""
        now = self.db.clock()
        with self.db.write() as conn:
            self._roll(conn, tenant, now)
            return conn.execute("UPDATE budgets SET allotment = allotment + ? WHERE tenant = ? AND model = ? AND"
                                " period_start = ? AND allotment IS NOT NULL", (lease, tenant, model, start)
                                ).rowcount == 1

    def give_back(self, tenant: str, model: str, keep: float) -> tuple[float, float]:
        """Lower the allotment to keep at most `keep` of lease unspent; (period start, the lease given back),
        to tell the ledger after (a message lost then costs refusals, never overspend)."""
        now = self.db.clock()
        with self.db.write() as conn:
            self._roll(conn, tenant, now)
            row = conn.execute("SELECT spent + reserved, period_start, floor, allotment FROM budgets WHERE tenant = ?"
                               " AND model = ? AND allotment IS NOT NULL", (tenant, model)).fetchone()
            if row is None:
                return 0.0, 0.0
            used, start, floor, allotment = row
            spare = max(0.0, min(allotment - floor, allotment - used - keep))
            if spare > 0:
                conn.execute("UPDATE budgets SET allotment = allotment - ? WHERE tenant = ? AND model = ?",
                             (spare, tenant, model))
            return start, spare

    def _set_floors(self, conn: "sqlite3.Connection", where: str, args: tuple) -> None:
        """Floors follow the amount (an admin changed it); what the region holds above its floor stays."""
        if self.floor_fraction is None:
            conn.execute(f"UPDATE budgets SET floor = NULL, allotment = NULL WHERE {where}", args)
        else:
            conn.execute(f"UPDATE budgets SET allotment = amount * ? + MAX(0, COALESCE(allotment - floor, 0)),"
                         f" floor = amount * ? WHERE {where}", (self.floor_fraction, self.floor_fraction, *args))

    # ---- housekeeping (inside a write transaction) ----------------------------------------------
    def _roll(self, conn: "sqlite3.Connection", tenant: str | None, now: float) -> None:
        """Budgets whose period ended start a new one: spent goes back to 0 (holds stay held), and a region's
        leases were of the period that ended: it is back to its floor."""
        rows = conn.execute("SELECT tenant, model, period, period_start FROM budgets"
                            + (" WHERE tenant = ?" if tenant else ""), (tenant,) if tenant else ()).fetchall()
        for t, m, period, start in rows:
            current = period_start(period, now)
            if current > start:
                conn.execute("UPDATE budgets SET spent = 0, period_start = ?, allotment = floor WHERE tenant = ?"
                             " AND model = ?", (current, t, m))

    def _expire(self, conn: "sqlite3.Connection", now: float) -> None:
        """Holds past their expiry (their gateway died before settling) are released."""
        stale = conn.execute("SELECT tenant, request_id, models, amount FROM budget_reservations WHERE expires_at < ?",
                             (now,)).fetchall()
        for tenant, rid, models, amount in stale:
            conn.execute("DELETE FROM budget_reservations WHERE tenant = ? AND request_id = ?", (tenant, rid))
            self.unhold(conn, tenant, models, amount)
