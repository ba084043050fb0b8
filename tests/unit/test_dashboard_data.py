"""What the dashboard draws, as pure logic: the load ring the server samples into, the buckets sized to the
ledger's span, a budget's burn rate and projected exhaustion, and the spend counters on /metrics; and its
files shipped as package data."""
from __future__ import annotations

import tomllib
from datetime import datetime, timezone
from pathlib import Path

import pytest

from kvserve.metering.budgets import Budget, burn, period_end
from kvserve.metering.reports import CHART_MIN_BUCKETS, chart_buckets
from kvserve.service.load_history import LoadHistory, LoadPoint
from kvserve.service.metrics import LiveModelStats, ServerMetrics

HOUR, DAY = 3600.0, 86400.0
NOW = datetime(2026, 3, 11, 15, 30, 20, tzinfo=timezone.utc).timestamp()


def test_the_load_ring_keeps_the_latest_points_per_model():
    ring = LoadHistory(3)
    for i in range(5):
        ring.add("a", LoadPoint(100.0 + i, i / 10, i, {"interactive": i, "batch": 2 * i}))
    ring.add("b", LoadPoint(200.0, 0.5, 1))
    assert [p.at for p in ring.points("a")] == [102.0, 103.0, 104.0]
    cols = ring.columns("a")
    assert cols == {"t": [102.0, 103.0, 104.0], "kv_used_pct": [20.0, 30.0, 40.0], "running": [2, 3, 4],
                    "waiting_interactive": [2, 3, 4], "waiting_batch": [4, 6, 8]}
    assert ring.columns("b")["waiting_batch"] == [0]  # a tier with no count reads 0
    assert ring.columns("unknown")["t"] == []
    with pytest.raises(ValueError):
        LoadHistory(0)


def test_the_server_samples_every_models_load_into_the_ring():
    live = [LiveModelStats("m1", 2, {"interactive": 1, "batch": 3}, 0.25, 0, 0),
            LiveModelStats("m2", 0, {"interactive": 0, "batch": 0}, 0.0, 0, 0)]
    metrics = ServerMetrics(60.0, live=lambda: live, load_samples=2)
    for t in (1.0, 2.0, 3.0):
        metrics.sample_load(t)
    assert metrics.load.columns("m1") == {"t": [2.0, 3.0], "kv_used_pct": [25.0, 25.0], "running": [2, 2],
                                          "waiting_interactive": [1, 1], "waiting_batch": [3, 3]}
    assert metrics.load.columns("m2")["t"] == [2.0, 3.0]


def test_spend_and_cost_are_counted_per_tenant_model_and_tier():
    metrics = ServerMetrics(60.0)
    metrics.observe_usage("acme", "m", "batch", 0.002, 0.0005)
    metrics.observe_usage("acme", "m", "batch", 0.001, 0.0001)
    text = metrics.exposition().decode()
    assert 'kvserve:spend_usd_total{model_name="m",tenant="acme",tier="batch"} 0.003' in text
    assert 'kvserve:cost_usd_total{model_name="m",tenant="acme",tier="batch"} 0.0006' in text


@pytest.mark.parametrize("first_ago,width,count", [
    (None, "1m", CHART_MIN_BUCKETS),  # an empty ledger: the last few minutes
    (30.0, "1m", CHART_MIN_BUCKETS),
    (50 * 60, "1m", 51),  # 15:30:20 back to 14:40:20: the minutes 14:40 .. 15:30
    (20 * HOUR, "1h", 21),  # the last day: hourly, 19:00 yesterday .. 15:00
    (6 * DAY, "1h", 145),  # a week of hours still fits
    (10 * DAY, "1d", 11),
    (40 * DAY, "1d", 31),  # older than the longest page: its last 31 days
])
def test_chart_buckets_are_sized_to_the_ledgers_span(first_ago, width, count):
    first = None if first_ago is None else NOW - first_ago
    w, start, n = chart_buckets(first, NOW)
    assert (w, n) == (width, count)
    size = {"1m": 60, "1h": HOUR, "1d": DAY}[w]
    assert start % size == 0
    assert start + (n - 1) * size <= NOW < start + n * size  # the last bucket holds now
    if first is not None and n > CHART_MIN_BUCKETS and first_ago < 31 * DAY:
        assert start <= first < start + size  # the first bucket holds the first usage


def test_a_budgets_burn_rate_and_projected_exhaustion():
    month_start = datetime(2026, 3, 1, tzinfo=timezone.utc).timestamp()
    now = month_start + 10 * DAY
    slow = burn(Budget("acme", "*", amount=100.0, period="month", spent=20.0, reserved=5.0), now)
    assert slow.rate_per_hour == pytest.approx(20.0 / 240)
    assert slow.exhausts_at is None  # 75 left at 2 a day: 37.5 days, after the month ends
    assert slow.period_end == period_end("month", now)
    fast = burn(Budget("acme", "*", amount=100.0, period="month", spent=60.0, reserved=0.0), now)
    assert fast.exhausts_at == pytest.approx(now + 40.0 / (60.0 / (10 * DAY)))  # 6.7 days on: in this month
    assert burn(Budget("acme", "*", 100.0, "month", spent=0.0), now).exhausts_at is None
    assert burn(Budget("acme", "*", 10.0, "day", spent=9.0, reserved=1.0), now).exhausts_at == now  # used up
    forever = burn(Budget("acme", "*", 10.0, "none", spent=3.0), now)
    assert forever.rate_per_hour is None and forever.exhausts_at is None and forever.period_end is None


def test_the_page_and_its_vendored_chart_library_are_package_data():
    """An installed kvserve serves the dashboard from its package: every file under metering/dashboard must
    match pyproject's package-data globs (setuptools' globs do not descend into subfolders)."""
    root = Path(__file__).resolve().parents[2]
    package = root / "kvserve"
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kvserve"]
    shipped = {p for g in globs for p in package.glob(g) if p.is_file()}
    files = {p for p in (package / "metering" / "dashboard").rglob("*") if p.is_file()}
    assert package / "metering" / "dashboard" / "vendor" / "uplot" / "uPlot.iife.min.js" in files
    assert package / "metering" / "dashboard" / "vendor" / "uplot" / "LICENSE" in files
    assert files <= shipped, sorted(str(p.relative_to(package)) for p in files - shipped)


def test_the_break_even_an_output_token_must_fetch_at_the_served_mix():
    """All the model's engine seconds (prompts' included) over its output tokens, priced by break_even_price:
    2 s of engine time for 1,000 output tokens on a $0.36/hour replica, half busy, is $0.40 a million."""
    from kvserve.config import ModelPrice
    from kvserve.metering.reports import served_break_even

    def result(model, out, engine_s):
        return {"model": model, "output_tokens": out, "engine_seconds": engine_s}

    usage = {"data": [{"results": [result("a", 600, 1.5), result("b", 10, 9.0)]},
                      {"results": [result("a", 400, 0.5)]}, {"results": []}]}
    price = ModelPrice(replica_cost_per_hour=0.36)
    assert served_break_even(price, usage, "a") == {"break_even_output": pytest.approx(0.4),
                                                   "break_even_utilization": 0.5}
    assert served_break_even(price, usage, "c")["break_even_output"] is None  # no token yet: no figure
