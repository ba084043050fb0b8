"""/dashboard: the spend, cost and serving page for admins. The page, its script and the vendored chart
library (uPlot, vendor/uplot/README.md) are static files of the package (kvserve/metering/dashboard),
nothing fetched from elsewhere. The script reads one admin endpoint, /v1/admin/dashboard, built from what
/v1/usage, /v1/admin/budgets and /v1/metrics/serving use (usage aggregated in SQL: fast over a large
ledger), plus the load history the server samples every few seconds."""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from kvserve.metering.budgets import burn
from kvserve.metering.reports import BUCKET_WIDTHS, MAX_LIMIT, chart_buckets, served_break_even
from kvserve.metering.reports import page as usage_page
from kvserve.server.routes.admin import budget_json, require_admin
from kvserve.store.usage import REPORT_GROUPS

ASSETS = Path(__file__).resolve().parents[2] / "metering" / "dashboard"

router = APIRouter()


@router.get("/dashboard", include_in_schema=False)
async def dashboard():
    return FileResponse(ASSETS / "index.html", media_type="text/html")


async def _first_usage(store, now: float) -> float | None:
    """The start of the first minute with usage in the last MAX_LIMIT days, found day, hour, then minute
    (each step one aggregate over a bounded range; days and hours read the roll-ups)."""
    day = BUCKET_WIDTHS["1d"]
    start, end = (now // day - MAX_LIMIT["1d"] + 1) * day, now
    for width in (day, BUCKET_WIDTHS["1h"], BUCKET_WIDTHS["1m"]):
        rows = await store.ausage_buckets(start, end, width)
        if not rows:
            return None
        start += min(r["bucket"] for r in rows) * width
        end = min(now, start + width)
    return start


@router.get("/v1/admin/dashboard", include_in_schema=False)
async def dashboard_data(request: Request):
    """Everything the page draws, in one read: usage per tenant, model and tier in buckets sized to the
    ledger's span, budgets with their burn, serving percentiles and each model's sampled load."""
    state = await require_admin(request)
    now = time.time()
    await state.service.ledger.flush()
    width, start, n = chart_buckets(await _first_usage(state.store, now), now)
    groups = list(REPORT_GROUPS)
    usage = usage_page(await state.store.ausage_buckets(start, now, BUCKET_WIDTHS[width], groups), start, now, width,
                       groups, n)
    budgets = []
    for b in await state.store.aread(state.store.store.budgets.list, None):
        burned = burn(b, now)
        budgets.append({**budget_json(b), "burn_per_hour": burned.rate_per_hour, "exhausts_at": burned.exhausts_at,
                        "period_end": burned.period_end})
    metrics = state.metrics
    serving = [{**metrics.window.summary(h.id, h.live_stats()), "load": metrics.load.columns(h.id)}
               for h in state.models.values()]
    # Per model list prices and replica cost, and beside them what an output token must fetch to pay for the
    # engine time this traffic took (its prompts' included), at the utilisation break-even prices assume.
    prices = {h.id: {**asdict(h.spec.price), **served_break_even(h.spec.price, usage, h.id)}
              for h in state.models.values()}
    return JSONResponse({"now": now, "bucket_width": width, "usage": usage, "budgets": budgets, "serving": serving,
                         "load_sample_interval_s": state.config.load_sample_interval_s, "prices": prices})


def mount(app) -> None:
    app.include_router(router)
    app.mount("/dashboard/static", StaticFiles(directory=ASSETS), name="dashboard")
