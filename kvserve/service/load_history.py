"""A short history of each model's load (KV use, queue depth, running), pure: no clock, no I/O.

The server samples every few seconds (ServerState's sampler reads the engines' live stats), so the
dashboard can draw KV use and queues over the last minutes instead of one reading that is 0 whenever the
server happens to be idle. Each model keeps a bounded ring: memory stays fixed however long the server runs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvserve.config import TIER_NAMES


@dataclass(frozen=True)
class LoadPoint:
    at: float  # Unix seconds
    kv_usage: float  # fraction of device blocks held
    running: int
    waiting: dict = field(default_factory=dict)  # tier -> requests waiting


class LoadHistory:
    """The last `capacity` load points per model, oldest first."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._rings: dict[str, deque[LoadPoint]] = {}

    def add(self, model: str, point: LoadPoint) -> None:
        ring = self._rings.setdefault(model, deque(maxlen=self.capacity))
        ring.append(point)

    def points(self, model: str) -> list[LoadPoint]:
        return list(self._rings.get(model, ()))

    def columns(self, model: str) -> dict[str, list]:
        """Column-major (what a chart takes): times, KV use in percent, running, and waiting per tier."""
        pts = self.points(model)
        cols: dict[str, list] = {"t": [p.at for p in pts], "kv_used_pct": [round(100 * p.kv_usage, 2) for p in pts],
                                 "running": [p.running for p in pts]}
        for tier in TIER_NAMES:
            cols[f"waiting_{tier}"] = [p.waiting.get(tier, 0) for p in pts]
        return cols
