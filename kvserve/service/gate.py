"""The metering gate: the service asks it before submitting a call's engine requests.

Each engine request's worst case, its prompt at the input price plus max_tokens x n at the output price
(metering/prices.py) and prompt + max_tokens x n tokens, is held in the tenant's budgets and counted in
its rate-limit window in one store transaction (store/metering.py). A call that does not fit is refused
before any engine work: 429 insufficient_quota (a budget), or 429 rate_limit_exceeded with Retry-After
(the window). The hold is settled by the request's usage row (real price, real tokens) however it ends
(finished, aborted, failed, migrated: one row per request), or released here when the request never
reached an engine. Tenants with neither a budget nor limits skip the transaction (cached flags).

Budgets shared by regions (metering/escrow.py): a call that does not fit this region's allotment but would fit
the whole amount asks the ledger region for a lease (`BudgetShare`, the region front's) and is admitted again
once; refused if no lease comes (the pool is spent, or the ledger cannot be reached: a partition costs refusals).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvserve.config import ModelPrice
from kvserve.engine.errors import InsufficientQuota, RateLimitExceeded
from kvserve.metering.budgets import Budget
from kvserve.metering.money import format_money
from kvserve.metering.prices import worst_case_price
from kvserve.metering.rate_limits import RateState

if TYPE_CHECKING:
    from kvserve.store import AsyncStore


class BudgetShare(Protocol):
    async def lease(self, tenant: str, budget: Budget, need: float) -> str | None:
        """Raise this region's allotment of `budget` by at least `need`: None when it did, else why not."""


class MeteringGate:
    def __init__(self):
        self.store: "AsyncStore | None" = None
        self.share: BudgetShare | None = None  # set by a region front whose budgets are shared

    def open(self, store: "AsyncStore") -> None:
        self.store = store

    async def admit(self, tenant: str, model: str, price: ModelPrice, tier: str,
                    requests: list[tuple[str, int, int]]) -> RateState | None:
        """Hold (request id, prompt tokens, output tokens at most) for each; the tenant's rate window after
        (its x-ratelimit-* headers), None without limits. InsufficientQuota / RateLimitExceeded if refused."""
        store = self.store
        if store is None or not await store.ameters(tenant):
            return None
        asks = [(rid, worst_case_price(price, tier, prompt, out), prompt + out) for rid, prompt, out in requests]
        total = sum(a[1] for a in asks)
        got = await store.aadmit(tenant, model, asks)
        why_not = ""
        for _ in range(2):  # the per-model budget and the all-models one may each need a lease
            s = got.short
            if s is None or self.share is None or s.allotment is None or not s.fits_globally(total):
                break
            why = await self.share.lease(tenant, s, total - s.remaining)
            if why is not None:
                why_not = f"; {why}"
                break
            got = await store.aadmit(tenant, model, asks)
        if got.rate_limited:
            r = got.rate
            what = "requests" if r.rpm is not None and r.requests + 1 > r.rpm else "tokens"
            raise RateLimitExceeded(f"rate limit reached for tenant {tenant}: {what} per minute "
                                    f"({r.rpm if what == 'requests' else r.tpm}); retry in {r.reset_s:.1f} s",
                                    retry_after=r.reset_s, headers=r.headers())
        if got.short is not None:
            s = got.short
            scope = "all models" if s.model == "*" else f"model {s.model}"
            period = {"none": "total", "day": "daily", "month": "monthly"}[s.period]
            here = "" if s.allotment is None else " in this region"
            raise InsufficientQuota(f"this request could cost up to {format_money(total)}; the {period} budget of "
                                    f"tenant {tenant} for {scope} has {format_money(s.remaining)} left{here} of "
                                    f"{format_money(s.amount)}{why_not} (lower max_tokens, or raise the budget)")
        return got.rate

    async def release(self, tenant: str, request_ids: list[str]) -> None:
        if self.store is not None and request_ids and await self.store.ameters(tenant):
            await self.store.arelease(tenant, request_ids)
