"""LoRA adapters in the engine, the bookkeeping: which adapters are resident in host memory and which sit in the
device's slots. No torch, no I/O: an adapter's weights are read by models/lora.read_adapter, off the step's thread
(engine/worker/adapters.py), and copied into a slot by the runner.

- Host memory holds at most `capacity` adapters (`max_cpu_loras`): adding one past that unloads the least recently
  used that is neither pinned nor in use by a request; where every one is, the load is refused (LoRAFull).
- The device holds `max_loras` slots; a step uses at most that many adapters (the scheduler's rule), so a step's
  adapters always fit: those already in a slot keep it, the others take the least recently used slots that the
  step does not use.

An adapter is known by its key, "name@digest" (engine/worker/adapters.py): a name reloaded from other weights is
another adapter to the prefix cache and to the slots.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvserve.config import LoRAAdapterSpec

T = TypeVar("T")

__all__ = ["AdapterCache", "LoRAAdapterSpec", "LoRAFull", "LoRARequest", "SlotTable"]


@dataclass(frozen=True)
class LoRARequest:
    """An offline request's adapter, as vLLM's (`LLM.generate(..., lora_request=LoRARequest("sql", 1, path))`):
    read from `lora_path` the first time its name is used. `lora_int_id` is accepted for vLLM's signature; the
    engine keys adapters by name and the digest of their files."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


class LoRAFull(RuntimeError):
    """Host memory's adapters are all pinned or in use: no room for another until one is released."""


@dataclass
class _Resident(Generic[T]):
    value: T
    pinned: bool
    users: int = 0


class AdapterCache(Generic[T]):
    """The host-resident adapters by key, least recently used first; thread-safe (loads come from the server's
    threads, uses from the engine's)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"an adapter cache holds at least one adapter, not {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, _Resident[T]] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._items)

    def get(self, key: str) -> T:
        """The adapter (KeyError if it is not resident), now the most recently used."""
        with self._lock:
            item = self._items[key]
            self._items.move_to_end(key)
            return item.value

    def put(self, key: str, value: T, pinned: bool = False) -> list[str]:
        """Hold `value` under `key` (pinned: never unloaded by the LRU); returns the keys unloaded to make room."""
        with self._lock:
            if key in self._items:
                item = self._items[key]
                item.pinned = item.pinned or pinned
                self._items.move_to_end(key)
                return []
            evicted = []
            while len(self._items) >= self.capacity:
                victim = next((k for k, v in self._items.items() if not v.pinned and not v.users), None)
                if victim is None:
                    raise LoRAFull(f"{len(self._items)} adapters are resident (max_cpu_loras = {self.capacity}), "
                                   "each pinned or serving a request")
                del self._items[victim]
                evicted.append(victim)
            self._items[key] = _Resident(value, pinned)
            return evicted

    def acquire(self, key: str) -> None:
        """A request uses the adapter: it stays resident until `release`."""
        with self._lock:
            self._items[key].users += 1
            self._items.move_to_end(key)

    def release(self, key: str) -> None:
        with self._lock:
            item = self._items.get(key)
            if item is not None and item.users > 0:
                item.users -= 1

    def remove(self, key: str) -> bool:
        """Unload it now (an admin's unload); False when a request still uses it."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return True
            if item.users:
                return False
            del self._items[key]
            return True


class SlotTable:
    """Which adapter key sits in each of the device's slots, least recently used first."""

    def __init__(self, slots: int):
        self.slots = slots
        self._by_key: OrderedDict[str, int] = OrderedDict()

    def assign(self, keys: list[str]) -> tuple[dict[str, int], list[tuple[int, str]]]:
        """Slots for a step's adapters: ({key: slot}, [(slot, key) to load first]). At most `slots` keys."""
        wanted = list(dict.fromkeys(keys))
        if len(wanted) > self.slots:
            raise ValueError(f"{len(wanted)} adapters in one step; the device holds {self.slots} (max_loras)")
        loads = []
        free = [s for s in range(self.slots) if s not in self._by_key.values()]
        for key in wanted:
            if key in self._by_key:
                self._by_key.move_to_end(key)
                continue
            if free:
                slot = free.pop(0)
            else:
                victim = next(k for k in self._by_key if k not in wanted)
                slot = self._by_key.pop(victim)
            self._by_key[key] = slot
            loads.append((slot, key))
        return {key: self._by_key[key] for key in wanted}, loads

    def drop(self, key: str) -> int | None:
        """Forget an unloaded adapter's slot (its slot is free again); the slot, if it had one."""
        return self._by_key.pop(key, None)
