"""Fair eviction of cached blocks between tenants (engine/kv/eviction.py), pure."""
from __future__ import annotations

import pytest

from kvserve.engine.kv.eviction import CachedBlocks, KVSharePolicy


def cached(blocks: dict[str, range], policy: KVSharePolicy | None = None) -> CachedBlocks:
    """Blocks made evictable tenant after tenant, in order (so each tenant's first is its oldest)."""
    c = CachedBlocks(policy)
    for tenant, bids in blocks.items():
        for bid in bids:
            c.add(bid, tenant)
    return c


def test_the_tenant_furthest_over_its_share_loses_its_oldest_block():
    c = cached({"flood": range(6), "quiet": range(10, 12)})
    assert [c.pop_victim() for _ in range(4)] == [0, 1, 2, 3]  # 6:2, then 5:2, 4:2, 3:2: always the flood's oldest
    assert c.tenants() == {"flood": 2, "quiet": 2}
    assert c.pop_victim() == 4  # a tie by blocks held: the older oldest block goes (LRU between the two)


def test_weights_scale_the_share():
    c = cached({"gold": range(8), "free": range(10, 13)}, KVSharePolicy(weights={"gold": 4.0}))
    assert c.pop_victim() == 10  # 8 / 4 = 2 < 3 / 1
    c.remove(11)
    assert 11 not in c and len(c) == 9


def test_pinned_blocks_are_kept_while_others_are_over_their_pins():
    c = cached({"system": range(3), "other": range(10, 12)}, KVSharePolicy(pinned_blocks={"system": 3}))
    assert [c.pop_victim() for _ in range(2)] == [10, 11]
    assert c.pop_victim() == 0  # only pinned blocks left: the oldest overall


def test_bad_policies_are_refused():
    with pytest.raises(ValueError):
        KVSharePolicy(weights={"t": 0})
    with pytest.raises(ValueError):
        KVSharePolicy(pinned_blocks={"t": -1})
    with pytest.raises(KeyError):
        CachedBlocks().pop_victim()


def test_retained_blocks_outlast_the_rest_until_their_time_is_up():
    c = CachedBlocks()
    c.add(1, "t", retain_until=100.0, now=0.0)
    c.add(2, "t")
    c.add(3, "u")
    assert c.pop_victim(now=10.0) in (2, 3) and c.pop_victim(now=10.0) in (2, 3)
    c.add(4, "u")
    assert c.pop_victim(now=50.0) == 4  # block 1 is still retained
    c.add(5, "u", retain_until=60.0, now=50.0)
    assert c.pop_victim(now=55.0) == 5  # only retained ones left: the one expiring first
    c.add(6, "u")
    # Expired: back in its tenant's LRU as if just used, so block 6 (older) goes first, then block 1.
    assert [c.pop_victim(now=101.0), c.pop_victim(now=101.0)] == [6, 1]
    assert len(c) == 0
