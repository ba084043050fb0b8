"""Batches and their lines in the store (tables from migration 7), and the OpenAI batch object.

A line is pending, running (leased to one runner until `lease_until`, renewed while it runs; a runner that
died lets the lease lapse and another takes the line), or ended: done (a 2xx response), failed (an error
response, or refused by the budget), expired (the completion window closed first) or cancelled. Its
`result` is its output line, written in the transaction that ends it, so a batch's output and error
files, made from the ended lines, hold every line exactly once however often the server restarted.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.batch.validate import Line
from kvserve.engine.errors import InvalidRequest

if TYPE_CHECKING:
    from kvserve.store.database import Database

ACTIVE = ("in_progress", "cancelling")
ENDED_LINE = ("done", "failed", "expired", "cancelled")
_WINDOW = re.compile(r"^(\d+)([smhd])$")


def window_seconds(window: str) -> float:
    """"24h" (OpenAI's one value), or any "<n>s|m|h|d"."""
    m = _WINDOW.match(window or "")
    if not m or int(m.group(1)) <= 0:
        raise InvalidRequest(f"completion_window must look like 24h (or <n>s, <n>m, <n>d), got {window!r}",
                             param="completion_window")
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


@dataclass
class Batch:
    id: str
    tenant: str
    input_file_id: str
    endpoint: str
    completion_window: str
    status: str
    created_at: float
    in_progress_at: float | None = None
    expires_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list | None = None
    metadata: dict | None = None
    total: int = 0
    counts: dict = field(default_factory=dict)  # line state -> lines

    def to_json(self) -> dict:
        def t(v):
            return None if v is None else int(v)

        done = self.counts.get("done", 0)
        failed = sum(self.counts.get(s, 0) for s in ("failed", "expired", "cancelled"))
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint,
                "errors": {"object": "list", "data": self.errors} if self.errors else None,
                "input_file_id": self.input_file_id, "completion_window": self.completion_window,
                "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": t(self.created_at), "in_progress_at": t(self.in_progress_at),
                "expires_at": t(self.expires_at), "finalizing_at": t(self.finalizing_at),
                "completed_at": t(self.completed_at), "failed_at": t(self.failed_at),
                "expired_at": t(self.expired_at), "cancelling_at": t(self.cancelling_at),
                "cancelled_at": t(self.cancelled_at),
                "request_counts": {"total": self.total, "completed": done, "failed": failed},
                "metadata": self.metadata or None}


_COLS = ("id, tenant, input_file_id, endpoint, completion_window, status, created_at, in_progress_at, expires_at,"
         " finalizing_at, completed_at, failed_at, expired_at, cancelling_at, cancelled_at, output_file_id,"
         " error_file_id, errors, metadata, total")


