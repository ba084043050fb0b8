"""Operational endpoints: /health, /ready, /metrics (no auth), and the endpoints peer regions call."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvserve.engine.client import EngineStatus
from kvserve.server.auth import authenticate
from kvserve.server import openapi
from kvserve.server.errors import APIError
from kvserve.server.routes.admin import require_admin
from kvserve.server.serving import read_json_body
from kvserve.server.state import ServerState
from kvserve.service import protocol as p

router = APIRouter()


def _models(state: ServerState) -> dict:
    out = {}
    for h in state.models.values():
        health = h.client.health()
        out[h.id] = {"status": h.status.value, "stalled": h.client.is_stalled(state.config.stall_timeout_s),
                     "inflight": h.client.num_inflight, "error": health.error,
                     "load_seconds": None if health.load_seconds is None else round(health.load_seconds, 3)}
    return out


@router.get("/health")
async def health(request: Request):
    """503 when an engine failed or stalled (work pending and no step for --stall-timeout seconds)."""
    state: ServerState = request.app.state.kv
    models = _models(state)
    bad = [m for m, v in models.items() if v["stalled"] or v["status"] == EngineStatus.FAILED.value]
    body = {"status": "unhealthy" if bad else "ok", "draining": state.draining, "models": models}
    if bad:
        body["unhealthy_models"] = bad
    return JSONResponse(body, status_code=503 if bad else 200)


@router.get("/ready")
async def ready(request: Request):
    """200 only when every model is loaded (or, loaded by demand, not loaded until asked for) and the server is
    not draining."""
    state: ServerState = request.app.state.kv
    models = {h.id: h.status.value for h in state.models.values()}
    ok = not state.draining and all(s in (EngineStatus.READY.value, EngineStatus.UNLOADED.value,
                                          EngineStatus.SLEEPING.value)
                                    for s in models.values())
    return JSONResponse({"ready": ok, "draining": state.draining, "models": models}, status_code=200 if ok else 503)


@router.get("/v1/region/status")
async def region_status(request: Request):
    """This region as its peers' probes see it (server/regions.py); 404 where no regions are configured."""
    state: ServerState = request.app.state.kv
    return JSONResponse(_regions(state).status())


@router.get("/v1/region/keys/{key}")
async def region_key(request: Request, key: str):
    """Whether this region holds an Idempotency-Key of the caller's tenant ("done" or "in_progress"; 404 when
    not): a peer asks before it runs a retried request (server/regions.py). Authenticated as the tenant."""
    state: ServerState = request.app.state.kv
    front = _regions(state)
    tenant = await authenticate(request, state.store)
    held = await state.store.aidempotency_state(tenant.name, key)
    if held is None:
        raise APIError(404, "this region does not hold that Idempotency-Key", "invalid_request_error", "not_found")
    return JSONResponse({"region": front.local, "state": held})


@router.post("/v1/region/escrow/lease", openapi_extra=openapi.json_body(p.EscrowLease))
async def escrow_lease(request: Request):
    """The ledger region grants a peer a lease of a shared budget (server/budget_share.py). Admin token."""
    share, ask = await _ledger_call(request, p.EscrowLease)
    if ask.deadline is not None and time.time() > ask.deadline:  # its region stopped waiting: a grant would be lost
        return JSONResponse({"granted": 0.0, "expired": True})
    granted = await share.grant(ask.tenant, ask.model, ask.period_start, ask.region, ask.need)
    return JSONResponse({"granted": granted})


@router.post("/v1/region/escrow/release", openapi_extra=openapi.json_body(p.EscrowRelease))
async def escrow_release(request: Request):
    """A peer gives back lease it held unused. Admin token."""
    share, rel = await _ledger_call(request, p.EscrowRelease)
    await share.take_back(rel.tenant, rel.model, rel.period_start, rel.region, rel.amount)
    return JSONResponse({"released": rel.amount})


async def _ledger_call(request: Request, body_model):
    state: ServerState = request.app.state.kv
    front = _regions(state)
    await require_admin(request)
    share = front.budgets
    if share is None or not share.is_ledger:
        raise APIError(404, "this region does not keep the budget ledger", "invalid_request_error", "not_found")
    body = body_model.model_validate(await read_json_body(request, state.config.max_body_bytes))
    if body.region not in front.config.names:
        raise APIError(400, f"unknown region {body.region!r}", "invalid_request_error", "invalid_value", param="region")
    return share, body


def _regions(state: ServerState):
    if state.regions is None:
        raise APIError(404, "no regions are configured on this server", "invalid_request_error", "not_found")
    return state.regions


@router.get("/metrics", response_class=PlainTextResponse)  # the Prometheus text format
async def metrics(request: Request):
    state: ServerState = request.app.state.kv
    return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.get("/fleet/status")
async def fleet_status(request: Request):
    """In a fleet gateway: each model's pool, its replicas' live load and prefix hits, and this gateway's
    routing counts (fleet/client.py FleetClient.pool_status); on a single-process server, no models."""
    state: ServerState = request.app.state.kv
    pools = {h.id: h.client.pool_status() for h in state.models.values() if hasattr(h.client, "pool_status")}
    return JSONResponse({"fleet": bool(pools), "models": pools})
