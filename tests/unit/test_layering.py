"""Arrows go down (docs/ARCHITECTURE.md, "Layers"): importing a package loads only packages below it, and the
pure modules load no torch. Each check imports in a fresh interpreter, which records who imported what, so
a failure names the chain of imports that pulled the offending module in.

Only imports that run when a module is imported count; an import inside a function (a CLI subcommand
reaching the CLI's helpers, the gateway building the server's app) is the caller's business.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvserve"

# Lowest first. A package may import packages of lower ranks only: not a higher one, nor one of its own rank.
# `kvserve` itself (kvserve/__init__.py) loads kernels.isa before anything can import torch, and nothing more.
RANKS: dict[str, int] = {
    "config": 0,
    "config_reference": 1,  # writes docs/configuration.md from config.py's dataclasses; reads config alone
    # metering sits low, not beside the service as the house plan draws it: what is left in it is pure
    # arithmetic (prices, money, budgets and rate-limit windows, reports) that the store's tables and the
    # planner's break-even prices build on; its store-backed part, the gate, is the service's (service/gate.py).
    "kernels": 1, "metering": 1,
    "models": 2, "store": 2,
    "engine": 3,
    "planning": 4,  # drives the engine's scheduler and KV manager; the service asks it for calibration priors
    "service": 5,
    "batch": 6,  # feeds the service; the server serves its /v1/files and /v1/batches
    "server": 7,
    "fleet": 8, "bench": 8,  # the fleet's gateway is the server's app; bench is a client of any server
    "cli": 9,
}

# Pure logic: token counts and block ids, prices and windows, arithmetic; no torch. In the engine that is every
# module outside its torch half (engine/worker/), listed by `_pure_engine_modules` below.
TORCH_FREE = [
    "kvserve.fleet.routing", "kvserve.service.router",
    "kvserve.metering.prices", "kvserve.metering.money", "kvserve.metering.budgets", "kvserve.metering.rate_limits",
    "kvserve.metering.reports",
    "kvserve.planning.roofline", "kvserve.planning.memory", "kvserve.planning.search", "kvserve.planning.simulator",
    "kvserve.planning.long_context", "kvserve.planning.serving",
    "kvserve.service.region_routing", "kvserve.metering.escrow",
    "kvserve.service.tool_formats", "kvserve.service.reasoning",
]

# The engine's rooms and the modules the rooms build on, lowest first: each may load only those of lower rank (its
# own modules aside). The request's types (its thinking block's among them) sit under the KV manager (which keeps a sequence's blocks), the step-time
# model under the speculation policy (which prices draft rows with one); the engine's other top-level modules (core, scheduler, admission, ...) rank ENGINE_TOP, between the KV manager and the torch half.
ENGINE_RANKS: dict[str, int] = {"errors": 0, "structured": 1, "reasoning": 1, "sampling": 2, "request": 3,
                                "step_time": 3, "kv": 4, "speculation": 4, "worker": 6}
ENGINE_TOP = 5
TORCH_HALF = "worker"


def _pure_engine_modules() -> list[str]:
    return [m for m in _modules_of("engine") if m.split(".")[2:3] != [TORCH_HALF]]


# Run in the child: import `modules`, recording for each new kvserve (or torch) module the module that imported it.
PROBE = r"""
import builtins, importlib, json, sys
parent = {}
_import = builtins.__import__
def _recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    before = set(sys.modules)
    try:
        return _import(name, globals, locals, fromlist, level)
    finally:
        importer = (globals or {}).get("__name__", "?")
        for m in set(sys.modules) - before:
            if m.split(".")[0] in ("kvserve", "torch"):
                parent.setdefault(m, importer)
builtins.__import__ = _recording_import
for name in json.loads(sys.argv[1]):
    __import__(name, {"__name__": "(the check)"})
print(json.dumps({"loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("kvserve", "torch")),
                  "parent": parent}))
