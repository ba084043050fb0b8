"""The metering gate: the service asks it before submitting a call's engine requests.

Each engine request's worst case, its prompt at the input price plus max_tokens x n at the output price
(metering/prices.py) and prompt + max_tokens x n tokens, is held in the tenant's budgets and counted in
its rate-limit window in one store transaction (store/metering.py). A call that does not fit is refused
before any engine work: 429 insufficient_quota (a budget), or 429 rate_limit_exceeded with Retry-After
(the window). The hold is settled by the request's usage row (real price, real tokens) however it ends
(finished, aborted, failed, migrated: one row per request), or released here when the request never
reached an engine. Tenants with neither a budget nor limits skip the transaction (cached flags). A hold is
leased (store/metering.py): the gate keeps this process's holds, and the server renews their leases
(`held`, `renew`), so the holds of a process that died lapse within a lease.

Budgets and rate limits shared by regions (metering/escrow.py): a call that does not fit this region's
allotment but would fit the whole limit asks the ledger region for a lease (`LimitShare`, the region front's)
and is admitted again; refused if no lease comes (the pool is spent, or the ledger cannot be reached: a
partition costs refusals).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvserve.config import ModelPrice
from kvserve.engine.errors import InsufficientQuota, RateLimitExceeded
from kvserve.metering.money import format_money
from kvserve.metering.prices import worst_case_price
from kvserve.metering.rate_limits import RateState

if TYPE_CHECKING:
    from kvserve.store import AsyncStore


class LimitShare(Protocol):
    async def lease(self, tenant: str, key: str, start: float, need: float) -> str | None:
        """Raise this region's allotment of a budget (`key` its model key) in the period that began at `start`,
        or of a rate limit (metering/rate_limits.SHARED_KEYS) in that window, by at least `need`: None when it
        did, else why not."""


class MeteringGate:
    def __init__(self):
        self.store: "AsyncStore | None" = None
        self.share: LimitShare | None = None  # set by a region front whose limits are shared
        self._held: set[tuple[str, str]] = set()  # (tenant, request id): holds this process took, maybe settled

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
        total, tokens = sum(a[1] for a in asks), sum(a[2] for a in asks)
        got = await store.aadmit(tenant, model, asks)
        why_not = ""
        for _ in range(3):  # the rate limits, the per-model budget and the all-models one may each need leases
            wants = self._wants(got, total, tokens)
            if not wants:
                break
            why = next((w for w in [await self.share.lease(tenant, *want) for want in wants] if w is not None), None)
            if why is not None:
                why_not = f"; {why}"
                break
            got = await store.aadmit(tenant, model, asks)
        if got.rate_limited:
            r = got.rate
            what = "requests" if r.rpm is not None and not r.allows_within(0, r.allot_requests, None) else "tokens"
            here = "" if r.allot_requests is None and r.allot_tokens is None else " (this region's share of it)"
            raise RateLimitExceeded(f"rate limit reached for tenant {tenant}: {what} per minute "
                                    f"({r.rpm if what == 'requests' else r.tpm}){here}{why_not}; retry in "
                                    f"{r.reset_s:.1f} s",
                                    retry_after=r.reset_s, headers=r.headers())
        if got.short is not None:
            s = got.short
            scope = "all models" if s.model == "*" else f"model {s.model}"
            period = {"none": "total", "day": "daily", "month": "monthly"}[s.period]
            here = "" if s.allotment is None else " in this region"
            raise InsufficientQuota(f"this request could cost up to {format_money(total)}; the {period} budget of "
                                    f"tenant {tenant} for {scope} has {format_money(s.remaining)} left{here} of "
                                    f"{format_money(s.amount)}{why_not} (lower max_tokens, or raise the budget)")
        self._held.update((tenant, rid) for rid, _, _ in asks)
        return got.rate

    def _wants(self, got, dollars: float, tokens: int) -> list[tuple[str, float, float]]:
        """The leases (key, period start, need) that would admit a refused call: only where the region's
        allotment refused what the whole limit would allow."""
        if self.share is None or got.admitted:
            return []
        r = got.rate
        if got.rate_limited:
            if r is None or not r.allows_globally(tokens):
                return []
            return [(key, r.window_start, need) for key, need in r.needs(tokens).items()]
        s = got.short
        if s.allotment is None or not s.fits_globally(dollars):
            return []
        return [(s.model, s.period_start, dollars - s.remaining)]

    async def release(self, tenant: str, request_ids: list[str]) -> None:
        if self.store is not None and request_ids and await self.store.ameters(tenant):
            await self.store.arelease(tenant, request_ids)
            self._held.difference_update((tenant, rid) for rid in request_ids)

    def held(self) -> list[tuple[str, str]]:
        return list(self._held)

    async def renew(self, held: list[tuple[str, str]]) -> None:
        """Renew the leases of `held` (from held()); forget those no longer held (their usage rows settled them)."""
        still = set(await self.store.arenew_holds(held))
        self._held.difference_update(h for h in held if h not in still)
