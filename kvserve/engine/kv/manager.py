"""Paged KV cache bookkeeping: block tables, reference counts, prefix cache, copy-on-write, swap.

Pure Python: this module hands out block ids; the runner owns the tensors. A model's layers form KV
groups (engine/kv/groups.py): one block table per group and sequence, all drawing blocks ("pages") from
one pool; a sliding-window group lets go of the blocks its window has passed (NULL_PAGE takes their
place in the table). Prefix-cache entries are per group: a block's chained hash is the same in every
group, each group's page holding it is found under (group, hash). Every device block but NULL_PAGE is
in exactly one of three places:

  free     ref 0, no hash                       plain free list (FIFO)
  in use   ref > 0                               held by block tables (and pending COW copies)
  cached   ref 0, hashed, in the LRU             reusable on a prefix hit, evicted when a fresh
                                                 block is needed and the free list is empty

A lower tier (a `LowerTier`, the disk: engine/kv/disk.py) extends the prefix cache: a cached block
evicted from the pool is offloaded to it (the runner copies the page out before anything overwrites it),
and a lookup that runs past the pool's blocks goes on in the tier, whose verified pages are loaded into
fresh blocks (a page the tier cannot produce intact is a miss: the prefix ends before it). With
`write_through` a block is offloaded as soon as it is full and cached; a graceful shutdown writes the pool's
pages the disk lacks (`save_to`), so a restart finds the prefixes either way.

Block operations reach the runner as lists that it executes at the start of the next step, in the
order offload, swap-out, tier loads, swap-in, copy-on-write, forward. The manager keeps that order safe: a COW source
stays referenced until the step's copies are taken, host blocks freed by a swap-in are not reused
until then, and a sequence whose blocks are still being filled this step (swapped in, or the
destination of a COW copy) is not swappable. `take_pending_copies()` closes the step.
"""
from __future__ import annotations

import hashlib
import itertools
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from kvserve.engine.kv.eviction import CachedBlocks, KVSharePolicy
from kvserve.engine.kv.groups import NULL_PAGE, KVGroup, KVLayout
from kvserve.engine.request import Sequence

BlockHash = bytes


class LowerTier(Protocol):
    """Where evicted prefix blocks go and come back from: keyed by tier_key, pages as bytes. One or more
    levels: "host" (engine/kv/host.py, on CUDA), "disk" (engine/kv/disk.py)."""

    def contains(self, key: bytes) -> bool: ...

    def level(self, key: bytes) -> str | None: ...  # the level holding the page; None: not held

    def get(self, key: bytes) -> bytes | None: ...  # None: not there, or not intact

    def level_bytes(self) -> dict[str, int]: ...  # bytes each level holds

    def load_seconds(self, keys: list[bytes]) -> float | None: ...  # reading them back, as measured; None: unknown


@dataclass(frozen=True)
class CachedPrefix:
    """What a prefix lookup would find now (admission's estimates): prompt tokens whose blocks the pool holds,
    the tokens after them that the lower tier holds, and the seconds reading those back takes (None until the
    tier has measured a read)."""

    pool_tokens: int = 0
    tier_tokens: int = 0
    tier_load_s: float | None = 0.0


def tier_key(group: int, block_hash: BlockHash) -> bytes:
    """A block's key in a lower tier: its chained hash (salted per tenant), per KV group."""
    return block_hash if group == 0 else hashlib.sha256(block_hash + group.to_bytes(4, "little")).digest()


@dataclass
class TierOps:
    """A step's lower-tier work for the runner: pages to copy out (to offload under their keys) before
    anything overwrites them, and verified pages to copy into fresh blocks."""

    offload: list[tuple[int, bytes]] = field(default_factory=list)  # (device block, key)
    load: list[tuple[int, bytes]] = field(default_factory=list)  # (device block, page bytes)


