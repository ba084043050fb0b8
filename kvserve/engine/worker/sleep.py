"""Sleep mode's memory work (vLLM's `sleep(level=1)` on the CPU): a loaded model's weights written to a file and their
pages handed back to the OS, its KV pages handed back unsaved; on waking the weights are read back into the very
same addresses.

Why the same addresses: the fused decoder's layer table, the packed LM head and the LoRA slots are held by address
(models/native_decoder.py), so a sleeping model keeps every tensor object as it is and only its pages go. The
interior pages of each large storage are dropped with madvise(MADV_DONTNEED) (anonymous memory reads back as zeros
until written); the file is synced and dropped from the page cache, so the memory is free, not moved to the cache.
Waking reads the file (a sequential read of the packed weights) where a cold load parses the checkpoint, unpacks
and repacks every matrix, builds the model and plans its memory.

Only the process's own writable anonymous memory is touched (checked against /proc/self/maps): a tensor that maps
a file, or memory another library owns opaquely (oneDNN's reordered weights), stays resident.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MIN_BYTES = 1 << 20  # smaller storages stay: their few whole pages are not worth a write and a read
_MADV_DONTNEED = 4  # Linux
_MADV_POPULATE_WRITE = 23  # Linux 5.14: map pages writable, contents unchanged


class SleepUnsupported(RuntimeError):
    """This engine cannot sleep (not on the CPU, several ranks, not Linux): the message says why."""


class SleepBusy(SleepUnsupported):
    """This engine cannot sleep now: requests are in flight."""


@dataclass(frozen=True)
class SleepReport:
    paged_out_bytes: int  # the weights' bytes written to the file and freed
    discarded_bytes: int  # the KV pages freed unsaved
    seconds: float


def held_tensors(*roots) -> list[torch.Tensor]:
    """Every tensor reachable from `roots` through lists, tuples, dicts, torch modules and kvserve's own objects
    (parameters, buffers, packed weights, the fused decoder's packed copies, LoRA slots)."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, torch.nn.Module) or type(obj).__module__.startswith("kvserve."):
            stack.extend(getattr(obj, "__dict__", {}).values())
            stack.extend(getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s))
    return out


def regions(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The whole pages of the tensors' distinct CPU storages of MIN_BYTES or more that lie in this process's
    writable anonymous memory: (address, bytes), ascending."""
    spans = {}
    for t in tensors:
        if t.device.type != "cpu" or t.is_mkldnn or t.is_sparse or t.layout != torch.strided:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() >= MIN_BYTES:
            spans[storage.data_ptr()] = storage.nbytes()
    anonymous = _anonymous_writable()
    out = []
    for addr, size in sorted(spans.items()):
        start, end = -(-addr // PAGE) * PAGE, (addr + size) // PAGE * PAGE
        for lo, hi in anonymous:  # clipped to the mappings it lies in
            a, b = max(start, lo), min(end, hi)
            if a < b:
                out.append((a, b - a))
    return out


def _anonymous_writable() -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            path = fields[5] if len(fields) > 5 else ""
            if fields[1].startswith("rw") and path in ("", "[heap]"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def _libc():
    if not sys.platform.startswith("linux"):
        raise SleepUnsupported("sleep mode frees pages with Linux's madvise; this is " + sys.platform)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def populate(spans: list[tuple[int, int]]) -> bool:
    """Take the pages again without changing what they hold (MADV_POPULATE_WRITE), so steps writing them meanwhile
    lose nothing; False where the kernel predates it (the pages then come back as they are written)."""
    libc = _libc()
    for addr, size in spans:
        if libc.madvise(addr, size, _MADV_POPULATE_WRITE) != 0:
            return False
    return True


def free_pages(spans: list[tuple[int, int]]) -> int:
    """Hand the pages back to the OS (they read as zeros afterwards); the bytes freed."""
    libc = _libc()
    for addr, size in spans:
        if libc.madvise(addr, size, _MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), f"madvise({addr:#x}, {size}) failed")
    return sum(size for _, size in spans)


class PagedOut:
    """Pages written to an unlinked file in `directory` and freed; `restore` reads them back where they were."""

    def __init__(self, spans: list[tuple[int, int]], directory: str | None = None):
        self.spans = spans
        self.file = tempfile.TemporaryFile(prefix="kvserve-sleep-", dir=directory)
        try:
            for addr, size in spans:
                self.file.write((ctypes.c_char * size).from_address(addr))
            self.file.flush()
            os.fsync(self.file.fileno())
            # Out of the page cache too: the memory is the OS's again, not moved to the cache.
            os.posix_fadvise(self.file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except BaseException:
            self.file.close()  # nothing was freed yet
            raise
        self.bytes = free_pages(spans)

    def restore(self) -> None:
        self.file.seek(0)
        for addr, size in self.spans:
            view = (ctypes.c_char * size).from_address(addr)
            if self.file.readinto(view) != size:
                raise OSError(f"sleep file ended early at {addr:#x}: the weights are lost")
        self.file.close()


class Sleeper:
    """One engine's sleep: its model's weights paged out to a file, its KV pools discarded (the caller forgets the
    prefix cache first), and back."""

    def __init__(self, model, kv_pools: list, directory: str | None = None):
        self.model, self.kv_pools, self.directory = model, kv_pools, directory
        self.image: PagedOut | None = None
        self.freed: list[tuple[int, int]] = []  # the KV pools' pages freed
        self.populating: threading.Thread | None = None  # taking them again, after the last wake

    @property
    def asleep(self) -> bool:
        return self.image is not None

    def sleep(self) -> SleepReport:
        t0 = time.perf_counter()
        _libc()
        if self.populating is not None:  # the last wake's pages first, so that none is taken again after this frees it
            self.populating.join()
        weights = regions(held_tensors(self.model))
        self.image = PagedOut(weights, self.directory)
        self.freed = regions(held_tensors(self.kv_pools))
        discarded = free_pages(self.freed)
        return SleepReport(self.image.bytes, discarded, time.perf_counter() - t0)

    def wake(self) -> float:
        """Seconds to read the weights back: the model serves from then. The KV pools' memory is taken again in a
        thread meanwhile (as at start, the memory the pool needs is held, not found missing under load; faulting a
        few GB of pages in takes seconds, which the first steps need not wait for)."""
        t0 = time.perf_counter()
        image, self.image = self.image, None
        if image is not None:
            image.restore()
        spans, self.freed = self.freed, []
        self.populating = threading.Thread(target=populate, args=(spans,), name="kv-populate", daemon=True)
        self.populating.start()
        return time.perf_counter() - t0
