"""KVCacheManager: example tests plus a stateful property test that simulates the runner's memory.

The state machine keeps a fake device and host memory (one token id per slot) and plays each step
the way the runner would: swap-out copies, swap-in copies, COW copies, then the forward writes.
After every step each sequence's computed tokens must read back from its block table, which checks
the ordering hazards (reused blocks, pinned COW sources) and not only the counts.
"""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from kvserve.engine.kv.manager import CachedPrefix, KVCacheManager, hash_block, num_blocks_for
from kvserve.engine.kv.groups import NULL_PAGE, KVLayout
from kvserve.engine.request import Sequence
from kvserve.engine.sampling import SamplingParams

_ids = itertools.count()


def make_seq(tokens: list[int], salt: str | None = None) -> Sequence:
    n = next(_ids)
    return Sequence(seq_id=n, request_id=f"r{n}", prompt_token_ids=list(tokens), sampling=SamplingParams(),
                    cache_salt=salt, tenant=salt or "default")  # the server salts with the tenant


def admit(kv: KVCacheManager, seq: Sequence) -> int:
    """Prefix lookup + allocation for the whole prompt, as the scheduler does on first schedule."""
    cached = kv.get_computed_blocks(seq)
    seq.num_computed_tokens = cached
    assert kv.allocate_slots(seq, seq.num_tokens - cached)
    return cached


def compute(kv: KVCacheManager, seq: Sequence) -> None:
    """Pretend the runner computed everything allocated; register full blocks."""
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)


def all_blocks_back(kv: KVCacheManager) -> bool:
    u = kv.usage()
    return u.used_device_blocks == 0 and u.free_device_blocks + u.cached_device_blocks == kv.num_device_blocks


# ---- example tests -------------------------------------------------------------------------------

def test_num_blocks_for():
    assert num_blocks_for(23_040 * 16 * 10, 16, 23_040) == 10
    assert num_blocks_for(23_040 * 16 * 10 - 1, 16, 23_040) == 9
    with pytest.raises(ValueError):
        num_blocks_for(100, 0, 1)


def test_reset_forgets_the_cached_prefix_blocks_once_no_sequence_holds_blocks():
    kv = KVCacheManager(num_device_blocks=8, block_size=4)
    seq = make_seq(list(range(12)))
    admit(kv, seq)
    compute(kv, seq)
    with pytest.raises(RuntimeError, match="hold KV blocks"):
        kv.reset_prefix_cache()
    kv.free(seq)
    assert kv.reset_prefix_cache() == 3 and kv.usage().cached_device_blocks == 0 and all_blocks_back(kv)
    assert admit(kv, make_seq(list(range(12)))) == 0  # no hit


def test_allocate_grows_on_demand_and_fails_without_side_effects():
    kv = KVCacheManager(num_device_blocks=4, block_size=4, enable_prefix_caching=False)
    seq = make_seq(list(range(6)))
    assert kv.allocate_slots(seq, 6)
    assert len(kv.block_table(seq)) == 2
    seq.num_computed_tokens = 6
    assert kv.allocate_slots(seq, 2)  # fills block 2
    assert len(kv.block_table(seq)) == 2
    big = make_seq(list(range(100, 112)))
    before = kv.usage()
    assert not kv.allocate_slots(big, 12)  # needs 3, only 2 free
    assert kv.usage() == before and not kv.has_blocks(big)
    kv.free(seq)
    assert all_blocks_back(kv)
    kv.check_integrity()


