"""The usage ledger: one row per finished request, summed per tenant.

Times are Unix epoch seconds (float). ``since`` is inclusive and ``until`` exclusive, both on
``created_at``; they also accept aware ``datetime`` objects. ``group_by="day"`` groups by UTC day.
``adapter`` names the LoRA adapter a request ran with (None: the base model); ``model`` is always the base
model's id, so budgets per model cover its adapters. The roll-ups key the base model as adapter ''; reports
give it back as None.
Recording is idempotent per ``(tenant, request_id)``: a second record for the same request is ignored.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from datetime import datetime
from typing import TYPE_CHECKING, Any, Sequence

from kvserve.store.dialect import day_expr

if TYPE_CHECKING:
    from kvserve.store.database import Database
    from kvserve.store.metering import Holds

TIERS = ("interactive", "batch")
GROUP_BY = (None, "model", "adapter", "day")
REPORT_GROUPS = ("tenant", "model", "tier", "adapter")


@dataclass
class UsageRecord:
    request_id: str
    tenant: str
    model: str
    tier: str = "interactive"  # "interactive" | "batch"
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of prompt_tokens, served from the prefix cache
    completion_tokens: int = 0
    queue_ms: float | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    status: str = "ok"  # "ok" | "aborted" | "error" | "rejected" | "timeout" | ...
    finish_reason: str | None = None
    created_at: float | None = None  # None: the store's clock at recording time
    finished_at: float | None = None
    engine_s: float | None = None  # engine time charged to it (seconds)
    price: float | None = None  # dollars charged (list price of its tokens)
    cost: float | None = None  # dollars its engine time cost
    disk_cached_prompt_tokens: int = 0  # of cached_prompt_tokens, read back from the KV cache's disk tier
    host_cached_prompt_tokens: int = 0  # of cached_prompt_tokens, from its host-memory tier
    adapter: str | None = None  # the LoRA adapter it ran with (its name); None: the base model

    def validate(self) -> None:
        for name in ("request_id", "tenant", "model", "status"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ValueError(f"UsageRecord.{name} must be a non-empty string, got {v!r}")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise ValueError(f"UsageRecord.adapter must be None or a non-empty string, got {self.adapter!r}")
        if self.tier not in TIERS:
            raise ValueError(f"UsageRecord.tier must be one of {TIERS}, got {self.tier!r}")
        for name in ("prompt_tokens", "cached_prompt_tokens", "disk_cached_prompt_tokens", "host_cached_prompt_tokens",
                     "completion_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"UsageRecord.{name} must be an int >= 0, got {v!r}")
        if self.cached_prompt_tokens > self.prompt_tokens:
            raise ValueError("UsageRecord.cached_prompt_tokens exceeds prompt_tokens")
        if self.disk_cached_prompt_tokens + self.host_cached_prompt_tokens > self.cached_prompt_tokens:
            raise ValueError("UsageRecord's disk and host cached prompt tokens exceed cached_prompt_tokens")


_COLUMNS = [f.name for f in fields(UsageRecord)]
_INSERT = (f"INSERT INTO usage_records ({', '.join(_COLUMNS)})"
           f" VALUES ({', '.join('?' * len(_COLUMNS))}) ON CONFLICT DO NOTHING")

ROLLUPS = (("usage_daily", "day", 86400), ("usage_hourly", "hour", 3600))  # coarsest first
NOW_SLACK_S = 5.0


def _rollup_sql(table: str, col: str) -> str:
    return (f"INSERT INTO {table} ({col}, tenant, model, tier, adapter, requests, prompt_tokens,"
            " cached_prompt_tokens, disk_cached_prompt_tokens, host_cached_prompt_tokens, completion_tokens, price,"
            " cost, engine_s) VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?, ?, ?, ?, ?, ?)"
            f" ON CONFLICT ({col}, tenant, model, tier, adapter) DO UPDATE SET requests = {table}.requests + 1,"
            f" prompt_tokens = {table}.prompt_tokens + excluded.prompt_tokens,"
            f" cached_prompt_tokens = {table}.cached_prompt_tokens + excluded.cached_prompt_tokens,"
            f" disk_cached_prompt_tokens = {table}.disk_cached_prompt_tokens + excluded.disk_cached_prompt_tokens,"
            f" host_cached_prompt_tokens = {table}.host_cached_prompt_tokens + excluded.host_cached_prompt_tokens,"
            f" completion_tokens = {table}.completion_tokens + excluded.completion_tokens,"
            f" price = {table}.price + excluded.price, cost = {table}.cost + excluded.cost,"
            f" engine_s = {table}.engine_s + excluded.engine_s")


_ROLLUP_SQL = {table: _rollup_sql(table, col) for table, col, _ in ROLLUPS}


def _rollup_row(row: tuple, width: int) -> tuple:
    """A roll-up upsert's values for one usage row (as _row made it)."""
    r = dict(zip(_COLUMNS, row))
    return ((r["created_at"] // width) * float(width), r["tenant"], r["model"], r["tier"], r["adapter"] or "",
            r["prompt_tokens"], r["cached_prompt_tokens"], r["disk_cached_prompt_tokens"],
            r["host_cached_prompt_tokens"], r["completion_tokens"], r["price"] or 0.0, r["cost"] or 0.0,
            r["engine_s"] or 0.0)


_SUMS = ("COUNT(*) AS requests,"
         " COALESCE(SUM(prompt_tokens), 0) AS prompt_tokens,"
         " COALESCE(SUM(cached_prompt_tokens), 0) AS cached_prompt_tokens,"
         " COALESCE(SUM(disk_cached_prompt_tokens), 0) AS disk_cached_prompt_tokens,"
         " COALESCE(SUM(host_cached_prompt_tokens), 0) AS host_cached_prompt_tokens,"
         " COALESCE(SUM(completion_tokens), 0) AS completion_tokens,"
         " COALESCE(SUM(prompt_tokens + completion_tokens), 0) AS total_tokens")



def _base_adapter(cur) -> list[dict[str, Any]]:
    """A query's rows as dicts, an ``adapter`` key of '' (the base model) as None."""
    names = [d[0] for d in cur.description]
    rows = [dict(zip(names, row)) for row in cur.fetchall()]
    if "adapter" in names:
        for r in rows:
            r["adapter"] = r["adapter"] or None
    return rows


def _epoch(t: Any) -> float | None:
    if t is None:
        return None
    if isinstance(t, datetime):
        return t.timestamp()
    return float(t)


class UsageLedger:
    def __init__(self, db: "Database", holds: "Holds | None" = None) -> None:
        self.db = db
        self.holds = holds  # settled in the same transaction as each new row: a request is charged once

    def _row(self, rec: UsageRecord) -> tuple:
        rec.validate()
        row = astuple(rec)
        if rec.created_at is None:
            row = row[:_COLUMNS.index("created_at")] + (self.db.clock(),) + row[_COLUMNS.index("created_at") + 1:]
        return row

    def record(self, rec: UsageRecord) -> bool:
        """Append one record; False if ``(tenant, request_id)`` was already recorded."""
        return self.record_many([rec]) == 1

    def record_many(self, records: Sequence[UsageRecord]) -> int:
        """Append several records in one transaction; returns how many were new."""
        rows = [self._row(r) for r in records]
        n = 0
        with self.db.write() as conn:
            for rec, row in zip(records, rows):
                new = conn.execute(_INSERT, row).rowcount
                n += new
                if new:
                    for table, _, width in ROLLUPS:
                        conn.execute(_ROLLUP_SQL[table], _rollup_row(row, width))
                if self.holds is not None:  # a row already there (a re-run): the hold goes, nothing is spent
                    self.holds.settle(conn, rec, charge=bool(new))
        return n

    def totals(self, tenant: str, since: Any = None, until: Any = None,
               group_by: str | None = None) -> list[dict[str, Any]]:
        """Sums for exactly one tenant.

        ``group_by=None``: one row (zeros when there is no usage). ``"model"``/``"adapter"``/``"day"``: one
        row per group, ordered by the key, with the key under its name (the base model's adapter: None, first).
        Each row has requests, prompt_tokens, cached_prompt_tokens, disk_cached_prompt_tokens,
        host_cached_prompt_tokens, completion_tokens, total_tokens.
        """
        if not isinstance(tenant, str) or not tenant:
            raise ValueError("usage_totals needs a tenant name")
        if group_by not in GROUP_BY:
            raise ValueError(f"group_by must be one of {GROUP_BY}, got {group_by!r}")
        where, params = ["tenant = ?"], [tenant]
        if since is not None:
            where.append("created_at >= ?")
            params.append(_epoch(since))
        if until is not None:
            where.append("created_at < ?")
            params.append(_epoch(until))
        if group_by is None:
            sql = f"SELECT {_SUMS} FROM usage_records WHERE {' AND '.join(where)}"
        else:
            expr = {"day": day_expr(self.db.postgres), "adapter": "COALESCE(adapter, '')"}.get(group_by, group_by)
            sql = (f"SELECT {expr} AS {group_by}, {_SUMS} FROM usage_records WHERE {' AND '.join(where)}"
                   f" GROUP BY 1 ORDER BY 1")
        return _base_adapter(self.db.conn().execute(sql, params))

    def buckets(self, start: float, end: float, width: float, group_by: Sequence[str] = (),
                tenant: str | None = None) -> list[dict[str, Any]]:
        """Sums per time bucket [start + i x width, ...) and per `group_by` columns (tenant, model, tier,
        adapter: None for the base model), for one tenant or (None) all; aggregated in SQL (the index on
        created_at, or on tenant and created_at)."""
        bad = [g for g in group_by if g not in REPORT_GROUPS]
        if bad:
            raise ValueError(f"group_by must be among {REPORT_GROUPS}, got {bad}")
        # the base model is adapter NULL in the ledger, '' in the roll-ups: '' in both (sorts first alike)
        cols = "".join(", COALESCE(adapter, '') AS adapter" if g == "adapter" else f", {g}" for g in group_by)
        keys = "".join(f", {i + 2}" for i in range(len(group_by)))  # by position: the select's expressions
        # Whole days or hours read a roll-up. A range ending now (end taken a moment before this query) includes
        # the period in progress: the roll-up is current, and what it adds after `end` is those few seconds'.
        until_now = end >= self.db.clock() - NOW_SLACK_S
        table, t, count = "usage_records", "created_at", "COUNT(*)"
        for name, col, unit in ROLLUPS:
            if width % unit == 0 and start % unit == 0 and (end % unit == 0 or until_now):
                table, t, count = name, col, "SUM(requests)"
                break
        where, params = f"{t} >= ? AND {t} < ?", [start, end]
        if tenant is not None:
            where += " AND tenant = ?"
            params.append(tenant)
        sql = (f"SELECT CAST(({t} - ?) / ? AS INTEGER) AS bucket{cols}, {count} AS requests,"
               " SUM(prompt_tokens) AS input_tokens, SUM(cached_prompt_tokens) AS input_cached_tokens,"
               " SUM(disk_cached_prompt_tokens) AS input_disk_cached_tokens,"
               " SUM(host_cached_prompt_tokens) AS input_host_cached_tokens,"
               " SUM(completion_tokens) AS output_tokens, COALESCE(SUM(price), 0) AS amount,"
               " COALESCE(SUM(cost), 0) AS cost, COALESCE(SUM(engine_s), 0) AS engine_seconds"
               f" FROM {table} WHERE {where} GROUP BY 1{keys} ORDER BY 1{keys}")
        return _base_adapter(self.db.conn().execute(sql, [start, width, *params]))

    def get(self, tenant: str, request_id: str) -> UsageRecord | None:
        row = self.db.conn().execute(
            f"SELECT {', '.join(_COLUMNS)} FROM usage_records WHERE tenant = ? AND request_id = ?",
            (tenant, request_id)).fetchone()
        return None if row is None else UsageRecord(*row)


__all__ = ["TIERS", "UsageLedger", "UsageRecord"]
