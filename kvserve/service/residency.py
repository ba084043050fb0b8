"""Which models are loaded, for models loaded by demand (`load = "on_demand"`): pure policy, no I/O.

The served models hold at most `[server] model_memory` bytes together (their weights and KV pools). A model not
loaded that gets a request is loaded if it fits; otherwise the least recently used loaded models that are idle (no
call open on them), not pinned and loaded by demand are unloaded until it fits. Models loaded eagerly are never
unloaded. Where even that is not enough (the others are busy or pinned), the request waits for room
(CompletionService.ensure_loaded, up to load_wait_s), then gets 503 model_warming with Retry-After.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelState:
    """What the policy knows of one model."""

    id: str
    bytes: int  # what it holds loaded (measured once loaded; estimated before)
    loaded: bool  # loaded or loading: it holds (or is about to hold) its bytes
    busy: bool = False  # a call is open on it (from its routing to its response's end)
    last_used: float = 0.0  # when a call last came for it
    evictable: bool = True  # loaded by demand and not pinned


def to_unload(models: list[ModelState], incoming: str, budget: int | None) -> list[str] | None:
    """The models to unload so that `incoming` fits the budget, least recently used first ([] if it fits as is);
    None when it cannot fit now (the models that could make room are busy, pinned or loaded eagerly)."""
    want = next(m for m in models if m.id == incoming)
    if want.loaded or budget is None:
        return []
    held = sum(m.bytes for m in models if m.loaded)
    if held + want.bytes <= budget:
        return []
    victims, freed = [], 0
    for m in sorted((m for m in models if m.loaded and m.evictable and not m.busy and m.id != incoming),
                    key=lambda m: m.last_used):
        victims.append(m.id)
        freed += m.bytes
        if held - freed + want.bytes <= budget:
            return victims
    return None
