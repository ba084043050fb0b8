"""Which cached block the pool gives up first: fair between tenants, least recently used within one.

Pure Python. The prefix cache's evictable blocks (unreferenced, hashed) are held per tenant in LRU order. A
plain global LRU lets one tenant sending long prompts push every other tenant's cached prefixes out; here
each tenant's share of the cached blocks is bounded by its weight (the same weights as the scheduler's
fairness between tenants, 1 unless configured), and a block is taken from the tenant furthest over its
share: the largest cached blocks / weight. Within that tenant the oldest block goes first. A tenant's
`pinned` blocks (an operator's budget, for system prompts) are kept while any other tenant has blocks over
its pin; only when every tenant is within its pin does the oldest block overall go. Blocks a request asked to
retain (`prompt_cache_retention`, a TTL) are kept until it expires while any block is not so retained; then
they join their tenant's LRU as if they had just been used. Running sequences' blocks are referenced, never in
here: no tenant's cache is made at the cost of another's running work.
"""
from __future__ import annotations

import heapq
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
        self._retained: dict[int, float] = {}  # block -> retained until (the caller's clock), not in _by_tenant
        self._expiries: list[tuple[float, int]] = []  # heap of (until, block); stale entries skipped

    def __len__(self) -> int:
        return len(self._tenant_of)

    def __contains__(self, bid: int) -> bool:
        return bid in self._tenant_of

    def __iter__(self) -> Iterator[int]:
        return iter(self._tenant_of)

    def tenant_of(self, bid: int) -> str:
        return self._tenant_of[bid]

    def tenants(self) -> dict[str, int]:
        """Cached blocks per tenant."""
        return {t: len(lru) for t, lru in self._by_tenant.items()}

    def newest_first(self) -> list[int]:
        """Every evictable block, the retained ones first (kept on purpose), then the most recently used of any
        tenant: the order a shutdown saves them in (the reverse of eviction's, between tenants too)."""
        retained = sorted(self._retained, key=self._retained.__getitem__, reverse=True)
        stamped = [(stamp, bid) for lru in self._by_tenant.values() for bid, stamp in lru.items()]
        return retained + [bid for _, bid in sorted(stamped, reverse=True)]

    def add(self, bid: int, tenant: str, retain_until: float = 0.0, now: float = 0.0) -> None:
        """The block became evictable (its last reference went): the newest of its tenant's, or retained until
        `retain_until` where that is later than `now`."""
        self._tenant_of[bid] = tenant
        if retain_until > now:
            self._retained[bid] = retain_until
            heapq.heappush(self._expiries, (retain_until, bid))
        else:
            self._by_tenant.setdefault(tenant, OrderedDict())[bid] = next(self._clock)

    def remove(self, bid: int) -> None:
        """The block is referenced again (a prefix hit)."""
        tenant = self._tenant_of.pop(bid)
        if self._retained.pop(bid, None) is not None:
            return
        lru = self._by_tenant[tenant]
        del lru[bid]
        if not lru:
            del self._by_tenant[tenant]

    def pop_victim(self, now: float = 0.0) -> int:
        """Take the block to evict: the oldest of the tenant furthest over its share, outside the pins and the
        retained blocks; the retained one that expires first when only those are left."""
        if not self._tenant_of:
            raise KeyError("no cached block to evict")
        self._expire(now)
        if not self._by_tenant:
            until, bid = heapq.heappop(self._expiries)
            while self._retained.get(bid) != until:
                until, bid = heapq.heappop(self._expiries)
            self.remove(bid)
            return bid
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

    def _expire(self, now: float) -> None:
        """Retained blocks whose time is up join their tenant's LRU, as the newest."""
        while self._expiries and self._expiries[0][0] <= now:
            until, bid = heapq.heappop(self._expiries)
            if self._retained.get(bid) == until:
                del self._retained[bid]
                self._by_tenant.setdefault(self._tenant_of[bid], OrderedDict())[bid] = next(self._clock)
