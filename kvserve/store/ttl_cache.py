"""A per-key value read from the store and kept for a few seconds: whether a tenant has budgets or rate
limits is asked on every request, and a change made by another process takes effect within the TTL."""
from __future__ import annotations

import threading
import time
from typing import Callable, Generic, TypeVar

V = TypeVar("V")


class TTLCache(Generic[V]):
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.clock = ttl_s, clock
        self._entries: dict[str, tuple[V, float]] = {}
        self._lock = threading.Lock()

    def get(self, key: str, load: Callable[[], V]) -> V:
        now = self.clock()
        with self._lock:
            hit = self._entries.get(key)
        if hit is not None and now - hit[1] < self.ttl_s:
            return hit[0]
        value = load()
        with self._lock:
            self._entries[key] = (value, now)
        return value

    def forget(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)
