"""Pure routing and load-signal policy: no I/O, no engine imports; unit-tested in microseconds.

`model: "auto"` policy (in order):
  1. batch tier -> the fast model (throughput work does not take the capable model's slots);
  2. a short prompt (< `short_prompt_chars` characters) -> the fast model;
  3. the capable model when it is ready and its queue depth is below `capable_max_queue_depth`;
  4. otherwise the fast model.
If the preferred model is not ready and the other one is, the other one serves. If there is no
model with a role, the first configured model is used. A request that names a model is never
served by another (that is not this module's business: it only resolves "auto").

Load signal (`x-kvserve-load`), per model and tier:
  shedding: the tier's queue is at `shedding_fraction` of its bound (or one slot from it);
  high:     the queue is at `high_fraction` of its bound, or the recent TTFT p50 exceeds the tier target;
  ok:       otherwise.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

AUTO_MODEL = "auto"


class LoadLevel(str, enum.Enum):
    OK = "ok"
    HIGH = "high"
    SHEDDING = "shedding"


@dataclass(frozen=True)
class ModelView:
    """What the router needs to know about one served model at this instant."""

    id: str
    role: str  # "fast" | "capable" | ""
    ready: bool
    queue_depth: int  # requests waiting in the tier the request would join


@dataclass(frozen=True)
class AutoPolicy:
    short_prompt_chars: int = 256
    capable_max_queue_depth: int = 4


def choose_auto_model(models: list[ModelView], tier: str, prompt_chars: int, policy: AutoPolicy) -> str | None:
    """The id of the model that serves a model="auto" request, or None when no model is configured."""
    if not models:
        return None
    fast = next((m for m in models if m.role == "fast"), None)
    capable = next((m for m in models if m.role == "capable"), None)
    if fast is None and capable is None:
        return models[0].id
    if fast is None or capable is None:
        return (fast or capable).id

    def prefer(first: ModelView, second: ModelView) -> str:
        return second.id if (not first.ready and second.ready) else first.id

    if tier == "batch" or prompt_chars < policy.short_prompt_chars:
        return prefer(fast, capable)
    if capable.ready and capable.queue_depth < policy.capable_max_queue_depth:
        return capable.id
    return prefer(fast, capable)


def load_level(queue_depth: int, queue_bound: int | None, ttft_p50_ms: float | None, ttft_target_ms: float | None,
               high_fraction: float = 0.5, shedding_fraction: float = 0.9) -> LoadLevel:
    """ok / high / shedding from the tier's queue depth against its bound and recent TTFT against target."""
    if queue_bound is not None and queue_bound > 0:
        if queue_depth >= max(1, min(queue_bound * shedding_fraction, queue_bound - 1)):
            return LoadLevel.SHEDDING
        if queue_depth >= max(1, queue_bound * high_fraction):
            return LoadLevel.HIGH
    if ttft_p50_ms is not None and ttft_target_ms is not None and ttft_p50_ms > ttft_target_ms:
        return LoadLevel.HIGH
    return LoadLevel.OK


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of an already sorted list; None when empty."""
    if not sorted_values:
        return None
    if q <= 0:
        return sorted_values[0]
    rank = -(-q * len(sorted_values) // 100)  # ceil
    return sorted_values[min(len(sorted_values), max(1, int(rank))) - 1]