def num_blocks_for(memory_bytes: int, block_size: int, kv_bytes_per_token: int) -> int:
    """Number of whole blocks of `block_size` tokens that fit in `memory_bytes` of KV memory."""
    if block_size <= 0 or kv_bytes_per_token <= 0:
        raise ValueError("block_size and kv_bytes_per_token must be positive")
    return max(0, int(memory_bytes) // (block_size * kv_bytes_per_token))


def hash_block(parent: BlockHash | None, token_ids: list[int], cache_salt: str | None) -> BlockHash:
    """Chained hash of one full block. The salt goes into every block, so tenants never share."""
    h = hashlib.sha256()
    h.update(parent if parent is not None else b"root")
    if cache_salt is None:
        h.update(b"\x00")
    else:
        salt = cache_salt.encode()
        h.update(b"\x01" + len(salt).to_bytes(4, "little") + salt)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def token_slice(seq: Sequence, start: int, end: int) -> list[int]:
    """seq.token_ids[start:end] without concatenating the whole prompt and output."""
    prompt, n = seq.prompt_token_ids, seq.num_prompt_tokens
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return seq.output_token_ids[start - n:end - n]
    return prompt[start:] + seq.output_token_ids[:end - n]


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    group: int = 0  # the KV group whose prefix-cache entry this is (while hashed)
    tenant: str = "default"  # whose cached block it is (while hashed)
    retain_until: float = 0.0  # kept in the cache until then (prompt_cache_retention; the manager's clock)


@dataclass
class _SeqBlocks:
    """One sequence's blocks, a table per KV group: on device (`device`) or, while swapped out, on host
    (`host`, None where the device table held NULL_PAGE)."""

    device: list[list[int]]
    host: list[list[int | None]] | None = None
    # Chained hashes of the leading full, computed blocks; kept across swaps to re-register them.
    hashes: list[BlockHash] = field(default_factory=list)
    tenant: str = "default"  # whose cache its registered blocks count in (engine/kv/eviction.py)
    retain_s: float = 0.0  # how long its blocks stay cached after their last use (prompt_cache_retention)


@dataclass(frozen=True)
class KVCacheUsage:
    num_device_blocks: int
    used_device_blocks: int  # ref > 0
    cached_device_blocks: int  # ref 0, hashed, evictable
    free_device_blocks: int  # ref 0, no hash
    num_host_blocks: int
    used_host_blocks: int
    prefix_query_tokens: int  # tokens looked up in the prefix cache (admitted sequences only)
    prefix_hit_tokens: int  # of which served from the cache (the pool or the lower tier)
    tier_hit_tokens: int = 0  # of those, loaded from the lower tier
    host_hit_tokens: int = 0  # of those, from its host-memory level (the rest from the disk)
    offloaded_blocks: int = 0  # evicted cached blocks handed to the lower tier
    tier_bytes: dict[str, int] = field(default_factory=dict)  # what each level of the lower tier holds

    @property
    def device_usage(self) -> float:
        """Fraction of device blocks held by sequences (vLLM's kv_cache_usage_perc)."""
        return self.used_device_blocks / self.num_device_blocks if self.num_device_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


class KVCacheManager:
    """Hands out fixed-size device blocks to sequences on demand and tracks who holds which."""

    def __init__(self, num_device_blocks: int, num_host_blocks: int = 0, block_size: int = 16,
                 enable_prefix_caching: bool = True, layout: KVLayout | None = None, tier: LowerTier | None = None,
                 shares: KVSharePolicy | None = None, clock: Callable[[], float] = time.monotonic,
                 write_through: bool = False):
        """`num_device_blocks`: the pool's pages, NULL_PAGE included where the layout slides. `layout`:
        the model's KV groups (default: one group of full attention, the classic paged cache). `tier`: a
        lower tier for evicted prefix blocks (with prefix caching only). `shares`: tenants' weights and pins
        in the prefix cache (engine/kv/eviction.py). `clock`: what retention TTLs are measured on.
        `write_through`: a block goes to the tier once it is full and cached, not only when evicted."""
        self.layout = layout or KVLayout((KVGroup((0,), None),))
        reserved = self.layout.reserved_pages
        if block_size <= 0 or num_device_blocks < reserved or num_host_blocks < 0:
            raise ValueError("block_size must be positive and block counts non-negative")
        self.block_size = block_size
        self.groups = self.layout.groups
        self.num_groups = len(self.groups)
        self.num_pages = num_device_blocks  # the runner's cache tensors hold this many
        self.num_device_blocks = num_device_blocks - reserved  # blocks sequences can hold
        self.num_host_blocks = num_host_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._null = NULL_PAGE if reserved else None  # a table entry that holds nothing
        self._blocks = [_Block(i) for i in range(num_device_blocks)]
        self._free: deque[int] = deque(range(reserved, num_device_blocks))
        self._cached = CachedBlocks(shares)  # evictable: per tenant, oldest first
        self._clock = clock
        self._by_hash: list[dict[BlockHash, int]] = [{} for _ in self.groups]
        self._seqs: dict[int, _SeqBlocks] = {}
        self._host_free: deque[int] = deque(range(num_host_blocks))
        self._host_released: list[int] = []  # freed by swap_in this step; reusable after the step
        self._copies: dict[int, int] = {}  # pending COW copies, dst -> src (insertion ordered)
        self._pins: dict[int, int] = {}  # COW source -> pending copies reading it (each holds a ref)
        self._swapped_in: set[int] = set()  # seq ids swapped in this step
        # seq id -> (queried, hit, from the tier, from its host level) until admitted
        self._pending_lookup: dict[int, tuple[int, int, int, int]] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.tier = tier if enable_prefix_caching else None
        self._tier_ops = TierOps()
        self._loading: dict[int, int] = {}  # device block -> its index in _tier_ops.load
        self._tier_tokens: dict[int, tuple[int, int]] = {}  # seq id -> prompt tokens loaded from the tier, its host
        self.tier_hit_tokens = 0
        self.host_hit_tokens = 0
        self.offloaded_blocks = 0
        self.write_through = write_through and self.tier is not None

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a fresh allocation can take: the free list plus evictable cached blocks."""
        return len(self._free) + len(self._cached)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    @property
    def token_capacity(self) -> int:
        """Tokens the pool holds when every group keeps every block (short sequences)."""
        return self.num_device_blocks // self.num_groups * self.block_size

    def blocks_for_tokens(self, num_tokens: int, new_tokens: int | None = None) -> int:
        """Blocks (over all groups) a sequence of `num_tokens` holds while its last `new_tokens` (default:
        all) are computed: a sliding group holds only what its window reaches (engine/kv/groups.py)."""
        return self.layout.pages_held(num_tokens, self.block_size, new_tokens)

    def block_table(self, seq: Sequence, group: int = 0) -> list[int]:
        """A copy of the sequence's device block table in one group (empty when it holds none)."""
        state = self._seqs.get(seq.seq_id)
        return list(state.device[group]) if state is not None else []

    def block_tables(self, seq: Sequence) -> list[list[int]]:
        """Copies of the sequence's device block tables, one per group."""
        state = self._seqs.get(seq.seq_id)
        return [list(t) for t in state.device] if state is not None else [[] for _ in self.groups]

    def num_blocks_held(self, seq: Sequence) -> int:
        """Device blocks the sequence holds now, over all groups."""
        state = self._seqs.get(seq.seq_id)
        return len(self._pages(state.device)) if state is not None else 0

    def has_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self._seqs

    def is_swapped(self, seq: Sequence) -> bool:
        state = self._seqs.get(seq.seq_id)
        return state is not None and state.host is not None

    # ---- allocation ----------------------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> int:
        """Start a block-less sequence's tables with its longest cached prefix; returns cached tokens.

        Only full blocks count, and never the last token: at least one token must be computed so
        there are logits to sample from. A full-attention group needs every block of the prefix, a
        sliding group only those its window reaches from the prefix's end. Past the pool's blocks the
        lookup goes on in the lower tier, whose pages are read (verified) now and loaded into fresh
        blocks at the start of the step. References are taken at once; the lookup is counted in the hit
        statistics only when a following allocate_slots admits the sequence.
        """
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        hashes = self._held_prefix_hashes(seq)
        n = self._longest_hit(hashes, self._on_device)
        loads: dict[tuple[int, int], tuple[bytes, str]] = {}
        if self.tier is not None and n < len(hashes):
            n, loads = self._tier_hit(hashes, n)
        tables: list[list[int]] = []
        for g, group in enumerate(self.groups):  # the pool's hits first: a load's fresh block may evict one
            table = [self._null] * n
            for i in group.kept(n * bs, n, bs):
                table[i] = self._by_hash[g].get(hashes[i], -1)
                if table[i] >= 0:
                    self._touch(table[i])
            tables.append(table)
        from_disk: set[int] = set()  # blocks of which some group's page came from below host memory
        for (g, i), (page, level) in loads.items():
            tables[g][i] = self._load(g, hashes[i], page, seq.tenant)
            if level != "host":
                from_disk.add(i)
        self._seqs[seq.seq_id] = _SeqBlocks(device=tables, hashes=hashes[:n], tenant=seq.tenant,
                                            retain_s=seq.cache_retention_s)
        if seq.cache_retention_s:  # a hit renews the retention of what it found
            self._retain(self._pages(tables), seq.cache_retention_s)
        cached = n * bs
        loaded = {i for _, i in loads}
        self._pending_lookup[seq.seq_id] = (seq.num_tokens, cached, len(loaded) * bs, len(loaded - from_disk) * bs)
        return cached

    def cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """What get_computed_blocks would find for a block-less sequence now, without taking anything. The tier's
        part is an estimate: a page may yet be found damaged, or the pool short of blocks to load it into."""
        if not self.enable_prefix_caching or seq.seq_id in self._seqs:
            return CachedPrefix()
        hashes = self._held_prefix_hashes(seq)
        on_device = self._longest_hit(hashes, self._on_device)
        n = on_device if self.tier is None else self._longest_hit(hashes, self._on_device_or_tier)
        if n == on_device:
            return CachedPrefix(on_device * self.block_size)
        bs = self.block_size
        keys = [tier_key(g, hashes[i]) for g, group in enumerate(self.groups) for i in group.kept(n * bs, n, bs)
                if hashes[i] not in self._by_hash[g]]
        return CachedPrefix(on_device * bs, (n - on_device) * bs, self.tier.load_seconds(keys))

    def tier_tokens(self, seq: Sequence) -> tuple[int, int]:
        """Of the tokens the sequence's last lookup found cached: those loaded from the lower tier (blocks of
        which some group's page came from there), and of them those whose every page came from its host level."""
        return self._tier_tokens.get(seq.seq_id, (0, 0))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make the tables cover num_computed_tokens + num_new_tokens; False, untouched, if short.

        First a sliding group lets go of the blocks its window has passed (the chunk starting at
        num_computed_tokens and every later one never reads them). Shared blocks in the range about to
        be written get private copies (copy-on-write); the (src, dst) pair is queued for the runner when
        the block holds computed tokens.
        """
        state = self._seqs.get(seq.seq_id)
        if state is not None and state.host is not None:
            raise ValueError(f"sequence {seq.seq_id} is swapped out; swap_in first")
        start = seq.num_computed_tokens
        if state is not None and self._null is not None:
            self._drop_passed_blocks(state, start)
        tables = state.device if state is not None else [[] for _ in self.groups]
        need = self._blocks_covering(start + num_new_tokens)  # the length of every group's table
        cows = [self._shared_in_write_range(table, start, num_new_tokens) for table in tables]
        grow = sum(max(0, need - len(table)) for table in tables)
        if grow + sum(map(len, cows)) > self.num_free_blocks:
            return False
        if state is None:
            state = self._seqs[seq.seq_id] = _SeqBlocks(device=tables, tenant=seq.tenant,
                                                        retain_s=seq.cache_retention_s)
        for table, cow in zip(state.device, cows):
            for idx in cow:
                self._copy_on_write(table, idx, keep_contents=idx * self.block_size < start)
            while len(table) < need:
                table.append(self._take_free_block())
        self._commit_lookup(seq.seq_id)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register hashes of blocks that became full of computed tokens.

        The scheduler calls this after each step (update_from_output), once the runner has
        written the K/V, so a prefix hit never reads a block that is still being filled.
        """
        state = self._seqs.get(seq.seq_id)
        if not self.enable_prefix_caching or state is None or state.host is not None:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(state.device[0]))
        for i in range(len(state.hashes), num_full):
            parent = state.hashes[-1] if state.hashes else None
            h = hash_block(parent, token_slice(seq, i * bs, (i + 1) * bs), seq.cache_namespace)
            state.hashes.append(h)
            for g, table in enumerate(state.device):
                if table[i] != self._null:
                    if self._register(g, table[i], h, state.tenant) and self.write_through:
                        key = tier_key(g, h)
                        if not self.tier.contains(key):  # the runner copies it out before the next forward
                            self._tier_ops.offload.append((table[i], key))
                    if state.retain_s:
                        self._retain([table[i]], state.retain_s)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent; a shared partial block is copied on write."""
        p = self._seqs.get(parent.seq_id)
        if p is None or p.host is not None:
            raise ValueError(f"parent {parent.seq_id} holds no device blocks")
        if child.seq_id in self._seqs:
            raise ValueError(f"child {child.seq_id} already holds blocks")
        for bid in self._pages(p.device):
            self._blocks[bid].ref_count += 1
        self._seqs[child.seq_id] = _SeqBlocks(device=[list(t) for t in p.device], hashes=list(p.hashes),
                                              tenant=p.tenant, retain_s=p.retain_s)

    def free(self, seq: Sequence) -> None:
        """Give back every block the sequence holds (device or host); no-op if it holds none."""
        state = self._seqs.pop(seq.seq_id, None)
        self._pending_lookup.pop(seq.seq_id, None)
        self._tier_tokens.pop(seq.seq_id, None)
        self._swapped_in.discard(seq.seq_id)
        if state is None:
            return
        if state.host is not None:
            self._host_free.extend(b for table in state.host for b in table if b is not None)
        else:
            self._release_pages(state.device)

    def release_tail(self, seq: Sequence) -> None:
        """Give back the blocks past those the sequence's tokens cover: after a verified draft, the slots of the
        drafts the target rejected (never hashed: only computed tokens' blocks are)."""
        state = self._seqs.get(seq.seq_id)
        if state is None or state.host is not None:
            return
        keep = self._blocks_covering(seq.num_tokens)
        for table in state.device:
            while len(table) > keep:
                bid = table.pop()
                if bid != self._null:
                    self._release(bid)

    # ---- swapping ------------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        """Swappable: on device, no block shared, none still being filled this step (a COW copy or a tier load),
        host room."""
        state = self._seqs.get(seq.seq_id)
        if state is None or state.host is not None or seq.seq_id in self._swapped_in:
            return False
        pages = self._pages(state.device)
        if any(self._blocks[b].ref_count != 1 or b in self._copies or b in self._loading for b in pages):
            return False
        return len(pages) <= len(self._host_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's blocks to host; returns (device, host) copies for the runner."""
        if not self.can_swap_out(seq):
            raise ValueError(f"sequence {seq.seq_id} cannot be swapped out")
        state = self._seqs[seq.seq_id]
        mapping: list[tuple[int, int]] = []
        host: list[list[int | None]] = []
        for table in state.device:
            host.append([])
            for bid in table:
                if bid == self._null:
                    host[-1].append(None)
                else:
                    host[-1].append(self._host_free.popleft())
                    mapping.append((bid, host[-1][-1]))
        # The device copies stay valid until the runner reuses them, after the swap-out copies.
        self._release_pages(state.device)
        state.device, state.host = [[] for _ in self.groups], host
        return mapping

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 0) -> bool:
        """Enough free device blocks for the swapped blocks plus growth for num_new_tokens."""
        state = self._seqs.get(seq.seq_id)
        if state is None or state.host is None:
            return False
        want = self._blocks_covering(seq.num_computed_tokens + num_new_tokens)
        need = sum(sum(b is not None for b in table) + max(0, want - len(table)) for table in state.host)
        return need <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence back to fresh device blocks; returns (host, device) copies."""
        if not self.can_swap_in(seq):
            raise ValueError(f"sequence {seq.seq_id} cannot be swapped in")
        state = self._seqs[seq.seq_id]
        assert state.host is not None
        mapping: list[tuple[int, int]] = []
        device: list[list[int]] = []
        for g, table in enumerate(state.host):
            device.append([])
            for i, hb in enumerate(table):
                if hb is None:
                    device[-1].append(self._null)
                    continue
                bid = self._take_free_block()
                device[-1].append(bid)
                mapping.append((hb, bid))
                self._host_released.append(hb)
                if i < len(state.hashes):
                    self._register(g, bid, state.hashes[i], state.tenant)
        state.device, state.host = device, None
        self._swapped_in.add(seq.seq_id)
        return mapping

    def newest_blocks(self) -> list[tuple[int, bytes]]:
        """(device block, tier key) of every block whose page a restart could use, most recently used first: those
        sequences hold (the latest admitted first, each from its prefix's start), the cached ones (retained, then
        newest), then those evicted for the tier whose page no step has copied out yet. Between steps only: a
        page is what its block holds now."""
        out: list[tuple[int, bytes]] = []
        seen: set[int] = set()
        held = (bid for state in reversed(self._seqs.values()) for table in state.device for bid in table)
        for bid in itertools.chain(held, self._cached.newest_first()):
            block = self._blocks[bid]
            if bid in seen or bid == self._null or block.block_hash is None or bid in self._loading:
                continue  # a block with a load pending holds no page yet (the tier has it)
            seen.add(bid)
            out.append((bid, tier_key(block.group, block.block_hash)))
        return out + self._tier_ops.offload

    def save_to(self, disk, read_pages: Callable[[list[int]], list[bytes]], deadline: float, host=None) -> int:
        """A graceful shutdown: write to `disk` (engine/kv/disk.py) what a restart could use that it lacks, the
        pool's pages (`read_pages(blocks)`: the runner copies them out) most recently used first, then the pages
        of `host` (engine/kv/host.py), until `deadline` (time.monotonic()) and within its budget. Between steps
        only. Returns the pages written."""
        pool: dict[bytes, int] = {}
        for bid, key in self.newest_blocks():
            pool.setdefault(key, bid)
        kept = dict(host.newest_pages()) if host is not None else {}
        keys = list(pool) + [k for k in kept if k not in pool]

        def pages(chunk: list[bytes]) -> list[bytes]:
            read = iter(read_pages([pool[k] for k in chunk if k in pool]))
            return [next(read) if k in pool else kept[k] for k in chunk]

        return disk.save(keys, pages, deadline)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block, its page about to be discarded (sleep mode); pending tier copies are
        dropped with them. Only with no sequence holding blocks. Returns the blocks forgotten."""
        if self._seqs:
            raise RuntimeError(f"{len(self._seqs)} sequences hold KV blocks: the prefix cache stays")
        forgotten = 0
        for bid, block in enumerate(self._blocks):
            if block.block_hash is not None and block.ref_count == 0:
                self._cached.remove(bid)
                block.block_hash, block.retain_until = None, 0.0
                self._free.append(bid)
                forgotten += 1
        for by_hash in self._by_hash:
            by_hash.clear()
        self._loading.clear()
        self._tier_ops = TierOps()
        return forgotten

    def take_tier_ops(self) -> TierOps:
        """Hand the step's offloads and loads to the scheduler (before take_pending_copies closes the step)."""
        ops, self._tier_ops = self._tier_ops, TierOps()
        ops.load = [op for op in ops.load if op is not None]
        self._loading.clear()
        return ops

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Hand the step's COW copies (src, dst) to the scheduler and close the step."""
        copies = [(src, dst) for dst, src in self._copies.items()]
        self._copies.clear()
        for src, _ in copies:
            self._unpin(src)
        self._host_free.extend(self._host_released)
        self._host_released.clear()
        self._swapped_in.clear()
        return copies

    # ---- stats and checks ----------------------------------------------------------------------

    def usage(self) -> KVCacheUsage:
        used_host = self.num_host_blocks - len(self._host_free)
        return KVCacheUsage(
            num_device_blocks=self.num_device_blocks,
            used_device_blocks=self.num_device_blocks - len(self._free) - len(self._cached),
            cached_device_blocks=len(self._cached),
            free_device_blocks=len(self._free),
            num_host_blocks=self.num_host_blocks,
            used_host_blocks=used_host,
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            tier_hit_tokens=self.tier_hit_tokens,
            host_hit_tokens=self.host_hit_tokens,
            offloaded_blocks=self.offloaded_blocks,
            tier_bytes=self.tier.level_bytes() if self.tier is not None else {},
        )

    def check_integrity(self) -> None:
        """Raise AssertionError if any bookkeeping invariant fails (used by tests and debug runs)."""
        free, cached = list(self._free), list(self._cached)
        assert len(set(free)) == len(free), "duplicate block in the free list"
        free_set, cached_set = set(free), set(cached)
        holders = [0] * self.num_pages
        for state in self._seqs.values():
            assert state.host is None or not any(state.device), "sequence on both device and host"
            assert len(state.device) == self.num_groups, "a table per group"
            if state.host is None:
                lengths = {len(t) for t in state.device}
                assert len(lengths) == 1, f"groups' tables differ in length: {lengths}"
            pages = self._pages(state.device)
            assert len(set(pages)) == len(pages), "block twice in one sequence's tables"
            for table, group in zip(state.device, self.groups):
                sinks = min(group.sink_blocks(self.block_size), len(table))
                assert self._null is None or self._null not in table[:sinks], "a sink's block let go"
                rest = table[sinks:]
                gone = sum(1 for _ in itertools.takewhile(lambda b: b == self._null, rest))
                assert all(b != self._null for b in rest[gone:]), "a NULL_PAGE after a held block"
                assert group.window is not None or gone == 0, "a full-attention group let a block go"
            for bid in pages:
                holders[bid] += 1
        pins: dict[int, int] = {}
        for src in self._copies.values():
            holders[src] += 1  # the pending copy keeps its source alive
            pins[src] = pins.get(src, 0) + 1
        assert pins == self._pins, "pin counts disagree with pending copies"
        for block in self._blocks:
            bid = block.block_id
            if bid == self._null:
                assert block.ref_count == 0 and block.block_hash is None and holders[bid] == 0, "NULL_PAGE in use"
                assert bid not in free_set and bid not in cached_set, "NULL_PAGE in the pool"
                continue
            places = (bid in free_set) + (bid in cached_set) + (block.ref_count > 0)
            assert places == 1, f"block {bid} is in {places} places (ref {block.ref_count})"
            assert block.ref_count == holders[bid], \
                f"block {bid}: ref {block.ref_count} != {holders[bid]} holders"
            if bid in free_set:
                assert block.block_hash is None, f"free block {bid} carries a hash"
            if bid in cached_set:
                assert block.block_hash is not None, f"cached block {bid} has no hash"
                assert self._cached.tenant_of(bid) == block.tenant, f"cached block {bid} under another tenant"
            if block.block_hash is not None:
                assert self._by_hash[block.group].get(block.block_hash) == bid, f"block {bid} hash not mapped to it"
        for g, by_hash in enumerate(self._by_hash):
            for h, bid in by_hash.items():
                block = self._blocks[bid]
                assert block.block_hash == h and block.group == g, f"hash map points at block {bid} with another hash"
        for dst in self._copies:
            assert self._blocks[dst].ref_count > 0, f"COW destination {dst} is not held"
        host_held = [b for s in self._seqs.values() if s.host is not None for t in s.host for b in t if b is not None]
        host_all = list(self._host_free) + self._host_released + host_held
        assert sorted(host_all) == list(range(self.num_host_blocks)), "host blocks lost or duplicated"

    # ---- internals -----------------------------------------------------------------------------

    def _blocks_covering(self, num_tokens: int) -> int:
        """The length of a table that covers `num_tokens` positions."""
        return -(-num_tokens // self.block_size)

    def _pages(self, tables: list[list[int]]) -> list[int]:
        """The device pages in these tables, NULL_PAGE entries left out."""
        return [b for table in tables for b in table if b != self._null]

    def _held_prefix_hashes(self, seq: Sequence) -> list[BlockHash]:
        """Chained hashes of the sequence's leading full blocks (never the one with its last token: that token
        is computed, for logits) as long as every full-attention group holds them, in the pool or the tier.
        Memoized on the sequence: a full block's tokens never change, and a waiting sequence is looked up again
        every step until it is admitted."""
        bs = self.block_size
        memo = seq.block_hashes
        full = [g for g, group in enumerate(self.groups) if group.window is None]
        held = self._on_device if self.tier is None else self._on_device_or_tier
        n = 0
        for i in range((seq.num_tokens - 1) // bs):
            if i == len(memo):
                memo.append(hash_block(memo[-1] if memo else None, token_slice(seq, i * bs, (i + 1) * bs),
                                       seq.cache_namespace))
            if not all(held(g, memo[i]) for g in full):
                break
            n = i + 1
        return memo[:n]

    def _on_device(self, g: int, h: BlockHash) -> bool:
        return h in self._by_hash[g]

    def _on_device_or_tier(self, g: int, h: BlockHash) -> bool:
        return h in self._by_hash[g] or self.tier.contains(tier_key(g, h))

    def _longest_hit(self, hashes: list[BlockHash], held) -> int:
        """Cached blocks a new sequence can start from: the most leading blocks (at most len(hashes)) for which
        every full group holds each block and every sliding group the blocks its window reaches; `held(g, h)`
        says whether group g has block h."""
        n = len(hashes)
        bs = self.block_size
        for g, group in enumerate(self.groups):
            run = [0] * (n + 1)  # run[i]: consecutive cached blocks ending at block i - 1
            for i, h in enumerate(hashes[:n]):
                run[i + 1] = run[i] + 1 if held(g, h) else 0
            sinks = group.sink_blocks(bs)
            while n > 0 and (run[n] < n - group.first_needed_block(n * bs, bs) or run[min(sinks, n)] < min(sinks, n)):
                n -= 1
        return n

    def _tier_hit(self, hashes: list[BlockHash],
                  on_device: int) -> tuple[int, dict[tuple[int, int], tuple[bytes, str]]]:
        """The prefix the pool and the lower tier hold together, with the tier's pages read: (blocks, {(group,
        block index): (page, the level it came from)}). A page the tier cannot produce intact ends the prefix before its block (the tier
        drops it); where the pool has too few free blocks to load the pages into, the pool's own prefix
        (`on_device` blocks) stands."""
        bs = self.block_size
        read: dict[tuple[int, int], tuple[bytes, str]] = {}
        while True:
            n = self._longest_hit(hashes, self._on_device_or_tier)
            if n <= on_device:
                return on_device, {}
            wanted: list[tuple[int, int]] = []  # (group, block index) of the pages to read from the tier
            cached_hits = 0  # the pool's hits now in the LRU: taking them leaves fewer free blocks too
            for g, group in enumerate(self.groups):
                for i in group.kept(n * bs, n, bs):
                    bid = self._by_hash[g].get(hashes[i])
                    if bid is None:
                        wanted.append((g, i))
                    else:
                        cached_hits += self._blocks[bid].ref_count == 0
            # Should the sequence then find no room for its first chunk, the loaded blocks stay cached: its next
            # lookup finds them in the pool.
            if len(wanted) + cached_hits > self.num_free_blocks:
                return on_device, {}
            bad = None
            for g, i in wanted:
                if (g, i) not in read:
                    key = tier_key(g, hashes[i])
                    level = self.tier.level(key)
                    page = self.tier.get(key)
                    if page is None:
                        bad = i
                        break
                    read[g, i] = (page, level)
            if bad is None:
                return n, {key: read[key] for key in wanted}
            hashes = hashes[:bad]

    def _load(self, group: int, block_hash: BlockHash, page: bytes, tenant: str) -> int:
        """A fresh block for a page read from the tier, findable by hash at once (the load runs before the
        step's copies and forward read it)."""
        bid = self._take_free_block()
        self._register(group, bid, block_hash, tenant)
        self._loading[bid] = len(self._tier_ops.load)
        self._tier_ops.load.append((bid, page))
        return bid

    def _drop_passed_blocks(self, state: _SeqBlocks, start: int) -> None:
        """Sliding groups give back the blocks no query from position `start` on reads (NULL_PAGE instead)."""
        for table, group in zip(state.device, self.groups):
            first = group.first_needed_block(start, self.block_size)
            for i in range(min(first, len(table)) - 1, group.sink_blocks(self.block_size) - 1, -1):
                if table[i] == self._null:
                    break  # everything before it (to the sinks) went earlier
                self._release(table[i])
                table[i] = self._null

    def _shared_in_write_range(self, table: list[int], start: int, num_new_tokens: int) -> list[int]:
        """Indices of blocks the next write touches that another table also holds (these need COW).

        A pending copy's reference does not count: copies run before the forward pass writes.
        """
        if num_new_tokens <= 0:
            return []
        bs = self.block_size
        last = min(len(table), self._blocks_covering(start + num_new_tokens))
        return [i for i in range(start // bs, last)
                if self._blocks[table[i]].ref_count - self._pins.get(table[i], 0) > 1]

    def _copy_on_write(self, table: list[int], idx: int, keep_contents: bool) -> None:
        src = table[idx]
        dst = self._take_free_block()
        table[idx] = dst
        if keep_contents:
            self._copies[dst] = src  # our reference on src moves to the pending copy
            self._pins[src] = self._pins.get(src, 0) + 1
        else:
            self._release(src)

    def _take_free_block(self) -> int:
        if self._free:
            bid = self._free.popleft()
        else:
            bid = self._cached.pop_victim(self._clock())
            self._evict(bid)
        self._blocks[bid].ref_count = 1
        return bid

    def _evict(self, bid: int) -> None:
        """Take a cached block out of the prefix cache, to the lower tier unless it has the page already. A
        block whose load is still pending this step drops the load (the tier has its page)."""
        block = self._blocks[bid]
        assert block.block_hash is not None
        del self._by_hash[block.group][block.block_hash]
        if self.tier is not None:
            index = self._loading.pop(bid, None)
            if index is not None:
                self._tier_ops.load[index] = None
            else:
                key = tier_key(block.group, block.block_hash)
                if not self.tier.contains(key):
                    self._tier_ops.offload.append((bid, key))
                    self.offloaded_blocks += 1
        block.block_hash, block.retain_until = None, 0.0

    def _retain(self, blocks: list[int], seconds: float) -> None:
        """Keep these (held) blocks cached at least `seconds` after now, once they are released."""
        until = self._clock() + seconds
        for bid in blocks:
            block = self._blocks[bid]
            block.retain_until = max(block.retain_until, until)

    def _touch(self, bid: int) -> None:
        """Take a reference on a prefix-hit block, pulling it out of the LRU if it sat there."""
        block = self._blocks[bid]
        if block.ref_count == 0:
            self._cached.remove(bid)
        block.ref_count += 1

    def _release(self, bid: int) -> None:
        block = self._blocks[bid]
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        src = self._copies.pop(bid, None)
        if src is not None:  # nobody will read this COW destination: drop the copy
            self._unpin(src)
        if block.block_hash is not None:
            self._cached.add(bid, block.tenant, block.retain_until, self._clock() if block.retain_until else 0.0)
        else:
            self._free.append(bid)

    def _unpin(self, src: int) -> None:
        self._pins[src] -= 1
        if self._pins[src] == 0:
            del self._pins[src]
        self._release(src)

    def _release_pages(self, tables: list[list[int]]) -> None:
        # Tail first, so the end of a prefix chain is evicted before its beginning.
        for table in tables:
            for bid in reversed(table):
                if bid != self._null:
                    self._release(bid)

    def _register(self, group: int, bid: int, block_hash: BlockHash, tenant: str) -> bool:
        """Make a full block findable by hash in its group, unless it already is or another block holds the hash
        (False)."""
        block = self._blocks[bid]
        by_hash = self._by_hash[group]
        if block.block_hash is not None or block_hash in by_hash:
            return False
        block.block_hash, block.group, block.tenant = block_hash, group, tenant
        by_hash[block_hash] = bid
        return True

    def _commit_lookup(self, seq_id: int) -> None:
        queried, hit, from_tier, from_host = self._pending_lookup.pop(seq_id, (0, 0, 0, 0))
        self.prefix_query_tokens += queried
        self.prefix_hit_tokens += hit
        self.tier_hit_tokens += from_tier
        self.host_hit_tokens += from_host
        if seq_id in self._seqs and queried:
            self._tier_tokens[seq_id] = (from_tier, from_host)
