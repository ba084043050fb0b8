"""Disk tier of the KV cache: fixed-size pages in files, keyed by block hash, for one cache geometry.

The engine offloads prefix blocks here and reads them back on a prefix hit. Data on disk is never
trusted: every read checks a header that binds the file to this namespace, key and page size, and a CRC
of the payload; anything wrong is a miss, and the file goes. Writes go through one background thread
(temp file, rename), so offloading never waits on the disk and a killed process never leaves a partial
page under a final name. No fsync by default: a page the kernel had not written when the machine itself
went down comes back short or zeroed, which its length and CRC turn into a miss (`durable=True` syncs
each page, for disks shared in ways that need it, at several times the cost per page). No torch: payloads are bytes-like buffers the runner fills and reads.

Page file `<root>/<hex[:2]>/<key hex>`, little endian:

  magic 8 | version u16 | reserved u16 (0) | sha256(namespace) 32 | key 32 | payload length u64 | crc32 u32
  payload (page_bytes)

CRC-32 rather than BLAKE2: it guards against torn writes, truncation and bit rot, which it catches as
surely (every burst up to 32 bits, other damage but for 2**-32), at about five times BLAKE2's speed here
(7 vs 1.4 GB/s on one core), faster than the disk it checks. Against someone who can write the directory
no unkeyed checksum helps; key and namespace are compared byte for byte, so a page never answers for
another key, tenant or model.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

MAGIC = b"KVSPAGE\x00"
FORMAT_VERSION = 1
KEY_BYTES = 32  # a block hash: sha256 digest (kv_cache.hash_block)
_HEADER = struct.Struct("<8sHH32s32sQI")
HEADER_BYTES = _HEADER.size
_TMP_SUFFIX = ".tmp"
# Weight of the newest read in the moving average of a page read's time (admission's load estimates).
READ_TIME_WEIGHT = 0.1
_HEX = frozenset("0123456789abcdef")


def kv_namespace(model_digest: str, dtype: str, block_size: int, layout: str) -> str:
    """The namespace of one cache geometry: a page written for another model file, dtype, block size or
    KV layout lives in another directory and never answers."""
    return json.dumps({"model": model_digest, "dtype": dtype, "block_size": int(block_size), "layout": layout},
                      sort_keys=True, separators=(",", ":"))


def model_digest(path: Path | str, cache_dir: Path | str | None = None) -> str:
    """sha256 of a model's files (a GGUF file, or a checkpoint directory's files in name order): pages written
    for one model never answer for another. Remembered in `cache_dir`/digests.json by path, size and mtime, so
    a restart does not read gigabytes again."""
    path = Path(path).resolve()
    files = [path] if path.is_file() else sorted(f for f in path.iterdir() if f.is_file())
    stamp = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    memo = Path(cache_dir) / "digests.json" if cache_dir is not None else None
    known: dict = {}
    if memo is not None:
        try:
            known = json.loads(memo.read_text())
        except (OSError, ValueError):
            known = {}
        entry = known.get(str(path))
        if isinstance(entry, dict) and entry.get("stamp") == stamp:
            return str(entry["sha256"])
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
    digest = h.hexdigest()
    if memo is not None:
        known[str(path)] = {"stamp": stamp, "sha256": digest}
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_suffix(f".{os.getpid()}{_TMP_SUFFIX}")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, memo)
        except OSError:
            pass  # only the memo is lost
    return digest


@dataclass(frozen=True)
class DiskKVStats:
    """A snapshot. `bytes` counts whole files (header and payload), as the budget does; `misses` include
    `corrupt` (bad data on disk) and `io_errors` (the disk failed a read)."""

    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    io_errors: int = 0  # failed reads and writes
    writes: int = 0
    dropped_writes: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


class DiskKVStore:
    """Pages of `page_bytes` under `directory/<sha256(namespace)[:16]>/`, at most `byte_budget` bytes of
    files, least recently used out first. Thread-safe. One live store per directory and namespace: another
    process on the same files reads only verified pages, but budgets and indexes are not shared, and opening
    removes every temp file, another process's in-flight ones too."""

    def __init__(self, directory: Path | str, namespace: str, page_bytes: int, byte_budget: int,
                 max_pending: int = 256, durable: bool = False):
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        if byte_budget < HEADER_BYTES + page_bytes:
            raise ValueError(f"byte_budget {byte_budget} holds no page of {HEADER_BYTES + page_bytes} bytes")
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self.namespace = namespace
        self.page_bytes = page_bytes
        self.byte_budget = byte_budget
        self.max_pending = max_pending
        self.durable = durable
        self._ns_digest = hashlib.sha256(namespace.encode()).digest()
        self.root = Path(directory) / self._ns_digest.hex()[:16]
        self._file_bytes = HEADER_BYTES + page_bytes
        self._max_entries = byte_budget // self._file_bytes  # every file has the same size
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # key -> generation, least recently used first; a key's generation changes whenever it is written
        # again, so a failed read removes only the file it failed on.
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._generations = itertools.count(1)
        self._tmp_names = itertools.count()
        self._queue: deque[tuple[bytes, bytes]] = deque()
        self._pending: set[bytes] = set()  # queued or being written
        self._closed = False
        self._counts = {f.name: 0 for f in fields(DiskKVStats) if f.name not in ("entries", "bytes")}
        self._read_s: float | None = None  # seconds one verified page read takes (moving average)
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    # -- public API --------------------------------------------------------------------------------------

    def put(self, key: bytes, payload) -> bool:
        """Queue `payload` for the writer; never waits on the disk. False: dropped (queue full,
        wrong length, closed). A key stored or already pending is not written again (True)."""
        key = _check_key(key)
        view = memoryview(payload)
        with self._lock:
            verdict = self._admit_locked(key, view.nbytes)
        if verdict is not None:
            return verdict
        # The caller may reuse a buffer at once: copied (outside the lock), unless it is bytes, which never change.
        data = payload if type(payload) is bytes else view.tobytes()
        with self._changed:
            verdict = self._admit_locked(key, view.nbytes)
            if verdict is not None:
                return verdict
            self._queue.append((key, data))
            self._pending.add(key)
            self._changed.notify_all()
        return True

    def write_now(self, key: bytes, payload) -> bool:
        """Write one page synchronously (the writer's step): temp file (synced when durable), rename. True when the page is
        stored, now or before; False when dropped (wrong length) or the disk failed."""
        key = _check_key(key)
        view = _flat(payload)
        if view.nbytes != self.page_bytes:
            with self._lock:
                self._counts["dropped_writes"] += 1
            return False
        with self._lock:
            if key in self._index:
                return True
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, self._ns_digest, key, self.page_bytes, zlib.crc32(view))
        path = self._path(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{next(self._tmp_names)}{_TMP_SUFFIX}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # every time: someone may have removed it
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                _write_all(fd, header)
                _write_all(fd, view)
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                os.replace(tmp, path)
                self._index[key] = next(self._generations)
                self._index.move_to_end(key)
                self._counts["writes"] += 1
                self._counts["bytes_written"] += self._file_bytes
                self._evict_locked()
            return True
        except OSError:
            with self._lock:
                self._counts["io_errors"] += 1
            _remove(tmp)
            return False

    def save(self, keys: list[bytes], pages: Callable[[list[bytes]], list], deadline: float, batch: int = 16) -> int:
        """A shutdown's save of a pool: write, in the calling thread, the pages of `keys` (most recently used
        first) that the store neither holds nor has queued, until `deadline` (time.monotonic()). Only the first
        keys the budget holds count, and those held already are made recent first, so a write evicts older pages,
        never one of these; afterwards the store's recency, and the files' mtimes that a restart reads it from,
        follow `keys`. `pages(some keys)` gives their payloads, asked for `batch` at a time (a passed deadline
        wastes at most one batch's copy). Returns the pages written."""
        keys = list(dict.fromkeys(_check_key(k) for k in keys))[:self._max_entries]
        with self._lock:
            for key in reversed(keys):
                if key in self._index:
                    self._index.move_to_end(key)
            todo = [k for k in keys if k not in self._index and k not in self._pending]
        written = 0
        for start in range(0, len(todo), batch):
            if time.monotonic() >= deadline:
                break
            chunk = todo[start:start + batch]
            for key, payload in zip(chunk, pages(chunk)):
                if time.monotonic() >= deadline:
                    break
                written += self.write_now(key, payload)
        self._make_recent(keys)
        return written

    def get(self, key: bytes) -> bytes | None:
        """The page stored under `key`, or None. Bad data, a missing file or a failing disk is a miss that
        drops the entry and its file; nothing read from disk raises."""
        key = _check_key(key)
        with self._lock:
            generation = self._index.get(key)
            if generation is None:
                self._counts["misses"] += 1
                return None
        path = self._path(key)
        failure = None
        started = time.perf_counter()
        try:
            payload = self._read(path, key)
            if payload is None:
                failure = "corrupt"
        except FileNotFoundError:
            payload = None
        except OSError:
            payload, failure = None, "io_errors"
        if payload is not None:
            took = time.perf_counter() - started
            with self._lock:
                self._read_s = took if self._read_s is None else self._read_s + READ_TIME_WEIGHT * (took - self._read_s)
                self._counts["hits"] += 1
                self._counts["bytes_read"] += self._file_bytes
                if key in self._index:
                    self._index.move_to_end(key)
            try:
                os.utime(path)  # recency that survives a restart
            except OSError:
                pass
            return payload
        with self._lock:
            self._counts["misses"] += 1
            if failure is not None:
                self._counts[failure] += 1
            if self._index.get(key) == generation:  # not rewritten meanwhile: the file we failed on
                del self._index[key]
                _remove(path)
        return None

    def contains(self, key: bytes) -> bool:
        """Whether the index holds `key` (no disk access; a pending write is not held yet)."""
        key = _check_key(key)
        with self._lock:
            return key in self._index

    def load_seconds(self, keys: list[bytes]) -> float | None:
        """Seconds reading these pages back takes, from the reads measured so far; None before the first."""
        with self._lock:
            return None if self._read_s is None else len(keys) * self._read_s

    def level(self, key: bytes) -> str | None:
        """"disk" where the index holds `key` (kv_cache.LowerTier's level)."""
        return "disk" if self.contains(key) else None

    def level_bytes(self) -> dict[str, int]:
        return {"disk": self.stored_bytes()}

    def stored_bytes(self) -> int:
        """Bytes of the pages stored (whole files, as the budget counts them)."""
        with self._lock:
            return len(self._index) * self._file_bytes

    def stats(self) -> DiskKVStats:
        with self._lock:
            return DiskKVStats(entries=len(self._index), bytes=len(self._index) * self._file_bytes, **self._counts)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Refuse new puts, finish the queued ones, stop the writer. Reads still work."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._writer.join(timeout)

    def __enter__(self) -> "DiskKVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------------------

    def _admit_locked(self, key: bytes, nbytes: int) -> bool | None:
        """put's verdict without queuing: True (held already), False (dropped), None (queue it)."""
        if key in self._index or key in self._pending:
            return True
        if self._closed or nbytes != self.page_bytes or len(self._pending) >= self.max_pending:
            self._counts["dropped_writes"] += 1
            return False
        return None

    def _write_loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                key, data = self._queue.popleft()
            try:
                self.write_now(key, data)
            except Exception:  # a bug must not stop the writer and leave flush() waiting
                with self._lock:
                    self._counts["io_errors"] += 1
            finally:
                with self._changed:
                    self._pending.discard(key)
                    self._changed.notify_all()

    def _read(self, path: Path, key: bytes) -> bytes | None:
        """The verified payload, or None when the file's content is wrong."""
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
            if len(header) != HEADER_BYTES:
                return None
            magic, version, reserved, ns_digest, file_key, length, crc = _HEADER.unpack(header)
            if (magic != MAGIC or version != FORMAT_VERSION or reserved != 0 or ns_digest != self._ns_digest
                    or file_key != key or length != self.page_bytes):
                return None
            payload = f.read(length)
            if len(payload) != length or f.read(1) or zlib.crc32(payload) != crc:
                return None
            return payload

    def _make_recent(self, keys: list[bytes]) -> None:
        """The held ones of `keys` become the most recently used, the first newest, in the index and by mtime."""
        with self._lock:
            held = [key for key in reversed(keys) if key in self._index]
            for key in held:
                self._index.move_to_end(key)
        now = time.time_ns()
        for i, key in enumerate(held):
            try:
                os.utime(self._path(key), ns=(now + 1000 * i,) * 2)  # apart on a microsecond clock too
            except OSError:
                pass  # only its recency after a restart is lost

    def _scan(self) -> None:
        """Rebuild the index from the files, oldest modification first; remove temp files of interrupted
        writes and files of the wrong size, then hold the budget. Contents are checked when read."""
        found: list[tuple[int, bytes]] = []
        for sub in _entries(self.root):
            if not (len(sub.name) == 2 and set(sub.name) <= _HEX and sub.is_dir(follow_symlinks=False)):
                continue
            for entry in _entries(sub.path):
                if entry.name.endswith(_TMP_SUFFIX):
                    _remove(entry.path)
                    continue
                key = _key_of(entry.name)
                if key is None or not entry.name.startswith(sub.name):
                    continue  # not ours: left alone
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_size != self._file_bytes:
                    _remove(entry.path)
                    continue
                found.append((st.st_mtime_ns, key))
        found.sort()
        with self._lock:
            for _, key in found:
                self._index[key] = next(self._generations)
            self._evict_locked()

    def _evict_locked(self) -> None:
        while len(self._index) > self._max_entries:
            key, _ = self._index.popitem(last=False)
            _remove(self._path(key))
            self._counts["evictions"] += 1

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / name


def _check_key(key) -> bytes:
    key = bytes(key)
    if len(key) != KEY_BYTES:
        raise ValueError(f"a key is {KEY_BYTES} bytes (a block hash), got {len(key)}")
    return key


def _key_of(name: str) -> bytes | None:
    if len(name) != 2 * KEY_BYTES or not set(name) <= _HEX:
        return None
    return bytes.fromhex(name)


def _flat(payload) -> memoryview:
    """A 1-D byte view of any bytes-like payload (a copy only when it is not contiguous)."""
    view = memoryview(payload)
    if not view.c_contiguous:
        return memoryview(view.tobytes())
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _entries(path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _remove(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
