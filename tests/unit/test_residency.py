"""Models loaded by demand (service/residency.py), the policy alone: what to unload for a model to fit."""
from __future__ import annotations

from kvserve.service.residency import ModelState, to_unload


def _m(i, loaded=True, busy=False, used=0.0, evictable=True, size=10):
    return ModelState(i, size, loaded, busy, used, evictable)


def test_the_least_recently_used_idle_models_make_room_and_no_more_than_needed():
    models = [_m("a", used=3), _m("b", used=1), _m("c", used=2), _m("new", loaded=False)]
    assert to_unload(models, "new", budget=40) == []  # 30 + 10 fits
    assert to_unload(models, "new", budget=30) == ["b"]
    assert to_unload(models, "new", budget=20) == ["b", "c"]
    assert to_unload(models, "a", budget=1) == []  # loaded already
    assert to_unload(models, "new", budget=None) == []


def test_busy_pinned_and_eager_models_stay_and_then_nothing_fits():
    models = [_m("busy", busy=True, used=0), _m("pinned", evictable=False, used=1), _m("idle", used=5),
              _m("new", loaded=False)]
    assert to_unload(models, "new", budget=30) == ["idle"]
    assert to_unload(models, "new", budget=20) is None  # busy and pinned hold 20: no room until one is free
    assert to_unload([_m("big", loaded=False, size=50)], "big", budget=40) is None  # larger than the budget
