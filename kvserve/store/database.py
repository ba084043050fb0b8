"""The database under the store's tables: its location, connections, migrations (SQLite or PostgreSQL).

All state lives under one data directory, ``$KVSERVE_HOME`` (default ``~/.kvserve``); the database
is ``$KVSERVE_HOME/kvserve.db`` unless a path or URL is given (store_location). The database runs in WAL
mode, so readers never block the writer and vice versa.

Connections: one per thread (``threading.local``). ``check_same_thread=False`` is set only so that
``close()`` can close every connection from the closing thread; a connection is otherwise used only
by the thread that opened it. Write transactions use ``BEGIN IMMEDIATE`` so that two writers (two
threads or two processes) serialise on the SQLite lock instead of dead-locking on an upgrade, and
a busy timeout makes the loser wait rather than fail.

Migrations are plain SQL: ``MIGRATIONS`` is an ordered list of ``(version, sql)``. Each pending
script runs in its own transaction together with its ``schema_version`` row, so a failed script
leaves no trace and re-opening an up-to-date database is a no-op.

The table modules (tenants, usage, idempotency, budgets, rate limits, metering) build on :class:`Database`;
the `Store` facade above them is store/db.py.
"""
from __future__ import annotations

import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from kvserve.config import kvserve_home
from kvserve.store.dialect import PostgresConnection, integrity_errors, is_postgres_url

Clock = Callable[[], float]

DB_FILENAME = "kvserve.db"
DEFAULT_BUSY_TIMEOUT_S = 10.0


def default_db_path(home: str | os.PathLike[str] | None = None) -> Path:
    """``kvserve_home(home) / "kvserve.db"``: the store when nothing names another (store_location)."""
    return kvserve_home(home) / DB_FILENAME


def store_location(db_path: str | None = None, home: str | os.PathLike[str] | None = None) -> Path | str:
    """Where the store is, for the server and every CLI command that opens it alike: `db_path` ([server]
    db_path: an SQLite file or a postgresql:// URL), else ``$KVSERVE_DB`` (the same), else kvserve.db in the
    data directory (`home`: [server] home; see kvserve_home)."""
    target = db_path or os.environ.get("KVSERVE_DB", "").strip()
    if target:
        return target if is_postgres_url(target) else Path(target).expanduser()
    return default_db_path(home)


# --------------------------------------------------------------------------------------------
# Schema. Append new migrations; never edit a shipped one.
# --------------------------------------------------------------------------------------------

MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE tenants (
            id          INTEGER PRIMARY KEY,
            name        TEXT NOT NULL UNIQUE,
            created_at  REAL NOT NULL,
            revoked_at  REAL
        );

        -- Tokens are stored only as a salted scrypt hash, plus a non-secret lookup prefix
        -- (the first 8 characters after "kvs-") so authentication is one indexed lookup + one hash.
        CREATE TABLE api_tokens (
            id          INTEGER PRIMARY KEY,
            tenant_id   INTEGER NOT NULL REFERENCES tenants(id) ON DELETE CASCADE,
            prefix      TEXT NOT NULL UNIQUE,
            hash        TEXT NOT NULL,
            created_at  REAL NOT NULL,
            revoked_at  REAL
        );
        CREATE INDEX api_tokens_tenant ON api_tokens(tenant_id);

        -- One row per finished request. `tenant` is the tenant name (not a foreign key: usage is
        -- also recorded for the built-in "default" tenant when authentication is off).
        CREATE TABLE usage_records (
            id                    INTEGER PRIMARY KEY,
            request_id            TEXT NOT NULL,
            tenant                TEXT NOT NULL,
            model                 TEXT NOT NULL,
            tier                  TEXT NOT NULL CHECK (tier IN ('interactive', 'batch')),
            prompt_tokens         INTEGER NOT NULL CHECK (prompt_tokens >= 0),
            cached_prompt_tokens  INTEGER NOT NULL DEFAULT 0 CHECK (cached_prompt_tokens >= 0),
            completion_tokens     INTEGER NOT NULL CHECK (completion_tokens >= 0),
            queue_ms              REAL,
            ttft_ms               REAL,
            e2e_ms                REAL,
            status                TEXT NOT NULL,
            finish_reason         TEXT,
            created_at            REAL NOT NULL,
            finished_at           REAL,
            UNIQUE (tenant, request_id)
        );
        CREATE INDEX usage_tenant_created ON usage_records(tenant, created_at);

        CREATE TABLE idempotency_keys (
            tenant        TEXT NOT NULL,
            key           TEXT NOT NULL,
            body_hash     TEXT NOT NULL,
            state         TEXT NOT NULL CHECK (state IN ('in_progress', 'done')),
            status_code   INTEGER,
            headers       TEXT,   -- JSON object (the replayed subset)
            body          BLOB,   -- non-streaming response body
            events        TEXT,   -- JSON array of SSE event strings (streaming responses)
            created_at    REAL NOT NULL,
            completed_at  REAL,
            PRIMARY KEY (tenant, key)
        ) WITHOUT ROWID;
        CREATE INDEX idempotency_created ON idempotency_keys(created_at);
        """,
    ),
    (
        2,
        """
        -- What a request was charged and what it cost: its share of the engine's time, the list price of its
        -- tokens, and that time at the replica's cost per hour (metering/prices.py).
        ALTER TABLE usage_records ADD COLUMN engine_s REAL;
        ALTER TABLE usage_records ADD COLUMN price REAL;
        ALTER TABLE usage_records ADD COLUMN cost REAL;
        """,
    ),
    (
        3,
        """
        -- Budgets (store/budgets.py): dollars per tenant and model ('*': all models) per period.
        CREATE TABLE budgets (
            tenant        TEXT NOT NULL,
            model         TEXT NOT NULL,
            amount        REAL NOT NULL CHECK (amount >= 0),
            period        TEXT NOT NULL CHECK (period IN ('day', 'month', 'none')),
            spent         REAL NOT NULL DEFAULT 0,
            reserved      REAL NOT NULL DEFAULT 0,
            period_start  REAL NOT NULL,
            updated_at    REAL NOT NULL,
            PRIMARY KEY (tenant, model)
        );
        -- A request's worst-case price held in its budgets until its usage row settles it.
        CREATE TABLE budget_reservations (
            tenant      TEXT NOT NULL,
            request_id  TEXT NOT NULL,
            models      TEXT NOT NULL,   -- the budgets' model keys it is held in, comma-separated
            amount      REAL NOT NULL,
            created_at  REAL NOT NULL,
            expires_at  REAL NOT NULL,
            PRIMARY KEY (tenant, request_id)
        );
        CREATE INDEX budget_reservations_expiry ON budget_reservations(expires_at);
        """,
    ),
    (
        4,
        """
        -- Rate limits (store/rate_limits.py): per tenant, requests and tokens per minute, fixed windows.
        CREATE TABLE rate_limits (
            tenant  TEXT PRIMARY KEY,
            rpm     INTEGER CHECK (rpm IS NULL OR rpm > 0),
            tpm     INTEGER CHECK (tpm IS NULL OR tpm > 0)
        );
        CREATE TABLE rate_windows (
            tenant        TEXT PRIMARY KEY,
            window_start  REAL NOT NULL,
            requests      INTEGER NOT NULL,
            tokens        INTEGER NOT NULL
        );
        -- A hold (store/metering.py) also counts the request's worst-case tokens in its rate window.
        ALTER TABLE budget_reservations ADD COLUMN tokens INTEGER NOT NULL DEFAULT 0;
        """,
    ),
    (
        5,
        """
        -- Admin tenants read every tenant's usage and set budgets and limits.
        ALTER TABLE tenants ADD COLUMN is_admin INTEGER NOT NULL DEFAULT 0;
        -- Usage reports over all tenants bucket by time.
        CREATE INDEX usage_created ON usage_records(created_at);
        """,
    ),
    (
        6,
        """
        -- Hourly roll-up of the ledger, kept in the transaction that writes each row: reports and the
        -- dashboard over hours and days read this, not every request's row.
        CREATE TABLE usage_hourly (
            hour                  REAL NOT NULL,
            tenant                TEXT NOT NULL,
            model                 TEXT NOT NULL,
            tier                  TEXT NOT NULL,
            requests              INTEGER NOT NULL,
            prompt_tokens         INTEGER NOT NULL,
            cached_prompt_tokens  INTEGER NOT NULL,
            completion_tokens     INTEGER NOT NULL,
            price                 REAL NOT NULL,
            cost                  REAL NOT NULL,
            engine_s              REAL NOT NULL,
            PRIMARY KEY (hour, tenant, model, tier)
        );
        INSERT INTO usage_hourly SELECT CAST(created_at / 3600 AS INTEGER) * 3600.0, tenant, model, tier, COUNT(*),
            SUM(prompt_tokens), SUM(cached_prompt_tokens), SUM(completion_tokens), COALESCE(SUM(price), 0),
            COALESCE(SUM(cost), 0), COALESCE(SUM(engine_s), 0) FROM usage_records GROUP BY 1, 2, 3, 4;
        """,
    ),
    (
        7,
        """
        -- The batch API (kvserve/batch): uploaded files (content on disk), batches, and each line's state.
        CREATE TABLE files (
            id          TEXT PRIMARY KEY,
            tenant      TEXT NOT NULL,
            purpose     TEXT NOT NULL,
            filename    TEXT NOT NULL,
            bytes       INTEGER NOT NULL,
            created_at  REAL NOT NULL,
            deleted_at  REAL
        );
        CREATE INDEX files_tenant ON files(tenant, created_at);
        CREATE TABLE batches (
            id                 TEXT PRIMARY KEY,
            tenant             TEXT NOT NULL,
            input_file_id      TEXT NOT NULL,
            endpoint           TEXT NOT NULL,
            completion_window  TEXT NOT NULL,
            status             TEXT NOT NULL,
            created_at         REAL NOT NULL,
            in_progress_at     REAL,
            expires_at         REAL,
            finalizing_at      REAL,
            completed_at       REAL,
            failed_at          REAL,
            expired_at         REAL,
            cancelling_at      REAL,
            cancelled_at       REAL,
            output_file_id     TEXT,
            error_file_id      TEXT,
            errors             TEXT,
            metadata           TEXT,
            total              INTEGER NOT NULL DEFAULT 0
        );
        CREATE INDEX batches_tenant ON batches(tenant, created_at);
        CREATE INDEX batches_status ON batches(status);
        -- state: pending | running (leased by a runner until lease_until) | done | failed | expired | cancelled
        CREATE TABLE batch_lines (
            batch_id     TEXT NOT NULL,
            line         INTEGER NOT NULL,
            custom_id    TEXT NOT NULL,
            state        TEXT NOT NULL,
            owner        TEXT,
            lease_until  REAL,
            result       TEXT,
            PRIMARY KEY (batch_id, line)
        );
        CREATE INDEX batch_lines_state ON batch_lines(batch_id, state);
        """,
    ),
    (
        8,
        """
        -- Daily roll-up too: reports by day over a month of a large ledger read a few thousand rows.
        CREATE TABLE usage_daily (
            day                   REAL NOT NULL,
            tenant                TEXT NOT NULL,
            model                 TEXT NOT NULL,
            tier                  TEXT NOT NULL,
            requests              INTEGER NOT NULL,
            prompt_tokens         INTEGER NOT NULL,
            cached_prompt_tokens  INTEGER NOT NULL,
            completion_tokens     INTEGER NOT NULL,
            price                 REAL NOT NULL,
            cost                  REAL NOT NULL,
            engine_s              REAL NOT NULL,
            PRIMARY KEY (day, tenant, model, tier)
        );
        INSERT INTO usage_daily SELECT CAST(hour / 86400 AS INTEGER) * 86400.0, tenant, model, tier, SUM(requests),
            SUM(prompt_tokens), SUM(cached_prompt_tokens), SUM(completion_tokens), SUM(price), SUM(cost),
            SUM(engine_s) FROM usage_hourly GROUP BY 1, 2, 3, 4;
        """,
    ),
    (
        9,
        """
        -- An in-progress idempotency key is leased by the process running its request, which renews the
        -- lease while it runs: a key whose process died (a fleet gateway SIGKILLed) is free again once its
        -- lease lapses, not stuck until the key expires. NULL: no lease (the row of an older server).
        ALTER TABLE idempotency_keys ADD COLUMN lease_until REAL;
        """,
    ),
    (
        10,
        """
        -- Of a request's cached prompt tokens, those read back from the KV cache's disk tier and those from its
        -- host-memory tier (the rest were in the engine's pool), in the ledger and its roll-ups.
        ALTER TABLE usage_records ADD COLUMN disk_cached_prompt_tokens INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE usage_records ADD COLUMN host_cached_prompt_tokens INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE usage_hourly ADD COLUMN disk_cached_prompt_tokens INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE usage_hourly ADD COLUMN host_cached_prompt_tokens INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE usage_daily ADD COLUMN disk_cached_prompt_tokens INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE usage_daily ADD COLUMN host_cached_prompt_tokens INTEGER NOT NULL DEFAULT 0;
        """,
    ),
    (
        11,
        """
        -- Budgets shared by regions (metering/escrow.py): this region's own share of a budget (floor) and what
        -- it may spend in all, its floor plus the leases it received this period (allotment); NULL: the
        -- budget is this store's alone.
        ALTER TABLE budgets ADD COLUMN floor REAL;
        ALTER TABLE budgets ADD COLUMN allotment REAL;
        -- The same for rate limits, per window: the requests and tokens this region may count in it.
        ALTER TABLE rate_windows ADD COLUMN allot_requests REAL;
        ALTER TABLE rate_windows ADD COLUMN allot_tokens REAL;
        -- In the ledger region's store: the leases of each budget's pool (and of each rate limit's window, under
        -- the keys '#rpm' and '#tpm') granted to each region, by period.
        CREATE TABLE escrow_leases (
            tenant       TEXT NOT NULL,
            model        TEXT NOT NULL,
            period_start REAL NOT NULL,
            region       TEXT NOT NULL,
            lease        REAL NOT NULL DEFAULT 0,
            updated_at   REAL NOT NULL,
            PRIMARY KEY (tenant, model, period_start, region)
        );
        """,
    ),
    (
        12,
        """
        -- The LoRA adapter a request ran with (NULL: the base model; `model` stays the base model's id, so
        -- budgets per model are charged for its adapters' requests too). The roll-ups key on it as well,
        -- '' for the base model (a key column is NOT NULL in PostgreSQL, and NULLs never conflict in SQLite):
        -- each is rebuilt with the wider key, its rows all the base model's.
        ALTER TABLE usage_records ADD COLUMN adapter TEXT;
        CREATE TABLE usage_hourly_v12 (
            hour                  REAL NOT NULL,
            tenant                TEXT NOT NULL,
            model                 TEXT NOT NULL,
            tier                  TEXT NOT NULL,
            adapter               TEXT NOT NULL DEFAULT '',
            requests              INTEGER NOT NULL,
            prompt_tokens         INTEGER NOT NULL,
            cached_prompt_tokens  INTEGER NOT NULL,
            completion_tokens     INTEGER NOT NULL,
            price                 REAL NOT NULL,
            cost                  REAL NOT NULL,
            engine_s              REAL NOT NULL,
            disk_cached_prompt_tokens INTEGER NOT NULL DEFAULT 0,
            host_cached_prompt_tokens INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (hour, tenant, model, tier, adapter)
        );
        INSERT INTO usage_hourly_v12 (hour, tenant, model, tier, adapter, requests, prompt_tokens, cached_prompt_tokens,
            completion_tokens, price, cost, engine_s, disk_cached_prompt_tokens, host_cached_prompt_tokens)
            SELECT hour, tenant, model, tier, '', requests, prompt_tokens, cached_prompt_tokens, completion_tokens,
            price, cost, engine_s, disk_cached_prompt_tokens, host_cached_prompt_tokens FROM usage_hourly;
        DROP TABLE usage_hourly;
        ALTER TABLE usage_hourly_v12 RENAME TO usage_hourly;
        CREATE TABLE usage_daily_v12 (
            day                   REAL NOT NULL,
            tenant                TEXT NOT NULL,
            model                 TEXT NOT NULL,
            tier                  TEXT NOT NULL,
            adapter               TEXT NOT NULL DEFAULT '',
            requests              INTEGER NOT NULL,
            prompt_tokens         INTEGER NOT NULL,
            cached_prompt_tokens  INTEGER NOT NULL,
            completion_tokens     INTEGER NOT NULL,
            price                 REAL NOT NULL,
            cost                  REAL NOT NULL,
            engine_s              REAL NOT NULL,
            disk_cached_prompt_tokens INTEGER NOT NULL DEFAULT 0,
            host_cached_prompt_tokens INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (day, tenant, model, tier, adapter)
        );
        INSERT INTO usage_daily_v12 (day, tenant, model, tier, adapter, requests, prompt_tokens, cached_prompt_tokens,
            completion_tokens, price, cost, engine_s, disk_cached_prompt_tokens, host_cached_prompt_tokens)
            SELECT day, tenant, model, tier, '', requests, prompt_tokens, cached_prompt_tokens, completion_tokens,
            price, cost, engine_s, disk_cached_prompt_tokens, host_cached_prompt_tokens FROM usage_daily;
        DROP TABLE usage_daily;
        ALTER TABLE usage_daily_v12 RENAME TO usage_daily;
        """,
    ),
]


class SchemaError(RuntimeError):
    """The database is from a newer kvserve, or the migration list is malformed."""


class StoreClosedError(RuntimeError):
    pass


def split_sql(script: str) -> list[str]:
    """Split a script into complete statements (``sqlite3.complete_statement`` decides where one ends)."""
    statements: list[str] = []
    buf = ""
    for piece in script.split(";"):
        buf += piece + ";"
        if sqlite3.complete_statement(buf):
            stmt = buf.strip()
            if stmt.strip(";").strip():
                statements.append(stmt)
            buf = ""
    if buf.strip(";").strip():
        raise SchemaError(f"incomplete SQL statement in migration: {buf.strip()[:80]!r}")
    return statements


def current_schema_version(conn) -> int:
    if isinstance(conn, PostgresConnection):
        row = conn.execute("SELECT to_regclass('schema_version') IS NOT NULL").fetchone()
        exists = bool(row[0])
    else:
        exists = conn.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='schema_version'"
                              ).fetchone() is not None
    if not exists:
        return 0
    return conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0]


def _begin_write(conn) -> None:
    if isinstance(conn, PostgresConnection):
        conn.begin_write()
    else:
        conn.execute("BEGIN IMMEDIATE")


def migrate(conn, migrations: Sequence[tuple[int, str]] = MIGRATIONS, clock: Clock = time.time) -> int:
    """Apply pending migrations, each atomically with its ``schema_version`` row; return the version.

    ``conn`` must be in autocommit mode (``isolation_level=None``). Safe against a concurrent
    migrator in another process: the version is re-read inside each write transaction (``BEGIN
    IMMEDIATE`` on SQLite, the write advisory lock on PostgreSQL).
    """
    versions = [v for v, _ in migrations]
    if versions != list(range(1, len(versions) + 1)):
        raise SchemaError(f"migration versions must be 1..N in order, got {versions}")
    latest = versions[-1] if versions else 0
    _begin_write(conn)  # two migrators starting together: one creates the version table, the other waits
    conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL PRIMARY KEY,"
                 " applied_at REAL NOT NULL)")
    conn.execute("COMMIT")
    found = current_schema_version(conn)
    if found > latest:
        raise SchemaError(f"database schema version {found} is newer than this kvserve supports ({latest})")
    for version, sql in migrations:
        if version <= found:
            continue
        _begin_write(conn)
        try:
            if current_schema_version(conn) < version:
                for stmt in split_sql(sql):
                    conn.execute(stmt)
                conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (version, clock()))
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    return current_schema_version(conn)


class Database:
    """Thread-local connections (an SQLite file, or a PostgreSQL URL: store/dialect.py), plus transaction helpers."""

    def __init__(self, path: str | os.PathLike[str], *, clock: Clock = time.time,
                 busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
                 migrations: Sequence[tuple[int, str]] = MIGRATIONS) -> None:
        self.postgres = is_postgres_url(path)
        self.url = str(path) if self.postgres else None
        self.path = None if self.postgres else Path(path).expanduser()
        if str(path) == ":memory:" or str(path).startswith("file:"):
            raise ValueError("Store needs a file path (each thread opens its own connection)")
        self.clock = clock
        self.busy_timeout_s = busy_timeout_s
        self.integrity_errors = integrity_errors()
        self._local = threading.local()
        self._conns: list = []
        self._lock = threading.Lock()
        self._closed = False
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            if not self.path.exists():
                # The file holds token hashes: owner-only. SQLite gives -wal/-shm the same mode.
                os.close(os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600))
        try:
            self.schema_version = migrate(self.conn(), migrations, clock)
        except BaseException:
            self.close()
            raise

    def conn(self) -> sqlite3.Connection:
        """This thread's connection (opened on first use)."""
        if self._closed:
            raise StoreClosedError("store is closed")
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self.postgres:
                conn = PostgresConnection(self.url)
            else:
                conn = sqlite3.connect(str(self.path), timeout=self.busy_timeout_s, isolation_level=None,
                                       check_same_thread=False)
                conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = NORMAL")  # durable across app crashes; WAL fsyncs at checkpoint
                conn.execute("PRAGMA foreign_keys = ON")
            with self._lock:
                if self._closed:
                    conn.close()
                    raise StoreClosedError("store is closed")
                self._conns.append(conn)
            self._local.conn = conn
        return conn

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on error). Nested use joins the outer one."""
        conn = self.conn()
        if conn.in_transaction:
            yield conn
            return
        _begin_write(conn)
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """A deferred transaction: every statement inside sees one snapshot."""
        conn = self.conn()
        if conn.in_transaction:
            yield conn
            return
        conn.execute("BEGIN")
        try:
            yield conn
        finally:
            conn.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        for conn in conns:
            try:
                conn.close()
            except Exception:
                pass

    @property
    def closed(self) -> bool:
        return self._closed
