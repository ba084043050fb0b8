"""Per-tenant rate limits in the store (the arithmetic is metering/rate_limits.py).

Tables (migration 4): `rate_limits` (tenant -> rpm, tpm), `rate_windows` (tenant -> the current window's
start, requests and tokens). `admit` checks and counts in the caller's write transaction (the budget
hold shares it: one transaction per request); `settle` gives back the tokens a request did not use.
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
        w = conn.execute("SELECT window_start, requests, tokens FROM rate_windows WHERE tenant = ?",
                         (tenant,)).fetchone()
        requests, used = (w[1], w[2]) if w is not None and w[0] == start else (0, 0)
        state = RateState(rpm, tpm, requests, used, start + WINDOW_S - now)
        if not state.allows(tokens):
            return False, state
        conn.execute("INSERT INTO rate_windows (tenant, window_start, requests, tokens) VALUES (?, ?, ?, ?)"
                     " ON CONFLICT (tenant) DO UPDATE SET window_start = excluded.window_start,"
                     " requests = excluded.requests, tokens = excluded.tokens",
                     (tenant, start, requests + 1, used + tokens))
        return True, RateState(rpm, tpm, requests + 1, used + tokens, state.reset_s)

    def settle(self, conn: "sqlite3.Connection", tenant: str, unused_tokens: int, admitted_at: float) -> None:
        """Give back tokens counted at admission and not used, if that window is still the current one."""
        if unused_tokens > 0:
            conn.execute("UPDATE rate_windows SET tokens = MAX(0, tokens - ?) WHERE tenant = ? AND window_start = ?",
                         (unused_tokens, tenant, window_start(admitted_at)))
