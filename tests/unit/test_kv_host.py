"""The host-memory tier (engine/kv/host.py): an LRU of pages in a byte budget whose evictions go to the disk tier,
and the KV manager's account of which level each loaded token came from."""
from __future__ import annotations

import pytest

from kvserve.engine.kv.manager import KVCacheManager
from kvserve.engine.kv.disk import DiskKVStore
from kvserve.engine.kv.host import HostKVStore
from tests.unit.test_kv_cache import admit, compute, make_seq

PAGE = 64


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def page(i: int) -> bytes:
    return bytes([i % 251]) * PAGE


@pytest.fixture
def disk(tmp_path):
    store = DiskKVStore(tmp_path, "ns", PAGE, byte_budget=1 << 20)
    yield store
    store.close()


def test_least_recently_used_pages_go_to_the_disk_and_come_back(disk):
    host = HostKVStore(PAGE, byte_budget=3 * PAGE, below=disk)
    for i in range(3):
        assert host.put(key(i), bytearray(page(i)))
    assert host.get(key(0)) == page(0)  # 0 is now the most recent: 1 goes first
    host.put(key(3), page(3))
    assert disk.flush(5)
    assert [host.level(key(i)) for i in range(5)] == ["host", "disk", "host", "host", None]
    assert host.get(key(1)) == page(1) and host.get(key(4)) is None  # from the disk; in neither
    assert host.level_bytes() == {"host": 3 * PAGE, "disk": disk.stored_bytes()}
    assert host.demoted == 1 and host.hits == 1
    assert not host.put(key(9), b"short")  # a page of another size is dropped
    assert host.contains(key(2)) and not host.contains(key(9))


def test_load_estimates_price_each_level():
    host = HostKVStore(PAGE, byte_budget=2 * PAGE)
    host.put(key(0), page(0))
    assert host.load_seconds([key(0)]) == 0.0  # no read measured yet: a memory copy
    host.get(key(0))
    assert host.load_seconds([key(0), key(0)]) > 0
    assert host.load_seconds([key(5)]) is None  # not here, no tier below to ask


def test_bad_budgets_raise():
    with pytest.raises(ValueError):
        HostKVStore(PAGE, PAGE - 1)
    with pytest.raises(ValueError):
        HostKVStore(0, PAGE)


def test_the_manager_counts_host_and_disk_tokens_apart(disk):
    """A prompt's evicted blocks come back from host memory while it holds them, from the disk once the host
    tier has passed them down; the manager says which, per sequence and in total."""
    host = HostKVStore(PAGE, byte_budget=3 * PAGE, below=disk)
    kv = KVCacheManager(num_device_blocks=4, block_size=4, tier=host)

    def evict_with(tokens: list[int]) -> list[bytes]:
        """A prompt taking every block, with the pool's offloads done (the runner's part); their keys."""
        s = make_seq(tokens)
        admit(kv, s)
        keys = [k for _, k in kv.take_tier_ops().offload]
        for k in keys:
            host.put(k, page(k[0]))
        compute(kv, s)
        kv.free(s)
        kv.take_pending_copies()
        return keys

    a = list(range(13))
    evict_with(a)
    a_keys = evict_with([100 + i for i in range(13)])  # a's 3 blocks: to host memory
    assert len(a_keys) == 3
    again = make_seq(a)
    assert kv.get_computed_blocks(again) == 12
    assert kv.allocate_slots(again, 1)
    assert kv.tier_tokens(again) == (12, 12)  # every block from host memory
    assert sorted(p for _, p in kv.take_tier_ops().load) == sorted(page(k[0]) for k in a_keys)
    kv.free(again)
    kv.take_pending_copies()
    evict_with([200 + i for i in range(13)])
    evict_with([300 + i for i in range(13)])  # host memory holds 3 pages: a's go down to the disk
    assert disk.flush(5)
    third = make_seq(a)
    assert kv.get_computed_blocks(third) == 12
    assert kv.allocate_slots(third, 1)
    assert kv.tier_tokens(third) == (12, 0)  # from the disk
    u = kv.usage()
    assert (u.tier_hit_tokens, u.host_hit_tokens) == (24, 12)
    assert u.tier_bytes == host.level_bytes()
    kv.free(third)
    kv.check_integrity()
