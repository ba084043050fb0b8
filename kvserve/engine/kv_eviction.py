"""Which cached block the pool gives up first: fair between tenants, least recently used within one.

Pure Python. The prefix cache's evictable blocks (unreferenced, hashed) are held per tenant in LRU order. A
plain global LRU lets one tenant sending long prompts push every other tenant's cached prefixes out; here
each tenant's share of the cached blocks is bounded by its weight (the same weights as the scheduler's
fairness between tenants, 1 unless configured), and a block is taken from the tenant furthest over its
share: the largest cached blocks / weight. Within that tenant the oldest block goes first. A tenant's
`pinned` blocks (an operator's budget, for system prompts) are kept while any other tenant has blocks over
its pin; only when every tenant is within its pin does the oldest block overall go. Running sequences'
blocks are referenced, never in here: no tenant's cache is made at the cost of another's running work.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVSharePolicy:
    """Weights and pinned blocks per tenant; tenants not named weigh `default_weight` and pin nothing."""

    weights: Mapping[str, float] = field(default_factory=dict)
    pinned_blocks: Mapping[str, int] = field(default_factory=dict)
    default_weight: float = 1.0

    def __post_init__(self):
        if self.default_weight <= 0 or any(w <= 0 for w in self.weights.values()):
            raise ValueError("KV share weights must be positive")
        if any(n < 0 for n in self.pinned_blocks.values()):
            raise ValueError("pinned blocks must be >= 0")

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    def pinned(self, tenant: str) -> int:
        return self.pinned_blocks.get(tenant, 0)


class CachedBlocks:
    """The evictable blocks, per tenant, oldest first."""

    def __init__(self, policy: KVSharePolicy | None = None):
        self.policy = policy or KVSharePolicy()
        self._by_tenant: dict[str, OrderedDict[int, int]] = {}  # tenant -> block -> when it became evictable
        self._tenant_of: dict[int, str] = {}
        self._clock = itertools.count()

    def __len__(self) -> int:
        return len(self._tenant_of)

    def __contains__(self, bid: int) -> bool:
        return bid in self._tenant_of

    def __iter__(self) -> Iterator[int]:
        return iter(self._tenant_of)

    def tenant_of(self, bid: int) -> str:
        return self._tenant_of[bid]

    def held(self, tenant: str) -> int:
        lru = self._by_tenant.get(tenant)
        return len(lru) if lru is not None else 0

    def tenants(self) -> dict[str, int]:
        """Cached blocks per tenant."""
        return {t: len(lru) for t, lru in self._by_tenant.items()}

    def add(self, bid: int, tenant: str) -> None:
        """The block became evictable (its last reference went): the newest of its tenant's."""
        self._tenant_of[bid] = tenant
        self._by_tenant.setdefault(tenant, OrderedDict())[bid] = next(self._clock)

    def remove(self, bid: int) -> None:
        """The block is referenced again (a prefix hit)."""
        tenant = self._tenant_of.pop(bid)
        lru = self._by_tenant[tenant]
        del lru[bid]
        if not lru:
            del self._by_tenant[tenant]

    def pop_victim(self) -> int:
        """Take the block to evict: the oldest of the tenant furthest over its share, outside the pins."""
        if not self._tenant_of:
            raise KeyError("no cached block to evict")
        policy = self.policy
        # Furthest over its share; of tenants as far over, the one whose oldest block is oldest (LRU between them).
        over = [(len(lru) / policy.weight(t), -next(iter(lru.values())), t) for t, lru in self._by_tenant.items()
                if len(lru) > policy.pinned(t)]
        if over:
            tenant = max(over)[2]
        else:  # everyone within their pins: the oldest block overall (the first of each LRU is its oldest)
            tenant = min(self._by_tenant, key=lambda t: next(iter(self._by_tenant[t].values())))
        bid = next(iter(self._by_tenant[tenant]))
        self.remove(bid)
        return bid
