"""Host-memory tier of the KV cache, between a GPU's pool and the disk tier.

On CUDA the pool is device memory, and host memory is larger and far faster to read back than any disk: a
cached block the pool evicts is kept here as bytes (the runner copied the page out), least recently used out
first within a byte budget, and what this tier evicts goes on to the disk tier below it (when there is one),
so a page leaves memory for the disk only once both memories are full. A hit is read from here before the
disk is asked. On a CPU the pool already is host memory: this tier would only hold copies of what a larger
pool would hold in place, so it is for CUDA (the engine's `kv_host_bytes`).

One thread uses it (the engine's: the scheduler's lookups and the runner's offloads); the disk tier below has
its own writer. No torch: pages are bytes-like buffers.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Protocol

# Weight of the newest read in the moving average of a page read's time (admission's load estimates).
READ_TIME_WEIGHT = 0.1


class PageStore(Protocol):
    """The tier below (engine/kv/disk.py's DiskKVStore)."""

    def put(self, key: bytes, payload) -> bool: ...

    def get(self, key: bytes) -> bytes | None: ...

    def contains(self, key: bytes) -> bool: ...

    def load_seconds(self, keys: list[bytes]) -> float | None: ...

    def stored_bytes(self) -> int: ...


class HostKVStore:
    """Pages of `page_bytes` in host memory, at most `byte_budget` bytes of them, least recently used out first
    (to `below`, when given). A lower tier of the KV manager (kv_cache.LowerTier), levels "host" and, through
    `below`, "disk"."""

    def __init__(self, page_bytes: int, byte_budget: int, below: PageStore | None = None, write_through: bool = False):
        """`write_through`: every page put here goes on to `below` at once too (the engine's
        kv_disk_write_through), not only once this tier evicts it."""
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        if byte_budget < page_bytes:
            raise ValueError(f"byte_budget {byte_budget} holds no page of {page_bytes} bytes")
        self.page_bytes = page_bytes
        self.byte_budget = byte_budget
        self.below = below
        self.write_through = write_through and below is not None
        self._pages: OrderedDict[bytes, bytes] = OrderedDict()  # least recently used first
        self._max_pages = byte_budget // page_bytes
        self._read_s: float | None = None
        self.hits = 0
        self.demoted = 0  # pages evicted from here to the tier below

    def put(self, key: bytes, payload) -> bool:
        """Keep a page (copied: the caller may reuse its buffer); the least recently used go below. False: a
        page of the wrong length, dropped."""
        view = memoryview(payload)
        if view.nbytes != self.page_bytes:
            return False
        if self.write_through:
            self.below.put(key, payload)
        if key in self._pages:
            self._pages.move_to_end(key)
            return True
        self._pages[key] = view.tobytes()
        while len(self._pages) > self._max_pages:
            old, page = self._pages.popitem(last=False)
            if self.below is not None:
                self.below.put(old, page)
                self.demoted += 1
        return True

    def get(self, key: bytes) -> bytes | None:
        """The page from host memory, else from the tier below (None: in neither, or not intact there)."""
        started = time.perf_counter()
        page = self._pages.get(key)
        if page is None:
            return None if self.below is None else self.below.get(key)
        self._pages.move_to_end(key)
        took = time.perf_counter() - started
        self._read_s = took if self._read_s is None else self._read_s + READ_TIME_WEIGHT * (took - self._read_s)
        self.hits += 1
        return page

    def contains(self, key: bytes) -> bool:
        return self.level(key) is not None

    def level(self, key: bytes) -> str | None:
        """Where a page is: "host", "disk" (the tier below), or None."""
        if key in self._pages:
            return "host"
        return "disk" if self.below is not None and self.below.contains(key) else None

    def load_seconds(self, keys: list[bytes]) -> float | None:
        """Seconds reading these pages back takes: those in host memory at its measured read time (nothing
        until one is measured: a memory copy), the rest at the tier below's; None when that is unknown."""
        here = [k for k in keys if k in self._pages]
        rest = [k for k in keys if k not in self._pages]
        below = 0.0
        if rest:
            below = self.below.load_seconds(rest) if self.below is not None else None
            if below is None:
                return None
        return below + len(here) * (self._read_s or 0.0)

    def newest_pages(self) -> list[tuple[bytes, bytes]]:
        """(key, page) of every page held here, most recently used first (a shutdown saves them to the disk)."""
        return list(reversed(self._pages.items()))

    def level_bytes(self) -> dict[str, int]:
        """Bytes each level holds."""
        held = {"host": len(self._pages) * self.page_bytes}
        if self.below is not None:
            held["disk"] = self.below.stored_bytes()
        return held
