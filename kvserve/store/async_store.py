"""Async facade for the server: nothing here blocks the event loop on SQLite or scrypt.

* Writes run on one dedicated writer thread (``ThreadPoolExecutor(max_workers=1)``), in
  submission order, on that thread's own connection.
* Reads and token hashing (authentication, totals, listings) run on a small reader pool; WAL
  lets them proceed while the writer writes. ``hashlib.scrypt`` releases the GIL.
* ``aauthenticate`` first probes the in-memory auth cache on the loop (one sha256, one dict
  lookup) and goes to a thread only on a miss.

A cancelled ``await`` does not cancel the SQL already handed to the writer: a usage record
submitted before a client disconnect still lands.
"""
from __future__ import annotations

import asyncio
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

from kvserve.store.db import Store
from kvserve.store.idempotency import BeginResult, StoredResponse
from kvserve.store.tenants import Tenant, TenantInfo, TokenInfo
from kvserve.store.usage import UsageRecord

T = TypeVar("T")


class AsyncStore:
    def __init__(self, store: Store, *, reader_threads: int = 2) -> None:
        self.store = store
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-store-writer")
        self._readers = ThreadPoolExecutor(max_workers=max(1, reader_threads),
                                           thread_name_prefix="kvserve-store-reader")
        self._closed = False

    @classmethod
    def open(cls, path: str | os.PathLike[str] | None = None, *, reader_threads: int = 2,
             **store_kwargs: Any) -> "AsyncStore":
        """Open (and migrate) synchronously: for start-up code that is not on a running loop."""
        return cls(Store(path, **store_kwargs), reader_threads=reader_threads)

    @classmethod
    async def aopen(cls, path: str | os.PathLike[str] | None = None, *, reader_threads: int = 2,
                    **store_kwargs: Any) -> "AsyncStore":
        """Open (and migrate) in a thread: for use inside a running loop (e.g. a FastAPI lifespan)."""
        store = await asyncio.to_thread(Store, path, **store_kwargs)
        return cls(store, reader_threads=reader_threads)

    async def _run(self, executor: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise RuntimeError("AsyncStore is closed")
        return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args))

    def _write(self, fn: Callable[..., T], *args: Any):
        return self._run(self._writer, fn, *args)

    def _read(self, fn: Callable[..., T], *args: Any):
        return self._run(self._readers, fn, *args)

    # tenants and tokens -------------------------------------------------------------------
    async def acreate_tenant(self, name: str, admin: bool = False) -> tuple[Tenant, str]:
        minted = await self._read(self.store.tenants.mint)  # scrypt off the writer thread
        return await self._write(self.store.tenants.create_tenant, name, minted, admin)

    async def acreate_token(self, tenant: str | Tenant) -> str:
        minted = await self._read(self.store.tenants.mint)
        return await self._write(self.store.tenants.create_token, tenant, minted)

    async def aauthenticate(self, token: str) -> Tenant | None:
        hit = self.store.tenants.cached(token)
        if hit is not None:
            return hit
        return await self._read(self.store.tenants.authenticate, token)

    async def arevoke_token(self, token_or_prefix: str) -> bool:
        return await self._write(self.store.tenants.revoke_token, token_or_prefix)

    async def arevoke_tenant(self, name: str) -> bool:
        return await self._write(self.store.tenants.revoke_tenant, name)

    async def aget_tenant(self, name: str) -> Tenant | None:
        return await self._read(self.store.tenants.get_tenant, name)

    async def alist_tenants(self) -> list[TenantInfo]:
        return await self._read(self.store.tenants.list_tenants)

    async def alist_tokens(self, tenant: str | Tenant) -> list[TokenInfo]:
        return await self._read(self.store.tenants.list_tokens, tenant)

    # usage --------------------------------------------------------------------------------
    async def arecord_usage(self, record: UsageRecord) -> bool:
        return await self._write(self.store.usage.record, record)

    async def arecord_usage_many(self, records: Sequence[UsageRecord]) -> int:
        return await self._write(self.store.usage.record_many, list(records))

    async def ausage_totals(self, tenant: str, since: Any = None, until: Any = None,
                            group_by: str | None = None) -> list[dict[str, Any]]:
        return await self._read(functools.partial(self.store.usage.totals, tenant, since=since, until=until,
                                                  group_by=group_by))

    async def ausage_buckets(self, start: float, end: float, width: float, group_by: Sequence[str] = (),
                             tenant: str | None = None) -> list[dict[str, Any]]:
        return await self._read(self.store.usage.buckets, start, end, width, list(group_by), tenant)

    # any store call (the batch API's) -----------------------------------------------------
    async def awrite(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the writer thread (it writes: one at a time, in order)."""
        return await self._write(fn, *args)

    async def aread(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._read(fn, *args)

    # budgets and rate limits ---------------------------------------------------------------
    async def ameters(self, tenant: str) -> bool:
        return await self._read(self.store.holds.applies, tenant)

    async def aadmit(self, tenant: str, model: str, asks: Sequence[tuple[str, float, int]]):
        return await self._write(self.store.holds.admit, tenant, model, list(asks))

    async def arelease(self, tenant: str, request_ids: Sequence[str]) -> None:
        return await self._write(self.store.holds.release, tenant, list(request_ids))

    async def arenew_holds(self, held: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
        return await self._write(self.store.holds.renew, list(held))

    async def arelease_all_holds(self) -> int:
        return await self._write(self.store.holds.release_all)

    # idempotency --------------------------------------------------------------------------
    async def abegin_idempotent(self, tenant: str, key: str, body_hash: str) -> BeginResult:
        return await self._write(self.store.idempotency.begin, tenant, key, body_hash)

    async def aidempotency_state(self, tenant: str, key: str) -> str | None:
        return await self._read(self.store.idempotency.state, tenant, key)

    async def acomplete_idempotent(self, tenant: str, key: str, response: StoredResponse) -> bool:
        return await self._write(self.store.idempotency.complete, tenant, key, response)

    async def arenew_idempotent(self, keys: list[tuple[str, str]]) -> int:
        return await self._write(self.store.idempotency.renew, keys)

    async def aabandon_idempotent(self, tenant: str, key: str) -> bool:
        return await self._write(self.store.idempotency.abandon, tenant, key)

    async def apurge_expired(self) -> int:
        return await self._write(self.store.idempotency.purge_expired)

    async def areset_in_progress(self) -> int:
        return await self._write(self.store.idempotency.reset_in_progress)

    # lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Finish queued writes, stop the threads, close every connection (blocking)."""
        if self._closed:
            return
        self._closed = True
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self.store.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> "AsyncStore":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
