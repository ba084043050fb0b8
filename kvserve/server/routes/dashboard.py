"""/dashboard: the spend, cost and serving page for admins. The page and its script are static files of the
package (kvserve/metering/dashboard, nothing fetched from elsewhere); the script reads the admin APIs with
the token the admin gives it, so every figure is what /v1/usage, /v1/admin/budgets and
/v1/metrics/serving say (aggregated in SQL: fast over a large ledger)."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

ASSETS = Path(__file__).resolve().parents[2] / "metering" / "dashboard"

router = APIRouter()


@router.get("/dashboard", include_in_schema=False)
async def dashboard():
    return FileResponse(ASSETS / "index.html", media_type="text/html")


def mount(app) -> None:
    app.include_router(router)
    app.mount("/dashboard/static", StaticFiles(directory=ASSETS), name="dashboard")
