"""Idempotency keys: a retried request with the same ``Idempotency-Key`` gets the first response.

Protocol for the server, per request carrying a key::

    r = begin(tenant, key, request_body_hash(body))
    NEW          -> run it; then complete(tenant, key, StoredResponse(...)), or abandon(tenant, key)
                    on failure so that a retry can run it again
    REPLAY       -> send r.response
    IN_PROGRESS  -> another request with this key is running: attach to it in-process
    MISMATCH     -> 422 idempotency_key_reused (same key, different body)

``begin`` is atomic (check and claim in one ``BEGIN IMMEDIATE`` transaction), so of many
concurrent callers exactly one gets NEW. Keys expire ``ttl_s`` (24 h) after ``begin``: an expired
key is treated as absent; ``purge_expired()`` deletes them. An ``in_progress`` row is leased for
``lease_s`` by the process that runs it, which ``renew``s the lease while the request runs: a row
whose lease lapsed (its process died) is treated as absent, so a retry runs afresh. A server that
is the only one on its data directory also calls ``reset_in_progress()`` at start-up.
"""
from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.store.database import Database

DEFAULT_IDEMPOTENCY_TTL_S = 24 * 3600.0
# An in-progress key's lease; its holder renews it a few times per lease (server/idempotency.py).
DEFAULT_IDEMPOTENCY_LEASE_S = 10.0  # a dead holder's key (a gateway SIGKILLed) is free again within this
MAX_KEY_LEN = 255


class BeginOutcome(str, enum.Enum):
    NEW = "new"
    REPLAY = "replay"
    IN_PROGRESS = "in_progress"
    MISMATCH = "mismatch"


@dataclass(frozen=True)
class StoredResponse:
    """What a replay sends: status, a subset of headers, and a body or the list of SSE events."""

    status_code: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None
    events: list[str] | None = None  # streaming responses: the SSE event strings, in order

    @property
    def is_stream(self) -> bool:
        return self.events is not None


@dataclass(frozen=True)
class BeginResult:
    outcome: BeginOutcome
    response: StoredResponse | None = None  # set for REPLAY

    @property
    def new(self) -> bool:
        return self.outcome is BeginOutcome.NEW


def canonical_json(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def request_body_hash(body: Any) -> str:
    """sha256 hex of the canonical JSON (sorted keys, no whitespace) of a parsed request body."""
    return hashlib.sha256(canonical_json(body)).hexdigest()


def validate_key(key: str) -> str:
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LEN or not key.isprintable():
        raise ValueError(f"Idempotency-Key must be 1-{MAX_KEY_LEN} printable characters")
    return key


class IdempotencyStore:
    def __init__(self, db: "Database", *, ttl_s: float = DEFAULT_IDEMPOTENCY_TTL_S,
                 lease_s: float = DEFAULT_IDEMPOTENCY_LEASE_S) -> None:
        self.db = db
        self.ttl_s = ttl_s
        self.lease_s = lease_s

    def _expiry_cutoff(self) -> float:
        return self.db.clock() - self.ttl_s

    def begin(self, tenant: str, key: str, body_hash: str) -> BeginResult:
        validate_key(key)
        now = self.db.clock()
        with self.db.write() as conn:
            row = conn.execute(
                "SELECT body_hash, state, status_code, headers, body, events, created_at, lease_until"
                " FROM idempotency_keys WHERE tenant = ? AND key = ?", (tenant, key)).fetchone()
            lapsed = row is not None and row[1] == "in_progress" and row[7] is not None and row[7] < now
            if row is not None and (row[6] <= now - self.ttl_s or lapsed):
                conn.execute("DELETE FROM idempotency_keys WHERE tenant = ? AND key = ?", (tenant, key))
                row = None
            if row is None:
                conn.execute("INSERT INTO idempotency_keys (tenant, key, body_hash, state, created_at, lease_until)"
                             " VALUES (?, ?, ?, 'in_progress', ?, ?)", (tenant, key, body_hash, now, now + self.lease_s))
                return BeginResult(BeginOutcome.NEW)
        stored_hash, state, status_code, headers, body, events, _, _ = row
        if stored_hash != body_hash:
            return BeginResult(BeginOutcome.MISMATCH)
        if state == "in_progress":
            return BeginResult(BeginOutcome.IN_PROGRESS)
        return BeginResult(BeginOutcome.REPLAY, StoredResponse(
            status_code=status_code,
            headers=json.loads(headers) if headers else {},
            body=None if body is None else bytes(body),
            events=None if events is None else json.loads(events)))

    def state(self, tenant: str, key: str) -> str | None:
        """"done" or "in_progress" for a live key (not expired, its lease not lapsed), else None."""
        now = self.db.clock()
        with self.db.read() as conn:
            row = conn.execute("SELECT state, created_at, lease_until FROM idempotency_keys WHERE tenant = ? AND key = ?",
                               (tenant, key)).fetchone()
        if row is None or row[1] <= now - self.ttl_s:
            return None
        if row[0] == "in_progress" and row[2] is not None and row[2] < now:
            return None
        return row[0]

    def complete(self, tenant: str, key: str, response: StoredResponse) -> bool:
        """Store the response of a NEW request. False if the key is not ``in_progress`` any more."""
        headers = json.dumps(dict(response.headers))
        events = None if response.events is None else json.dumps(list(response.events))
        body = None if response.body is None else bytes(response.body)
        with self.db.write() as conn:
            return conn.execute(
                "UPDATE idempotency_keys SET state = 'done', status_code = ?, headers = ?, body = ?, events = ?,"
                " completed_at = ? WHERE tenant = ? AND key = ? AND state = 'in_progress'",
                (int(response.status_code), headers, body, events, self.db.clock(), tenant, key)).rowcount == 1

    def renew(self, keys: list[tuple[str, str]]) -> int:
        """Extend the leases of these (tenant, key) pairs, in progress in this process; how many were."""
        if not keys:
            return 0
        until = self.db.clock() + self.lease_s
        with self.db.write() as conn:
            return sum(conn.execute("UPDATE idempotency_keys SET lease_until = ? WHERE tenant = ? AND key = ?"
                                    " AND state = 'in_progress'", (until, tenant, key)).rowcount
                       for tenant, key in keys)

    def abandon(self, tenant: str, key: str) -> bool:
        """Release an ``in_progress`` key (the request failed) so that a retry runs it afresh."""
        with self.db.write() as conn:
            return conn.execute("DELETE FROM idempotency_keys WHERE tenant = ? AND key = ? AND state = 'in_progress'",
                                (tenant, key)).rowcount == 1

    def purge_expired(self) -> int:
        """Delete keys older than the TTL; returns how many."""
        with self.db.write() as conn:
            return conn.execute("DELETE FROM idempotency_keys WHERE created_at <= ?", (self._expiry_cutoff(),)).rowcount

    def reset_in_progress(self) -> int:
        """Release every ``in_progress`` key (start-up of the sole server process on this data dir)."""
        with self.db.write() as conn:
            return conn.execute("DELETE FROM idempotency_keys WHERE state = 'in_progress'").rowcount
