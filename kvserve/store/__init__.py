"""Persistence: one schema (SQLite, or PostgreSQL) for tenants and tokens, usage, idempotency keys, budgets and limits.

Layers: database.py (location, connections, migrations) <- the table modules <- db.py (the Store facade).

Sync API: :class:`Store`. In the asyncio server use :class:`AsyncStore`, which runs writes on one
writer thread and reads/hashing on a small reader pool.
"""
from kvserve.store.async_store import AsyncStore
from kvserve.store.database import (
    MIGRATIONS,
    Database,
    SchemaError,
    StoreClosedError,
    default_db_path,
    migrate,
    store_location,
)
from kvserve.store.db import Store
from kvserve.store.idempotency import BeginOutcome, BeginResult, StoredResponse, request_body_hash
from kvserve.store.tenants import (
    InvalidTenantName,
    Tenant,
    TenantError,
    TenantExistsError,
    TenantInfo,
    TenantNotFoundError,
    TenantRevokedError,
    TokenInfo,
    validate_tenant_name,
)
from kvserve.store.usage import UsageRecord

__all__ = [
    "AsyncStore", "BeginOutcome", "BeginResult", "Database", "InvalidTenantName", "MIGRATIONS", "SchemaError",
    "Store", "StoreClosedError", "StoredResponse", "Tenant", "TenantError", "TenantExistsError", "TenantInfo",
    "TenantNotFoundError", "TenantRevokedError", "TokenInfo", "UsageRecord", "default_db_path",
    "migrate", "request_body_hash", "store_location", "validate_tenant_name",
]