def test_prefix_hit_returns_cached_tokens_and_never_the_last_token():
    kv = KVCacheManager(num_device_blocks=16, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = make_seq(prompt, salt="t1")
    assert admit(kv, a) == 0
    compute(kv, a)
    b = make_seq(prompt + [99], salt="t1")
    assert kv.cached_prefix(b) == CachedPrefix(pool_tokens=8)
    assert kv.cached_prefix(make_seq(prompt + [99], salt="t2")) == CachedPrefix()
    assert admit(kv, b) == 8
    assert kv.cached_prefix(b) == CachedPrefix()  # it holds blocks now: no lookup left to make
    assert kv.block_table(b)[:2] == kv.block_table(a)[:2]
    # A prompt of exactly two full blocks may reuse only the first: the last token must be computed.
    c = make_seq(prompt[:8], salt="t1")
    assert admit(kv, c) == 4
    u = kv.usage()
    assert u.prefix_hit_tokens == 12 and u.prefix_query_tokens == 10 + 11 + 8
    kv.check_integrity()
    for s in (a, b, c):
        kv.free(s)
    assert all_blocks_back(kv)
    kv.check_integrity()


def test_cross_salt_miss():
    kv = KVCacheManager(num_device_blocks=16, block_size=4)
    prompt = list(range(13))
    a = make_seq(prompt, salt="tenant-a")
    admit(kv, a)
    compute(kv, a)
    assert admit(kv, make_seq(prompt, salt="tenant-b")) == 0
    assert admit(kv, make_seq(prompt, salt=None)) == 0
    assert admit(kv, make_seq(prompt, salt="tenant-a")) == 12
    assert hash_block(None, [1, 2], "a") != hash_block(None, [1, 2], None) != hash_block(None, [1, 2], "")


def test_freed_hashed_blocks_are_reused_from_the_lru():
    kv = KVCacheManager(num_device_blocks=8, block_size=4)
    a = make_seq(list(range(9)))
    admit(kv, a)
    compute(kv, a)
    kv.free(a)
    u = kv.usage()
    assert u.cached_device_blocks == 2 and u.used_device_blocks == 0
    b = make_seq(list(range(9)) + [5])
    assert admit(kv, b) == 8
    assert kv.usage().cached_device_blocks == 0
    kv.check_integrity()


def test_lru_eviction_order():
    kv = KVCacheManager(num_device_blocks=6, block_size=4)
    seqs = [make_seq([100 * k + i for i in range(5)]) for k in range(3)]  # 1 full block + 1 token each
    for s in seqs:
        admit(kv, s)
        compute(kv, s)
    for s in seqs:  # freed oldest first: seqs[0]'s full block is least recently used
        kv.free(s)
    assert kv.usage().cached_device_blocks == 3
    # Take the 3 plain free blocks, then one more: that one evicts seqs[0]'s block.
    filler = make_seq(list(range(1000, 1016)))
    assert kv.allocate_slots(filler, 16)
    assert kv.usage().cached_device_blocks == 2
    for k, expect in ((0, 0), (1, 4), (2, 4)):
        probe = make_seq(seqs[k].prompt_token_ids + [7])
        assert kv.get_computed_blocks(probe) == expect
        kv.free(probe)
    kv.check_integrity()


def test_lru_touch_moves_a_hit_to_the_back():
    kv = KVCacheManager(num_device_blocks=4, block_size=4)
    a, b = make_seq(list(range(5))), make_seq(list(range(50, 55)))
    for s in (a, b):
        admit(kv, s)
        compute(kv, s)
    kv.free(a)
    kv.free(b)
    again = make_seq(list(range(5)))  # hit on a's block, then release it: now most recent
    assert admit(kv, again) == 4
    kv.free(again)
    filler = make_seq(list(range(200, 212)))
    assert kv.allocate_slots(filler, 12)  # 2 free + 1 eviction: b's block goes first
    assert kv.get_computed_blocks(make_seq(list(range(5)))) == 4


def test_fork_shares_blocks_and_copy_on_write_records_the_copy():
    kv = KVCacheManager(num_device_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = make_seq(list(range(6)))
    admit(kv, parent)
    compute(kv, parent)
    child = make_seq(list(range(6)))
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    assert kv.block_table(child) == kv.block_table(parent)
    kv.check_integrity()
    assert not kv.can_swap_out(parent)  # shared blocks: not swappable
    shared_full, shared_partial = kv.block_table(parent)
    parent.append_token(42)
    assert kv.allocate_slots(parent, 1)  # writes position 6 of the shared partial block
    new_table = kv.block_table(parent)
    assert new_table[0] == shared_full and new_table[1] != shared_partial
    kv.check_integrity()  # the pending copy still holds its source
    assert kv.take_pending_copies() == [(shared_partial, new_table[1])]
    child.append_token(43)
    assert kv.allocate_slots(child, 1)  # child is now the only holder: writes in place
    assert kv.block_table(child) == [shared_full, shared_partial]
    assert kv.take_pending_copies() == []
    for s in (parent, child):
        kv.free(s)
    assert all_blocks_back(kv)
    kv.check_integrity()


def test_cow_copy_dropped_when_destination_freed():
    kv = KVCacheManager(num_device_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = make_seq(list(range(6)))
    admit(kv, parent)
    compute(kv, parent)
    child = make_seq(list(range(6)))
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    child.append_token(1)
    assert kv.allocate_slots(child, 1)
    assert not kv.can_swap_out(child)  # its new block is filled by a copy later this step
    kv.free(child)
    kv.check_integrity()
    assert kv.take_pending_copies() == []


def test_cow_source_is_not_reused_before_the_copy_runs():
    kv = KVCacheManager(num_device_blocks=3, block_size=4, enable_prefix_caching=False)
    parent = make_seq([1, 2])
    admit(kv, parent)
    compute(kv, parent)
    child = make_seq([1, 2])
    child.num_computed_tokens = 2
    kv.fork(parent, child)
    (src,) = kv.block_table(parent)
    child.append_token(3)
    assert kv.allocate_slots(child, 1)
    kv.free(parent)  # src is now held only by the pending copy
    other = make_seq(list(range(8)))
    assert not kv.allocate_slots(other, 8)  # 1 free block left, src is not among them
    assert kv.take_pending_copies() == [(src, kv.block_table(child)[0])]
    assert kv.allocate_slots(other, 8)  # after the step src is free again
    kv.check_integrity()


def test_cow_destination_not_swappable_in_its_step():
    kv = KVCacheManager(num_device_blocks=4, num_host_blocks=4, block_size=4, enable_prefix_caching=False)
    parent = make_seq([1, 2])
    admit(kv, parent)
    compute(kv, parent)
    child = make_seq([1, 2])
    child.num_computed_tokens = 2
    kv.fork(parent, child)
    child.append_token(3)
    assert kv.allocate_slots(child, 1)
    assert all(kv._blocks[b].ref_count == 1 for b in kv.block_table(child))
    assert not kv.can_swap_out(child)  # swap-out copies run before COW copies
    kv.take_pending_copies()
    assert kv.can_swap_out(child)


def test_swap_out_and_in_round_trip():
    kv = KVCacheManager(num_device_blocks=4, num_host_blocks=4, block_size=4)
    seq = make_seq(list(range(9)))
    admit(kv, seq)
    compute(kv, seq)
    table = kv.block_table(seq)
    assert kv.can_swap_out(seq)
    out = kv.swap_out(seq)
    assert [d for d, _ in out] == table and kv.is_swapped(seq)
    assert kv.usage().used_host_blocks == 3 and kv.usage().used_device_blocks == 0
    kv.check_integrity()
    assert kv.can_swap_in(seq, 1) and not kv.can_swap_in(seq, 8)
    back = kv.swap_in(seq)
    assert [h for h, _ in back] == [h for _, h in out]
    assert not kv.can_swap_out(seq)  # not again in the same step
    kv.take_pending_copies()
    assert kv.can_swap_out(seq)
    kv.free(seq)
    assert all_blocks_back(kv) and kv.usage().used_host_blocks == 0
    kv.check_integrity()


def test_swap_out_needs_host_room():
    kv = KVCacheManager(num_device_blocks=4, num_host_blocks=1, block_size=4)
    seq = make_seq(list(range(8)))
    admit(kv, seq)
    assert not kv.can_swap_out(seq)


def test_lookup_counted_only_when_admitted():
    kv = KVCacheManager(num_device_blocks=2, block_size=4)
    seq = make_seq(list(range(20)))
    assert kv.get_computed_blocks(seq) == 0
    assert not kv.allocate_slots(seq, 20)
    kv.free(seq)
    assert kv.usage().prefix_query_tokens == 0


# ---- stateful property test ----------------------------------------------------------------------

BS = 4


class FakeTier:
    """A lower tier in memory; a broken entry is listed but cannot be read intact (a corrupt file)."""

    def __init__(self):
        self.entries: dict[bytes, list] = {}
        self.broken: set[bytes] = set()

    def contains(self, key: bytes) -> bool:
        return key in self.entries

    def get(self, key: bytes):
        return None if key in self.broken else self.entries.get(key)


    def load_seconds(self, keys: list[bytes]) -> float:
        return 0.001 * len(keys)

    def level(self, key: bytes) -> str | None:
        return "disk" if key in self.entries else None

    def level_bytes(self) -> dict[str, int]:
        return {"disk": len(self.entries)}


class KVMachine(RuleBasedStateMachine):
    """Random allocate/append/fork/free/swap with a fake runner checking contents each step."""

    seqs = Bundle("seqs")
    layout: KVLayout | None = None  # one full-attention group
    pages, host_pages = 12, 8
    tiered = False

    def __init__(self):
        super().__init__()
        self.tier = FakeTier() if self.tiered else None
        self.kv = KVCacheManager(num_device_blocks=self.pages, num_host_blocks=self.host_pages, block_size=BS,
                                 layout=self.layout, tier=self.tier)
        self.dev: list[list[int | None]] = [[None] * BS for _ in range(self.pages)]
        self.host: list[list[int | None]] = [[None] * BS for _ in range(self.host_pages)]
        self.live: dict[int, Sequence] = {}
        self.writes: dict[int, tuple[int, int]] = {}  # seq id -> (start, n) scheduled this step
        self.swap_out_ops: list[tuple[int, int]] = []
        self.swap_in_ops: list[tuple[int, int]] = []

    @rule(target=seqs, prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], []]),
          tail=st.lists(st.integers(0, 3), max_size=9), salt=st.sampled_from([None, "a", "b"]),
          chunk=st.integers(1, 12))
    def add(self, prefix, tail, salt, chunk):
        seq = make_seq(prefix + tail or [0], salt)
        cached = self.kv.get_computed_blocks(seq)
        assert cached % BS == 0 and cached < seq.num_tokens
        seq.num_computed_tokens = cached
        n = min(chunk, seq.num_tokens - cached)
        if not self.kv.allocate_slots(seq, n):
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            return seq  # never admitted: later rules skip it
        self.live[seq.seq_id] = seq
        self.writes[seq.seq_id] = (cached, n)
        return seq

    @rule(seq=seqs, chunk=st.integers(1, 6), token=st.integers(0, 3))
    def step_seq(self, seq, chunk, token):
        if seq.seq_id not in self.live or seq.seq_id in self.writes or self.kv.is_swapped(seq):
            return
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(token)
        n = min(chunk, seq.num_uncomputed_tokens)
        if self.kv.allocate_slots(seq, n):
            self.writes[seq.seq_id] = (seq.num_computed_tokens, n)

    @rule(target=seqs, parent=seqs, token=st.integers(0, 3))
    def fork(self, parent, token):
        if parent.seq_id not in self.live or parent.seq_id in self.writes or self.kv.is_swapped(parent):
            return parent
        child = make_seq(parent.prompt_token_ids, parent.cache_salt)
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        self.live[child.seq_id] = child
        if child.num_uncomputed_tokens == 0:
            child.append_token(token)  # diverge from the parent
        return child

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq.seq_id in self.live:
            self.kv.free(seq)
            del self.live[seq.seq_id]
            self.writes.pop(seq.seq_id, None)

    @rule(seq=seqs)
    def swap_out(self, seq):
        if seq.seq_id in self.live and self.kv.can_swap_out(seq):
            self.swap_out_ops += self.kv.swap_out(seq)
            self.writes.pop(seq.seq_id, None)  # the scheduler unschedules a preempted sequence

    @rule(seq=seqs)
    def swap_in(self, seq):
        if seq.seq_id in self.live and self.kv.can_swap_in(seq):
            self.swap_in_ops += self.kv.swap_in(seq)

    @rule()
    def end_step(self):
        """Play the step like the runner: swap-out, swap-in, COW copies, then the forward writes."""
        tier_ops = self.kv.take_tier_ops()
        copies = self.kv.take_pending_copies()
        for d, key in tier_ops.offload:
            self.tier.entries[key] = list(self.dev[d])
        for d, h in self.swap_out_ops:
            self.host[h] = list(self.dev[d])
        for d, page in tier_ops.load:
            self.dev[d] = list(page)
        for h, d in self.swap_in_ops:
            self.dev[d] = list(self.host[h])
        for src, dst in copies:
            self.dev[dst] = list(self.dev[src])
        for seq_id, (start, n) in self.writes.items():
            seq = self.live[seq_id]
            tokens = seq.token_ids
            for table in self.kv.block_tables(seq):
                for pos in range(start, start + n):
                    assert self.kv.layout.reserved_pages == 0 or table[pos // BS] != NULL_PAGE
                    self.dev[table[pos // BS]][pos % BS] = tokens[pos]
            seq.num_computed_tokens = start + n
            self.kv.cache_full_blocks(seq)
        self.swap_out_ops, self.swap_in_ops, self.writes = [], [], {}
        self.check_contents()

    def check_contents(self):
        for seq in self.live.values():
            if self.kv.is_swapped(seq):
                continue
            tokens = seq.token_ids
            end = seq.num_computed_tokens
            for table, group in zip(self.kv.block_tables(seq), self.kv.groups):
                # What the next query (at position `end`) and every later one reads in this group.
                first = 0 if group.window is None else max(0, end - group.window + 1)
                read = sorted({*range(min(group.sinks, end)), *range(first, end)})
                assert all(self.kv.layout.reserved_pages == 0 or table[p // BS] != NULL_PAGE
                           for p in read), f"seq {seq.seq_id} let go of a block it reads"
                got = [self.dev[table[p // BS]][p % BS] for p in read]
                assert got == [tokens[p] for p in read], f"seq {seq.seq_id} reads wrong K/V"

    @invariant()
    def integrity(self):
        self.kv.check_integrity()

    def teardown(self):
        self.end_step()
        for seq in list(self.live.values()):
            self.kv.free(seq)
        self.kv.take_pending_copies()
        self.kv.check_integrity()
        assert all_blocks_back(self.kv)
        assert self.kv.usage().used_host_blocks == 0


KVMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
TestKVMachine = KVMachine.TestCase


class GroupedKVMachine(KVMachine):
    """The same with KV groups: one full-attention layer and two sliding ones (a window of 6 tokens over
    blocks of 4), so sliding tables let blocks go while full ones keep them, prefix hits need only a
    window's blocks, and every page of a step is read back through its own group's table."""

    layout = KVLayout.for_windows([None, 6, 6])
    pages, host_pages = 30, 20


GroupedKVMachine.TestCase.settings = KVMachine.TestCase.settings
TestGroupedKVMachine = GroupedKVMachine.TestCase


class SinkKVMachine(GroupedKVMachine):
    """The grouped machine where the sliding groups also keep attention sinks (the first 3 tokens: one block),
    as the sinks + window policy does: their tables keep the sinks' block, let the middle go, keep the window."""

    layout = KVLayout.for_windows([None, 6, 6], sinks=[0, 3, 3])


SinkKVMachine.TestCase.settings = KVMachine.TestCase.settings
TestSinkKVMachine = SinkKVMachine.TestCase


class TieredKVMachine(GroupedKVMachine):
    """The grouped machine over a small pool with a lower tier: evicted prefix blocks go to the tier, lookups
    load them back into fresh blocks (read back through the tables like every other block), and entries the
    tier cannot produce intact end the prefix there."""

    pages, host_pages, tiered = 16, 12, True

    @rule(data=st.data())
    def break_tier_entry(self, data):
        if self.tier.entries:
            self.tier.broken.add(data.draw(st.sampled_from(sorted(self.tier.entries))))


TieredKVMachine.TestCase.settings = KVMachine.TestCase.settings
TestTieredKVMachine = TieredKVMachine.TestCase


@pytest.mark.parametrize("windows", [[None], [None, 6, 6]])
def test_evicted_blocks_come_back_from_the_tier_and_a_broken_page_is_a_miss(windows):
    tier = FakeTier()
    layout = KVLayout.for_windows(windows)
    groups = layout.num_groups
    kv = KVCacheManager(num_device_blocks=4 * groups + layout.reserved_pages, block_size=4, tier=tier, layout=layout)
    a = make_seq(list(range(13)))
    admit(kv, a)
    compute(kv, a)
    kv.free(a)  # its 3 full blocks are cached (in every group)
    b = make_seq([50 + i for i in range(13)])
    admit(kv, b)  # takes every block: a's are evicted to the tier
    ops = kv.take_tier_ops()
    assert len(ops.offload) == 3 * groups and not ops.load
    for _, key in ops.offload:
        tier.entries[key] = b"page"
    compute(kv, b)
    kv.free(b)
    kv.take_pending_copies()
    again = make_seq(list(range(13)))
    # What a lookup would find, as admission's estimates see it (nothing taken): the tier's pages and their read.
    pages = 3 + 2 * (groups - 1)
    assert kv.cached_prefix(again) == CachedPrefix(pool_tokens=0, tier_tokens=12, tier_load_s=pytest.approx(0.001 * pages))
    assert kv.get_computed_blocks(again) == 12
    assert kv.allocate_slots(again, 1)
    assert kv.tier_tokens(again) == (12, 0)  # all from the disk level
    # The sliding groups (window 6) load only the blocks a query at position 12 reads: blocks 1 and 2.
    assert len(kv.take_tier_ops().load) == pages
    assert kv.usage().tier_hit_tokens == 12
    kv.free(again)
    kv.check_integrity()
    # One page broken: the lookup stops at the pool's own prefix instead.
    other = make_seq([50 + i for i in range(13)])
    admit(kv, other)
    compute(kv, other)
    kv.free(other)
    kv.take_tier_ops()
    tier.broken.add(next(iter(tier.entries)))
    third = make_seq(list(range(13)))
    cached = kv.get_computed_blocks(third)
    assert cached < 12
    kv.free(third)
    kv.check_integrity()


def test_a_flooding_tenant_evicts_its_own_cache_first():
    """Tenant b's cached prefix (3 blocks) survives tenant a's prompts (9 blocks each, in a pool of 24), which
    take a's own cached blocks; under a plain LRU (every block one tenant's) the same flood evicts b's prefix."""
    def run(b_tenant: str) -> int:
        kv = KVCacheManager(num_device_blocks=24, block_size=4)
        b = make_seq(list(range(13)), salt="b")
        b.tenant = b_tenant
        admit(kv, b)
        compute(kv, b)
        kv.free(b)
        for k in range(4):  # a's prompts of 8 blocks, one after another
            a = make_seq([100 * (k + 1) + i for i in range(33)], salt="a")
            admit(kv, a)
            compute(kv, a)
            kv.free(a)
        kv.check_integrity()
        again = make_seq(list(range(13)), salt="b")
        again.tenant = b_tenant
        return kv.get_computed_blocks(again)

    assert run("b") == 12
    assert run("a") == 0  # b's blocks counted as a's: one LRU, oldest out first


def test_prompt_cache_retention_keeps_a_prefix_through_a_flood_until_it_expires():
    now = [0.0]
    kv = KVCacheManager(num_device_blocks=12, block_size=4, clock=lambda: now[0])
    kept = make_seq(list(range(13)), salt="t")
    kept.cache_retention_s = 60.0
    admit(kv, kept)
    compute(kv, kept)
    kv.free(kept)

    def flood(k: int) -> None:
        a = make_seq([1000 * (k + 1) + i for i in range(33)], salt="t")  # the same tenant: shares don't help
        admit(kv, a)
        compute(kv, a)
        kv.free(a)

    flood(0)
    now[0] = 30.0
    flood(1)
    again = make_seq(list(range(13)), salt="t")
    assert kv.get_computed_blocks(again) == 12  # retained through both floods
    kv.free(again)
    now[0] = 200.0
    flood(2)
    flood(3)
    late = make_seq(list(range(13)), salt="t")
    assert kv.get_computed_blocks(late) == 0  # expired, then evicted as any block
    kv.free(late)
    kv.check_integrity()


def test_release_tail_gives_back_the_blocks_past_the_tokens():
    """After a verified draft: the rejected drafts' slots (blocks past the sequence's tokens) go back."""
    kv = KVCacheManager(num_device_blocks=8, block_size=4)
    s = make_seq(list(range(5)))
    admit(kv, s)
    compute(kv, s)
    assert kv.allocate_slots(s, 9)  # its next token and 8 drafts: 14 positions, 4 blocks
    assert kv.num_blocks_held(s) == 4
    s.output_token_ids += [7, 8]  # two tokens came of it
    s.num_computed_tokens = 6
    kv.release_tail(s)
    assert kv.num_blocks_held(s) == 2 and kv.num_free_blocks == 6
    kv.check_integrity()
    kv.free(s)
    assert all_blocks_back(kv)