class BatchStore:
    def __init__(self, db: "Database"):
        self.db = db

    def _batch(self, conn, row) -> Batch:
        b = Batch(*row[:17], errors=json.loads(row[17]) if row[17] else None,
                  metadata=json.loads(row[18]) if row[18] else None, total=row[19])
        b.counts = dict(conn.execute("SELECT state, COUNT(*) FROM batch_lines WHERE batch_id = ? GROUP BY state",
                                     (b.id,)).fetchall())
        return b

    def create(self, tenant: str, input_file_id: str, endpoint: str, window: str, metadata: dict | None,
               lines: list[Line], errors: list[dict]) -> Batch:
        """A batch in progress with its lines pending, or failed (nothing runs) when the file had errors."""
        now = self.db.clock()
        bid = "batch_" + secrets.token_hex(12)
        status = "failed" if errors else "in_progress"
        with self.db.write() as conn:
            conn.execute(f"INSERT INTO batches ({_COLS}) VALUES ({', '.join('?' * 20)})",
                         (bid, tenant, input_file_id, endpoint, window, status, now,
                          None if errors else now, now + window_seconds(window), None, None, now if errors else None,
                          None, None, None, None, None, json.dumps(errors) if errors else None,
                          json.dumps(metadata) if metadata else None, 0 if errors else len(lines)))
            if not errors:
                conn.executemany("INSERT INTO batch_lines (batch_id, line, custom_id, state) VALUES (?, ?, ?, 'pending')",
                                 [(bid, ln.number, ln.custom_id) for ln in lines])
        return self.get(tenant, bid)

    def get(self, tenant: str | None, batch_id: str) -> Batch | None:
        with self.db.read() as conn:
            row = conn.execute(f"SELECT {_COLS} FROM batches WHERE id = ?" + (" AND tenant = ?" if tenant else ""),
                               (batch_id, tenant) if tenant else (batch_id,)).fetchone()
            return self._batch(conn, row) if row else None

    def list(self, tenant: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        with self.db.read() as conn:
            sql, params = f"SELECT {_COLS} FROM batches WHERE tenant = ?", [tenant]
            if after:
                ref = conn.execute("SELECT created_at, id FROM batches WHERE id = ? AND tenant = ?",
                                   (after, tenant)).fetchone()
                if ref is None:
                    raise InvalidRequest(f"no batch {after!r}", param="after")
                sql += " AND (created_at < ? OR (created_at = ? AND id < ?))"
                params += [ref[0], ref[0], ref[1]]
            rows = conn.execute(sql + " ORDER BY created_at DESC, id DESC LIMIT ?", (*params, limit + 1)).fetchall()
            return [self._batch(conn, r) for r in rows[:limit]], len(rows) > limit

    def cancel(self, tenant: str, batch_id: str) -> Batch | None:
        with self.db.write() as conn:
            row = conn.execute("SELECT status FROM batches WHERE id = ? AND tenant = ?", (batch_id, tenant)).fetchone()
            if row is None:
                return None
            if row[0] == "in_progress":
                conn.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ?",
                             (self.db.clock(), batch_id))
            elif row[0] != "cancelling":
                raise InvalidRequest(f"batch {batch_id} is {row[0]}; only a batch in progress can be cancelled",
                                     param="batch_id", code="invalid_state")
        return self.get(tenant, batch_id)

    # ---- the runner's side ------------------------------------------------------------------------
    def active(self) -> list[Batch]:
        with self.db.read() as conn:
            rows = conn.execute(f"SELECT {_COLS} FROM batches WHERE status IN (?, ?) ORDER BY created_at",
                                ACTIVE).fetchall()
            return [self._batch(conn, r) for r in rows]

    def claim(self, batch_id: str, n: int, owner: str, lease_s: float) -> list[tuple[int, str]]:
        """Up to n lines to run: pending ones, or running ones whose runner's lease lapsed."""
        now = self.db.clock()
        with self.db.write() as conn:
            rows = conn.execute("SELECT line, custom_id FROM batch_lines WHERE batch_id = ? AND (state = 'pending'"
                                " OR (state = 'running' AND lease_until < ?)) ORDER BY line LIMIT ?",
                                (batch_id, now, n)).fetchall()
            conn.executemany("UPDATE batch_lines SET state = 'running', owner = ?, lease_until = ? WHERE batch_id = ?"
                             " AND line = ?", [(owner, now + lease_s, batch_id, r[0]) for r in rows])
        return [(r[0], r[1]) for r in rows]

    def renew(self, owner: str, lease_s: float) -> None:
        with self.db.write() as conn:
            conn.execute("UPDATE batch_lines SET lease_until = ? WHERE owner = ? AND state = 'running'",
                         (self.db.clock() + lease_s, owner))

    def end_line(self, batch_id: str, line: int, state: str, result: dict | None, owner: str) -> bool:
        """End a line this runner holds; False if it no longer holds it (its lease lapsed and another took it)."""
        with self.db.write() as conn:
            return conn.execute("UPDATE batch_lines SET state = ?, result = ?, owner = NULL, lease_until = NULL"
                                " WHERE batch_id = ? AND line = ? AND state = 'running' AND owner = ?",
                                (state, json.dumps(result) if result is not None else None, batch_id, line,
                                 owner)).rowcount == 1

    def release(self, batch_id: str, line: int, owner: str) -> None:
        """Give a line back to pending (retry later: the engine was full, or this runner is stopping)."""
        with self.db.write() as conn:
            conn.execute("UPDATE batch_lines SET state = 'pending', owner = NULL, lease_until = NULL WHERE batch_id = ?"
                         " AND line = ? AND state = 'running' AND owner = ?", (batch_id, line, owner))

    def end_pending(self, batch_id: str, state: str, error: dict) -> int:
        """Every pending line ends as `state` (expired, cancelled) with `error` in its error-file line."""
        with self.db.write() as conn:
            rows = conn.execute("SELECT line, custom_id FROM batch_lines WHERE batch_id = ? AND state = 'pending'",
                                (batch_id,)).fetchall()
            conn.executemany("UPDATE batch_lines SET state = ?, result = ? WHERE batch_id = ? AND line = ?",
                             [(state, json.dumps({"id": "batch_req_" + secrets.token_hex(12), "custom_id": cid,
                                                  "response": None, "error": error}), batch_id, ln)
                              for ln, cid in rows])
        return len(rows)

    def unfinished(self, batch_id: str) -> int:
        with self.db.read() as conn:
            return conn.execute("SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND state IN ('pending', 'running')",
                                (batch_id,)).fetchone()[0]

    def results(self, batch_id: str) -> list[tuple[str, str]]:
        with self.db.read() as conn:
            return conn.execute("SELECT state, result FROM batch_lines WHERE batch_id = ? ORDER BY line",
                                (batch_id,)).fetchall()

    def set_status(self, batch_id: str, status: str, **files: str | None) -> None:
        now = self.db.clock()
        sets = ["status = ?", f"{status}_at = ?"] + [f"{k} = ?" for k in files]
        with self.db.write() as conn:
            conn.execute(f"UPDATE batches SET {', '.join(sets)} WHERE id = ?", (status, now, *files.values(), batch_id))
