"""Per-tenant rate limits in the store (the arithmetic is metering/rate_limits.py).

Tables (migration 4): `rate_limits` (tenant -> rpm, tpm), `rate_windows` (tenant -> the current window's
start, requests and tokens). `admit` checks and counts in the caller's write transaction (the budget
hold shares it: one transaction per request); `settle` gives back the tokens a request did not use.
With regions sharing the limits (`floor_fraction` set), each window also records what this region may count
in it: its floor, and the leases it received for that window (metering/escrow.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.metering.rate_limits import WINDOW_S, RateState, window_start
from kvserve.store.ttl_cache import TTLCache

if TYPE_CHECKING:
    import sqlite3

    from kvserve.store.database import Database


class RateLimiter:
    def __init__(self, db: "Database", cache_ttl_s: float = 5.0):
        self.db = db
        self._limits: TTLCache = TTLCache(cache_ttl_s)  # tenant -> (rpm, tpm) or None
        self.floor_fraction: float | None = None  # regions share the limits: each region's floor of them

    def set_limits(self, tenant: str, rpm: int | None, tpm: int | None) -> None:
        for name, v in (("rpm", rpm), ("tpm", tpm)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1, or unset, got {v!r}")
        with self.db.write() as conn:
            if rpm is None and tpm is None:
                conn.execute("DELETE FROM rate_limits WHERE tenant = ?", (tenant,))
            else:
                conn.execute("INSERT INTO rate_limits (tenant, rpm, tpm) VALUES (?, ?, ?) ON CONFLICT (tenant)"
                             " DO UPDATE SET rpm = excluded.rpm, tpm = excluded.tpm", (tenant, rpm, tpm))
        self._limits.forget(tenant)

    def limits(self, tenant: str) -> tuple[int | None, int | None] | None:
        """(rpm, tpm), or None without limits (cached for cache_ttl_s)."""
        def load():
            with self.db.read() as conn:
                row = conn.execute("SELECT rpm, tpm FROM rate_limits WHERE tenant = ?", (tenant,)).fetchone()
            return (row[0], row[1]) if row else None

        return self._limits.get(tenant, load)

    def admit(self, conn: "sqlite3.Connection", tenant: str, tokens: int, now: float) -> tuple[bool, RateState | None]:
        """In the caller's write transaction: count the request and `tokens` if the limits allow."""
        row = conn.execute("SELECT rpm, tpm FROM rate_limits WHERE tenant = ?", (tenant,)).fetchone()
        if row is None:
            return True, None
        rpm, tpm = row
        start = window_start(now)
        requests, used, allot_r, allot_t = self._window(conn, tenant, start, rpm, tpm)
        state = RateState(rpm, tpm, requests, used, start + WINDOW_S - now, start, allot_r, allot_t)
        if not state.allows(tokens):
            return False, state
        self._save(conn, tenant, start, requests + 1, used + tokens, allot_r, allot_t)
        return True, RateState(rpm, tpm, requests + 1, used + tokens, state.reset_s, start, allot_r, allot_t)

    def receive(self, tenant: str, key: str, start: float, lease: float) -> bool:
        """A lease of requests ('#rpm') or tokens ('#tpm') for the window that began at `start` (not taken once
        another window began)."""
        with self.db.write() as conn:
            row = conn.execute("SELECT rpm, tpm FROM rate_limits WHERE tenant = ?", (tenant,)).fetchone()
            if row is None or self.floor_fraction is None or start != window_start(self.db.clock()):
                return False
            requests, used, allot_r, allot_t = self._window(conn, tenant, start, *row)
            if key == "#rpm":
                allot_r = (allot_r or 0.0) + lease
            else:
                allot_t = (allot_t or 0.0) + lease
            self._save(conn, tenant, start, requests, used, allot_r, allot_t)
            return True

    def give_back(self, tenant: str, keep_fraction: float) -> list[tuple[str, float, float]]:
        """Lower this window's allotments to keep at most `keep_fraction` of each limit unused above the floor;
        [(key, window start, the lease given back)], to tell the ledger after."""
        now = self.db.clock()
        with self.db.write() as conn:
            row = conn.execute("SELECT rpm, tpm FROM rate_limits WHERE tenant = ?", (tenant,)).fetchone()
            if row is None or self.floor_fraction is None:
                return []
            start = window_start(now)
            requests, used, allot_r, allot_t = self._window(conn, tenant, start, *row)
            out, allots = [], {"#rpm": allot_r, "#tpm": allot_t}
            for key, limit, count in (("#rpm", row[0], requests), ("#tpm", row[1], used)):
                if limit is None or allots[key] is None:
                    continue
                floor = self.floor_fraction * limit
                spare = max(0.0, min(allots[key] - floor, allots[key] - count - keep_fraction * limit))
                if spare > 0:
                    allots[key] -= spare
                    out.append((key, start, spare))
            if out:
                self._save(conn, tenant, start, requests, used, allots["#rpm"], allots["#tpm"])
            return out

    def tenants(self) -> list[str]:
        with self.db.read() as conn:
            return [r[0] for r in conn.execute("SELECT tenant FROM rate_limits").fetchall()]

    def _window(self, conn: "sqlite3.Connection", tenant: str, start: float, rpm: int | None, tpm: int | None
                ) -> tuple[int, int, float | None, float | None]:
        """The window that began at `start`: requests and tokens counted, and this region's allotments of them
        (a new window: nothing counted, the floors; None: the limits are this store's alone)."""
        f = self.floor_fraction
        floor_r = None if f is None or rpm is None else f * rpm
        floor_t = None if f is None or tpm is None else f * tpm
        w = conn.execute("SELECT window_start, requests, tokens, allot_requests, allot_tokens FROM rate_windows"
                         " WHERE tenant = ?", (tenant,)).fetchone()
        if w is None or w[0] != start:
            return 0, 0, floor_r, floor_t
        return (w[1], w[2], None if floor_r is None else (w[3] if w[3] is not None else floor_r),
                None if floor_t is None else (w[4] if w[4] is not None else floor_t))

    @staticmethod
    def _save(conn: "sqlite3.Connection", tenant: str, start: float, requests: int, tokens: int,
              allot_r: float | None, allot_t: float | None) -> None:
        conn.execute("INSERT INTO rate_windows (tenant, window_start, requests, tokens, allot_requests, allot_tokens)"
                     " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant) DO UPDATE SET window_start = excluded.window_start,"
                     " requests = excluded.requests, tokens = excluded.tokens,"
                     " allot_requests = excluded.allot_requests, allot_tokens = excluded.allot_tokens",
                     (tenant, start, requests, tokens, allot_r, allot_t))

    def settle(self, conn: "sqlite3.Connection", tenant: str, unused_tokens: int, admitted_at: float) -> None:
        """Give back tokens counted at admission and not used, if that window is still the current one."""
        if unused_tokens > 0:
            conn.execute("UPDATE rate_windows SET tokens = MAX(0, tokens - ?) WHERE tenant = ? AND window_start = ?",
                         (unused_tokens, tenant, window_start(admitted_at)))
