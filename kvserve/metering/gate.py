"""The budget gate: the service asks it before submitting a call's engine requests.

Each engine request's worst-case price (its prompt at the input price, max_tokens x n at the output price)
is held in the tenant's budgets in one store transaction (store/budgets.py); a call that does not fit is
refused with 429 insufficient_quota before any engine work. The hold is settled by the request's usage
row (its real price) whatever way it ends (finished, aborted, failed, migrated: one row per request), or
released here when the request never reached an engine. Tenants without a budget skip the transaction
(a cached per-tenant flag).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.config import ModelPrice
from kvserve.engine.errors import InsufficientQuota
from kvserve.metering.prices import worst_case_price

if TYPE_CHECKING:
    from kvserve.store import AsyncStore


class BudgetGate:
    def __init__(self):
        self.store: "AsyncStore | None" = None

    def open(self, store: "AsyncStore") -> None:
        self.store = store

    async def reserve(self, tenant: str, model: str, price: ModelPrice, tier: str,
                      requests: list[tuple[str, int, int]]) -> None:
        """Hold (request id, prompt tokens, output tokens at most) for each; InsufficientQuota if they do not fit."""
        store = self.store
        if store is None or not await store.ahas_budget(tenant):
            return
        asks = [(rid, worst_case_price(price, tier, prompt, out)) for rid, prompt, out in requests]
        short = await store.areserve(tenant, model, asks)
        if short is not None:
            scope = "all models" if short.model == "*" else f"model {short.model}"
            raise InsufficientQuota(
                f"this request could cost up to ${sum(a for _, a in asks):.6f}; the {short.period if short.period != 'none' else 'total'}"
                f" budget of tenant {tenant} for {scope} has ${short.remaining:.6f} left of ${short.amount:.6f}"
                " (lower max_tokens, or raise the budget)")

    async def release(self, tenant: str, request_ids: list[str]) -> None:
        if self.store is not None and request_ids and await self.store.ahas_budget(tenant):
            await self.store.arelease(tenant, request_ids)
