"""The `Store` facade: one object over the store's tables (tenants, usage, idempotency, budgets, rate limits,
holds), all on one :class:`~kvserve.store.database.Database`.

The server is asyncio; use :class:`kvserve.store.async_store.AsyncStore` there, never these sync
methods on the event loop.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Sequence

from kvserve.store.budgets import BudgetBook
from kvserve.store.escrow import EscrowLedger
from kvserve.store.database import DEFAULT_BUSY_TIMEOUT_S, Clock, Database, store_location
from kvserve.store.idempotency import DEFAULT_IDEMPOTENCY_TTL_S, BeginResult, IdempotencyStore, StoredResponse
from kvserve.store.metering import Holds
from kvserve.store.rate_limits import RateLimiter
from kvserve.store.tenants import (
    DEFAULT_AUTH_CACHE_SIZE,
    DEFAULT_AUTH_CACHE_TTL_S,
    DEFAULT_SCRYPT_N,
    Tenant,
    TenantInfo,
    TenantRegistry,
    TokenInfo,
)
from kvserve.store.usage import UsageLedger, UsageRecord


class Store:
    """The persistence facade: ``store.tenants``, ``store.usage``, ``store.idempotency`` plus flat shortcuts.

    Sync and thread-safe (one connection per calling thread). Do not call it on the event loop;
    wrap it in :class:`~kvserve.store.async_store.AsyncStore`.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, clock: Clock = time.time,
                 scrypt_n: int = DEFAULT_SCRYPT_N,
                 auth_cache_ttl_s: float = DEFAULT_AUTH_CACHE_TTL_S,
                 auth_cache_size: int = DEFAULT_AUTH_CACHE_SIZE,
                 idempotency_ttl_s: float = DEFAULT_IDEMPOTENCY_TTL_S,
                 busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S) -> None:
        self.db = Database(store_location() if path is None else path, clock=clock, busy_timeout_s=busy_timeout_s)
        self.clock = clock
        self.tenants = TenantRegistry(self.db, scrypt_n=scrypt_n, cache_ttl_s=auth_cache_ttl_s,
                                      cache_size=auth_cache_size)
        self.budgets = BudgetBook(self.db, cache_ttl_s=auth_cache_ttl_s)
        self.escrow = EscrowLedger(self.db)
        self.rate_limits = RateLimiter(self.db, cache_ttl_s=auth_cache_ttl_s)
        self.holds = Holds(self.db, self.budgets, self.rate_limits)
        self.usage = UsageLedger(self.db, self.holds)
        self.idempotency = IdempotencyStore(self.db, ttl_s=idempotency_ttl_s)

    @property
    def path(self) -> Path:
        return self.db.path

    @property
    def schema_version(self) -> int:
        return self.db.schema_version

    # tenants and tokens
    def create_tenant(self, name: str, admin: bool = False) -> tuple[Tenant, str]:
        return self.tenants.create_tenant(name, admin=admin)

    def create_token(self, tenant: str | Tenant) -> str:
        return self.tenants.create_token(tenant)

    def authenticate(self, token: str) -> Tenant | None:
        return self.tenants.authenticate(token)

    def revoke_token(self, token_or_prefix: str) -> bool:
        return self.tenants.revoke_token(token_or_prefix)

    def revoke_tenant(self, name: str) -> bool:
        return self.tenants.revoke_tenant(name)

    def get_tenant(self, name: str) -> Tenant | None:
        return self.tenants.get_tenant(name)

    def list_tenants(self) -> list[TenantInfo]:
        return self.tenants.list_tenants()

    def list_tokens(self, tenant: str | Tenant) -> list[TokenInfo]:
        return self.tenants.list_tokens(tenant)

    # usage
    def record_usage(self, record: UsageRecord) -> bool:
        return self.usage.record(record)

    def record_usage_many(self, records: Sequence[UsageRecord]) -> int:
        return self.usage.record_many(records)

    def usage_totals(self, tenant: str, since: Any = None, until: Any = None,
                     group_by: str | None = None) -> list[dict[str, Any]]:
        return self.usage.totals(tenant, since=since, until=until, group_by=group_by)

    # idempotency
    def begin_idempotent(self, tenant: str, key: str, body_hash: str) -> BeginResult:
        return self.idempotency.begin(tenant, key, body_hash)

    def complete_idempotent(self, tenant: str, key: str, response: StoredResponse) -> bool:
        return self.idempotency.complete(tenant, key, response)

    def abandon_idempotent(self, tenant: str, key: str) -> bool:
        return self.idempotency.abandon(tenant, key)

    def purge_expired(self) -> int:
        return self.idempotency.purge_expired()

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