"""


def _probe(modules: list[str]) -> tuple[set[str], dict[str, str]]:
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(modules)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"importing {modules} failed:\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return set(out["loaded"]), out["parent"]


def _chain(module: str, parent: dict[str, str]) -> str:
    """`module <- its importer <- ...` up to what the check imported."""
    links = [module]
    while links[-1] in parent and parent[links[-1]] not in links and len(links) < 30:
        links.append(parent[links[-1]])
    return " <- ".join(links)


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _modules_of(package: str) -> list[str]:
    path = PACKAGE / package
    if not path.is_dir():
        return [f"kvserve.{package}"]
    return sorted(".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                  for f in path.rglob("*.py") if f.name != "__main__.py")


def test_every_package_is_ranked():
    found = {f.parent.name for f in PACKAGE.glob("*/__init__.py")} | {f.stem for f in PACKAGE.glob("*.py")}
    assert found - {"__init__"} == set(RANKS), "rank the new package in RANKS (or drop the one that went)"


def test_the_root_package_loads_only_the_isa_settings():
    loaded, parent = _probe(["kvserve"])
    extra = loaded - {"kvserve", "kvserve.kernels", "kvserve.kernels.isa"}
    assert not extra, "importing kvserve loads more than kernels.isa:\n" + "\n".join(_chain(m, parent)
                                                                                     for m in sorted(extra))


@pytest.mark.parametrize("package", sorted(RANKS, key=RANKS.get))
def test_a_package_imports_only_packages_below_it(package):
    loaded, parent = _probe(_modules_of(package))
    baseline = {"kvserve", "kvserve.kernels", "kvserve.kernels.isa"}  # the root package's own, checked above
    above = sorted(m for m in loaded - baseline
                   if _package_of(m) in RANKS and _package_of(m) != package
                   and RANKS[_package_of(m)] >= RANKS[package])
    assert not above, (f"importing kvserve.{package} (rank {RANKS[package]}) loads packages at or above its rank:\n"
                       + "\n".join(f"  {_package_of(m)} (rank {RANKS[_package_of(m)]}): {_chain(m, parent)}"
                                   for m in above))


def _room_of(module: str) -> str | None:
    """The engine room or ranked module a kvserve.engine module belongs to (None for the other top-level ones)."""
    parts = module.split(".")
    return parts[2] if len(parts) >= 3 and parts[2] in ENGINE_RANKS else None


def _engine_rank(module: str) -> int:
    room = _room_of(module)
    return ENGINE_RANKS[room] if room else ENGINE_TOP


def test_every_engine_room_is_ranked():
    rooms = {f.parent.name for f in (PACKAGE / "engine").glob("*/__init__.py")}
    assert rooms <= set(ENGINE_RANKS), "rank the new engine room in ENGINE_RANKS"


@pytest.mark.parametrize("room", sorted(ENGINE_RANKS, key=ENGINE_RANKS.get))
def test_an_engine_room_loads_only_rooms_below_it(room):
    loaded, parent = _probe([m for m in _modules_of("engine") if _room_of(m) == room])
    above = sorted(m for m in loaded if m.startswith("kvserve.engine.") and _room_of(m) != room
                   and _engine_rank(m) >= ENGINE_RANKS[room])
    assert not above, (f"importing engine/{room} (rank {ENGINE_RANKS[room]}) loads engine modules at or above its "
                       "rank:\n" + "\n".join(f"  {_chain(m, parent)}" for m in above))


def test_the_engine_outside_its_torch_half_loads_neither_it_nor_torch():
    loaded, parent = _probe(_pure_engine_modules())
    bad = sorted(m for m in loaded if m == "torch" or _room_of(m) == TORCH_HALF)
    assert not bad, "the engine's pure modules load its torch half or torch:\n" + "\n".join(
        f"  {_chain(m, parent)}" for m in bad)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_pure_modules_import_no_torch(module):
    loaded, parent = _probe([module])
    assert "torch" not in loaded, f"{module} imports torch: {_chain('torch', parent)}"
