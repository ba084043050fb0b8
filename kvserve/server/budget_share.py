"""This region's side of budgets and rate limits shared by regions (metering/escrow.py): it asks the ledger
region for leases when a call does not fit its allotment, gives back what it holds unused, and, in the ledger
region, answers its peers' asks (routes/ops.py). A budget is leased by period under its model key, a rate
limit by window under '#rpm' and '#tpm' (metering/rate_limits.py SHARED_KEYS).

- A lease is asked on the request path (the metering gate's `BudgetShare`), of the ledger's store directly in
  the ledger region, else over HTTP within the probe timeout, with the admin token in `[regions] token_env`.
  No answer: the call is refused (429 insufficient_quota); a partition costs refusals, never overspend.
  An ask carries its deadline (this region's clock): the ledger grants nothing past it, so the asks a stalled
  or partitioned ledger finds queued when it wakes do not drain the pool into leases nobody is waiting for.
- Every `release_period_s` each budget's lease above what the region spent in the last period (twice that,
  and at least the minimum lease) goes back, and each rate limit's lease in the current window above the
  minimum lease: the allotment is lowered first, the ledger told after.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from typing import TYPE_CHECKING

import httpx

from kvserve.config import RegionsConfig
from kvserve.metering.rate_limits import SHARED_KEYS
from kvserve.server.background import stop_task

if TYPE_CHECKING:
    from kvserve.store import AsyncStore

log = logging.getLogger(__name__)

LEASE_PATH = "/v1/region/escrow/lease"
RELEASE_PATH = "/v1/region/escrow/release"


class BudgetShare:
    def __init__(self, config: RegionsConfig, store: "AsyncStore", client: httpx.AsyncClient,
                 urls: dict[str, str]):
        self.config, self.store, self.client = config, store, client
        self.ledger_url = None if config.ledger == config.local else urls[config.ledger]
        self.token = os.environ.get(config.token_env, "")
        self._used: dict[tuple[str, str], float] = {}  # spent + held at the last release, per budget
        self._task: asyncio.Task | None = None
        if self.ledger_url is not None and not self.token:
            log.warning("budgets are shared with region %s but $%s holds no admin token: leases will be refused",
                        config.ledger, config.token_env)

    @property
    def is_ledger(self) -> bool:
        return self.ledger_url is None

    async def start(self) -> None:
        await self.store.awrite(self.store.store.budgets.share_with_regions, self.config.escrow.floor_fraction)
        self.store.store.rate_limits.floor_fraction = self.config.escrow.floor_fraction
        self._task = asyncio.create_task(self._release_loop(), name="kvserve-budget-release")

    async def stop(self) -> None:
        await stop_task(self._task)

    # ---- the ledger region's side ---------------------------------------------------------------
    async def grant(self, tenant: str, model: str, start: float, region: str, need: float) -> float:
        c = self.config
        return await self.store.awrite(self.store.store.escrow.lease, tenant, model, start, region, need,
                                       c.names, c.escrow)

    async def take_back(self, tenant: str, model: str, start: float, region: str, amount: float) -> None:
        await self.store.awrite(self.store.store.escrow.release, tenant, model, start, region, amount)

    # ---- this region's side ---------------------------------------------------------------------
    async def lease(self, tenant: str, key: str, start: float, need: float) -> str | None:
        """The metering gate's ask (service/gate.py LimitShare): `need` more of the budget `key` (a model id) in
        the period that began at `start`, or of a rate limit (SHARED_KEYS) in that window."""
        args = dict(tenant=tenant, model=key, period_start=start, region=self.config.local)
        if self.is_ledger:
            got = await self.grant(tenant, key, start, self.config.local, need)
        else:
            try:
                timeout = self.config.policy.probe_timeout_s
                r = await self.client.post(self.ledger_url + LEASE_PATH, headers=self._auth, timeout=timeout,
                                           json={**args, "need": need, "deadline": time.time() + timeout})
                got = float(r.json()["granted"]) if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                got = None
            if got is None:
                return f"the ledger region {self.config.ledger} of the shared budget could not be reached"
        if got <= 0:
            return "no region has any of it left to lease"
        s = self.store.store
        receive = (functools.partial(s.rate_limits.receive, tenant, key) if key in SHARED_KEYS
                   else functools.partial(s.budgets.receive, tenant, key))
        if not await self.store.awrite(receive, start, got):
            await self._tell_released(tenant, key, start, got)  # the period (the window) ended meanwhile
            return "its period ended meanwhile"
        return None

    @property
    def _auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}

    async def _release_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.escrow.release_period_s)
            try:
                await self.release_spare()
            except Exception:  # a store or network error: try again next period
                log.exception("giving back unused budget leases failed")

    async def release_spare(self) -> None:
        e = self.config.escrow
        budgets = await self.store.awrite(self.store.store.budgets.list)
        for b in budgets:
            if b.allotment is None or b.floor is None:
                continue
            used = b.spent + b.reserved
            recent = max(0.0, used - self._used.get((b.tenant, b.model), used))
            self._used[(b.tenant, b.model)] = used
            if b.allotment - b.floor <= 0:
                continue
            keep = max(e.min_lease_fraction * b.amount, 2 * recent)
            start, spare = await self.store.awrite(self.store.store.budgets.give_back, b.tenant, b.model, keep)
            if spare > 0:
                await self._tell_released(b.tenant, b.model, start, spare)
        limits = self.store.store.rate_limits
        for tenant in await self.store.aread(limits.tenants):
            for key, start, spare in await self.store.awrite(limits.give_back, tenant, e.min_lease_fraction):
                await self._tell_released(tenant, key, start, spare)

    async def _tell_released(self, tenant: str, model: str, start: float, amount: float) -> None:
        if self.is_ledger:
            await self.take_back(tenant, model, start, self.config.local, amount)
            return
        try:
            await self.client.post(self.ledger_url + RELEASE_PATH, headers=self._auth,
                                   json=dict(tenant=tenant, model=model, period_start=start, region=self.config.local,
                                             amount=amount), timeout=self.config.policy.probe_timeout_s)
        except httpx.HTTPError:
            pass  # the lease stays counted at the ledger: fewer grants, never overspend
