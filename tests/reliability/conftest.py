"""The reliability suite (issue: fuzzing, overload soak, faults and restarts, isolation). Each test runs at
two scales: `quick` inside `make test`'s budget, and `full` under `make reliability`
(KVSERVE_RELIABILITY=full), which also records every figure for RELIABILITY.md through `figures`."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

FULL = os.environ.get("KVSERVE_RELIABILITY") == "full"
OUT = os.environ.get("KVSERVE_RELIABILITY_OUT")  # a directory: figures.jsonl is appended there
RUN = time.time()  # this pytest session: a test rerun later replaces its figures (report.py keeps the latest)


def scale(quick, full):
    """The quick value inside `make test`, the full one under `make reliability`."""
    return full if FULL else quick


class Figures:
    """Figures for RELIABILITY.md: one JSON line each (section, name, value, target, ok, detail)."""

    def __init__(self, test: str):
        self.test = test

    def record(self, section: str, name: str, value, target: str = "", ok: bool | None = None,
               detail: str = "") -> None:
        if OUT is None:
            return
        Path(OUT).mkdir(parents=True, exist_ok=True)
        row = {"section": section, "name": name, "value": value, "target": target, "ok": ok, "detail": detail,
               "test": self.test, "scale": "full" if FULL else "quick", "time": time.time(), "run": RUN}
        with open(Path(OUT) / "figures.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.fixture
def figures(request) -> Figures:
    return Figures(request.node.nodeid)
